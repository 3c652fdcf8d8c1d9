"""Prefill worker: computes prompts (chunked, batched), samples token 1, sends the KV to decode.

A request's pages stay allocated here until the transfer's result: only then are they freed
and the gateway told (PrefillDone), so nothing is read from a page that was reused.

The KV of a prompt whose last chunk is in a step is sent from inside that step's forward:
layer group by layer group (--transfer-layer-groups), each queued as soon as the forward has
computed it (on GPU the sender waits on an event recorded then), so the transfer of early
layers overlaps the compute of later ones. Token 1 is sampled after the forward and travels
in PrefillDone, once the transfer's result is in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pd_serve.engine.request import FinishReason, Request
from pd_serve.protocol import AbortRequest, Prefill, PrefillDone
from pd_serve.transfer.sender import KVSender
from pd_serve.worker import Worker, WorkerConfig, logprob_dict, make_request


@dataclass
class _Job:
    request: Request
    decode_address: str
    dst_page_ids: list[int]
    arrived: float = field(default_factory=time.monotonic)
    computed: float = 0.0  # when token 1 was sampled


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, config: WorkerConfig):
        super().__init__(config)
        self.sender = KVSender(self.core.kv_pool, self.transfer_backend, sender_id=self.worker_id,
                               timeout_s=config.transfer_timeout_s)
        self.jobs: dict[str, _Job] = {}  # computing or sending
        num_layers = self.core.kv_pool.layout.num_layers
        groups = min(config.transfer_layer_groups, num_layers)
        # Layer index after which each group is complete, e.g. 32 layers, 4 groups: 7, 15, 23, 31.
        self.group_ends = {round(num_layers * (g + 1) / groups) - 1: g for g in range(groups)}

    def status_fields(self) -> dict:
        return {"transfer_backend": self.transfer_backend}

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest
        return super().metrics_text() + generate_latest(self.sender.stats.registry).decode()

    def busy(self) -> bool:
        return bool(self.jobs)

    def handle(self, msg) -> None:
        if isinstance(msg, Prefill):
            try:
                request = make_request(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.priority)
                self.core.check_prompt(request.prompt_token_ids)
                needed = -(-request.num_prompt_tokens // self.core.kv_pool.layout.page_size)
                if needed != len(msg.dst_page_ids):
                    raise ValueError(f"decode reserved {len(msg.dst_page_ids)} pages, the prompt needs {needed}")
            except (ValueError, TypeError) as e:
                self.send(PrefillDone(msg.request_id, ok=False, error=str(e)))
                return
            self.jobs[msg.request_id] = _Job(request, msg.decode_address, msg.dst_page_ids)
            self.core.scheduler.add(request)
        elif isinstance(msg, AbortRequest):
            job = self.jobs.get(msg.request_id)
            if job is None:
                return
            if job.computed:
                self.sender.abort(msg.request_id)  # its result frees the pages
            else:
                self.core.scheduler.finish(job.request, FinishReason.ABORT)
                del self.jobs[msg.request_id]

    def _send_finished_layers(self, plan, layer: int) -> None:
        """Called by the forward after each layer: at a group's last layer, queue that group's
        KV of every prompt this step completes."""
        if layer not in self.group_ends:
            return
        ends = sorted(self.group_ends)
        start = 0 if layer == ends[0] else ends[ends.index(layer) - 1] + 1
        last = layer == ends[-1]
        for chunk in plan.chunks:
            if chunk.sample:  # the prompt's last chunk: its KV is complete up to `layer`
                job = self.jobs[chunk.request.request_id]
                self.sender.send(chunk.request.request_id, job.decode_address,
                                 chunk.request.page_ids, job.dst_page_ids, start, layer + 1, last)

    def tick(self) -> None:
        for result in self.sender.poll():
            job = self.jobs.pop(result.request_id, None)
            if job is None:
                continue
            request = job.request
            self.core.allocator.free(request.page_ids)
            request.page_ids = []
            lp = request.output_logprobs[0] if request.output_logprobs else None
            timings = {"prefill_queue": 0.0, "prefill": job.computed - job.arrived,
                       "transfer": result.seconds, "transfer_bytes": result.num_bytes}
            self.send(PrefillDone(request.request_id, result.ok, request.output_token_ids[0],
                                  logprob_dict(lp), result.error, timings))
        if not self.core.scheduler.has_unfinished():
            return
        plan, sampled = self.core.step(on_layer=self._send_finished_layers)
        self.metrics.prompt_tokens.inc(plan.num_tokens)
        for request in sampled:  # token 1 is out; its KV is on its way
            self.jobs[request.request_id].computed = time.monotonic()
            self.core.scheduler.detach(request)
        for request in plan.finished:  # longer than this worker's whole KV pool
            self.jobs.pop(request.request_id, None)
            self.send(PrefillDone(request.request_id, ok=False,
                                  error="the prompt needs more KV pages than the prefill pool holds"))
