"""Prefill worker: computes prompts (chunked, batched), samples token 1, sends the KV to decode.

A request's pages stay allocated here until the transfer's result: only then are they freed
and the gateway told (PrefillDone), so nothing is read from a page that was reused.

The KV of a prompt whose last chunk is in a step is sent from inside that step's forward:
layer group by layer group (--transfer-layer-groups), each queued as soon as the forward has
computed it (on GPU the sender waits on an event recorded then), so the transfer of early
layers overlaps the compute of later ones. Token 1 is sampled after the forward and travels
in PrefillDone, once the transfer's result is in.

Under --tp N every rank sends its own KV heads to the decode ranks that hold them
(transfer/connector.py); the connector reports a request once every part's result is in (a
failed part aborts the others), and only then are its pages freed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pd_serve.config import TransferConfig, WorkerConfig
from pd_serve.engine.request import FinishReason, Request
from pd_serve.protocol import AbortRequest, Logprob, Prefill, PrefillDone
from pd_serve.transfer.base import TransferResult
from pd_serve.engine.plan import KVSend
from pd_serve.worker import Worker, make_request


@dataclass
class _Job:
    request: Request
    decode_addresses: list[str]  # one KV receiver per decode TP rank
    dst_page_ids: list[int]
    arrived: float = field(default_factory=time.monotonic)
    computed: float = 0.0  # when token 1 was sampled
    step_s: float = 0.0  # the step that computed the prompt's last chunk, token 1 included


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, config: WorkerConfig):
        super().__init__(config)
        self.jobs: dict[str, _Job] = {}  # computing or sending

    def transfer_config(self) -> TransferConfig:
        return TransferConfig("prefill", self.transfer_backend, self.config.transfer_timeout_s,
                              self.worker_id, layer_groups=self.config.transfer_layer_groups,
                              cluster_key=self.config.cluster_key)

    def status_fields(self) -> dict:
        return {"transfer_backend": self.transfer_backend}

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest
        return super().metrics_text() + generate_latest(self.connector.stats.registry).decode()

    def busy(self) -> bool:
        return self.core.scheduler.has_unfinished()

    def poll_ms(self) -> int:
        """Prompts whose KV is on its way wait only for transfer results: look again soon."""
        return 0 if self.busy() else (1 if self.jobs else 10)

    def held_request_ids(self) -> set[str]:
        return set(self.jobs)

    def handle(self, msg) -> None:
        if isinstance(msg, Prefill):
            try:
                request = make_request(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.priority)
                self.core.check_request(request.prompt_token_ids, request.sampling_params)
                needed = -(-request.num_prompt_tokens // self.core.kv_pool.layout.page_size)
                if needed != len(msg.dst_page_ids):
                    raise ValueError(f"decode reserved {len(msg.dst_page_ids)} pages, the prompt needs {needed}")
                self.connector.routes(len(msg.decode_addresses))  # a decode TP size the heads allow
            except (ValueError, TypeError) as e:
                self.send(PrefillDone(msg.request_id, ok=False, error=str(e)))
                return
            self.jobs[msg.request_id] = _Job(request, list(msg.decode_addresses), msg.dst_page_ids)
            self.core.scheduler.add(request)
        elif isinstance(msg, AbortRequest):
            job = self.jobs.get(msg.request_id)
            if job is None:
                return
            if job.computed:
                self.connector.cancel(msg.request_id)  # its result frees the pages
            else:
                self.core.scheduler.finish(job.request, FinishReason.ABORT)
                del self.jobs[msg.request_id]

    def _sends(self, scheduled) -> list[KVSend]:
        """The prompts whose last chunk is in this step: their KV is complete after it (every
        rank sends its own KV heads of them, layer group by layer group, from the forward)."""
        return [KVSend(c.request.request_id, self.jobs[c.request.request_id].decode_addresses,
                       list(c.request.page_ids), self.jobs[c.request.request_id].dst_page_ids)
                for c in scheduled.chunks if c.sample]

    def tick(self) -> None:
        for result in self.connector.poll():
            job = self.jobs.get(result.request_id)
            if job is not None and job.computed:
                self._done(job, result)
        if not self.core.scheduler.has_unfinished():
            return
        start = time.monotonic()
        plan, sampled = self.core.step(kv_sends=self._sends, on_layer=self.connector.send_layers)
        self.metrics.prompt_tokens.inc(plan.num_tokens)
        for request in sampled:  # token 1 is out; its KV is on its way
            job = self.jobs[request.request_id]
            job.computed = time.monotonic()
            job.step_s = job.computed - start
            self.core.scheduler.detach(request)
        for request in plan.finished:  # longer than this worker's whole KV pool
            self.jobs.pop(request.request_id, None)
            self.send(PrefillDone(request.request_id, ok=False,
                                  error="the prompt needs more KV pages than the prefill pool holds"))

    def _done(self, job: _Job, result: TransferResult) -> None:
        """The transfer's result (every part's) is in: no rank reads the pages any more."""
        request = job.request
        del self.jobs[request.request_id]
        self.core.allocator.free(request.page_ids)
        request.page_ids = []
        lp = request.output_logprobs[0] if request.output_logprobs else None
        timings = {"prefill_queue": 0.0, "prefill": job.computed - job.arrived,
                   "prefill_step": job.step_s, "transfer": result.seconds,
                   "transfer_bytes": result.num_bytes}
        self.send(PrefillDone(request.request_id, result.ok, request.output_token_ids[0],
                              None if lp is None else Logprob.of(lp), result.error, timings))
