"""The prefill role: computes prompts (chunked, batched), samples token 1, sends the KV to decode.

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

from pd_serve.cache.pool import pages_for
from pd_serve.engine.plan import KVSend
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.scheduler import SchedulerOutput
from pd_serve.protocol import AbortRequest, Logprob, Prefill, PrefillDone
from pd_serve.role import RoleScheduler, prompt_logprob_rows
from pd_serve.transfer.base import TransferResult


@dataclass
class _Job:
    request: Request
    decode_addresses: list[str]  # one KV receiver per decode TP rank
    dst_page_ids: list[int]
    skip_pages: int  # leading pages decode holds already (its prefix cache): not sent
    arrived: float = field(default_factory=time.monotonic)
    computed: float = 0.0  # when token 1 was sampled
    step_s: float = 0.0  # the step that computed the prompt's last chunk, token 1 included


class PrefillScheduler(RoleScheduler):
    role = "prefill"

    def __init__(self, core, worker_id: str, connector, metrics=None):
        super().__init__(core, worker_id, connector, metrics)
        self.jobs: dict[str, _Job] = {}  # computing or sending

    def fail(self, request_id: str, error: str) -> list:
        return [PrefillDone(request_id, ok=False, error=error)]

    def handle(self, msg) -> list:
        if isinstance(msg, Prefill):
            try:
                request = self.new_request(msg)
                page_size = self.core.kv_pool.layout.page_size
                skip, partial = divmod(msg.dst_cached_tokens, page_size)
                if partial or not 0 <= msg.dst_cached_tokens < request.num_prompt_tokens:
                    raise ValueError(f"decode's cached tokens ({msg.dst_cached_tokens}) are not "
                                     f"whole pages of the prompt")
                needed = pages_for(request.num_prompt_tokens, page_size) - skip
                if needed != len(msg.dst_page_ids):
                    raise ValueError(f"decode reserved {len(msg.dst_page_ids)} pages, the prompt needs {needed}")
                self.connector.routes(len(msg.decode_addresses))  # a decode TP size the heads allow
            except (ValueError, TypeError) as e:
                return [PrefillDone(msg.request_id, ok=False, error=str(e))]
            self.jobs[msg.request_id] = _Job(request, list(msg.decode_addresses), msg.dst_page_ids, skip)
            self.scheduler.add(request)
        elif isinstance(msg, AbortRequest):
            job = self.jobs.get(msg.request_id)
            if job is None:
                return []
            if job.computed:
                self.connector.cancel(msg.request_id)  # its result frees the pages
            else:
                self.scheduler.finish(job.request, FinishReason.ABORT)
                del self.jobs[msg.request_id]
        return []

    def on_transfer(self, result: TransferResult) -> list:
        """Every part's result is in: no rank reads the pages any more."""
        job = self.jobs.get(result.request_id)
        if job is None or not job.computed:
            return []
        request = job.request
        del self.jobs[request.request_id]
        self.scheduler.release(request)
        lp = request.output_logprobs[0] if request.output_logprobs else None
        page_size = self.core.kv_pool.layout.page_size
        timings = {"prefill_queue": 0.0, "prefill": job.computed - job.arrived,
                   "prefill_step": job.step_s, "transfer": result.seconds,
                   "transfer_bytes": result.num_bytes, "cached_tokens": request.num_cached_tokens,
                   "transferred_tokens": request.num_prompt_tokens - job.skip_pages * page_size}
        return [PrefillDone(request.request_id, result.ok, request.output_token_ids[0],
                            None if lp is None else Logprob.of(lp), result.error, timings,
                            prompt_logprob_rows(request), retryable=not result.ok)]

    def poll_ms(self) -> int:
        """Prompts whose KV is on its way wait only for transfer results: look again soon."""
        return self.work_poll_ms() if self.has_work() else (1 if self.jobs else 10)

    def held_request_ids(self) -> set[str]:
        return set(self.jobs)

    def _sends(self, out: SchedulerOutput) -> list[KVSend]:
        """The prompts whose last chunk is in this step: their KV is complete after it (every
        rank sends its own KV heads of them, layer group by layer group, from the forward),
        the pages decode's prefix cache holds already excepted."""
        jobs = self.jobs
        sends = []
        for c in out.chunks:
            if c.sample:
                job = jobs[c.request.request_id]
                sends.append(KVSend(c.request.request_id, job.decode_addresses,
                                    c.request.page_ids[job.skip_pages:], job.dst_page_ids))
        return sends

    def step(self) -> list:
        start = time.monotonic()
        out, sampled = self.core.step(kv_sends=self._sends, on_layer=self.connector.send_layers)
        self.note_step(out, sampled)
        for request in sampled:
            self.jobs[request.request_id].step_s = time.monotonic() - start
        return self.postprocess(out, sampled)

    def postprocess(self, out: SchedulerOutput, sampled: list[Request]) -> list:
        """Token 1 is out and the KV on its way: the request leaves the batch, keeping its pages
        until the transfer's result (on_transfer). A prompt longer than the pool ends here."""
        self.metrics.prompt_tokens.inc(out.num_tokens)
        now = time.monotonic()
        for request in sampled:
            self.jobs[request.request_id].computed = now
            self.scheduler.detach(request)
        messages = []
        for request in out.finished:
            self.jobs.pop(request.request_id, None)
            messages.append(PrefillDone(request.request_id, ok=False, error="the prompt needs more "
                                        "KV pages than the prefill pool holds"))
        return messages
