"""Decode worker: reserves pages for a prompt, receives its KV, then decodes in continuous batches.

Lifecycle of a request here: Admit (pages reserved, receiver told to expect them) -> the KV
arrives (transfer result) and StartDecode brings token 1 -> running in the batch -> finished.
Abort or a failed transfer at any point frees the pages exactly once.

Under --tp N every rank receives its own KV heads on a receiver of its own (the gateway hands
prefill all N addresses); the connector (transfer/connector.py) expects and cancels on every
rank and reports the KV arrived once every rank's receiver says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_serve.config import TransferConfig, WorkerConfig
from pd_serve.engine.core import token_stop_reason
from pd_serve.engine.request import Request
from pd_serve.protocol import AbortRequest, Admit, AdmitReply, StartDecode, TokenBatch
from pd_serve.worker import Worker, end_row, make_request


@dataclass
class _Pending:
    request: Request
    kv_arrived: bool = False  # in every rank's pages
    first_token: StartDecode | None = None


class DecodeWorker(Worker):
    role = "decode"

    def __init__(self, config: WorkerConfig):
        super().__init__(config)
        self.addresses = self.connector.addresses  # one KV receiver per TP rank
        self.pending: dict[str, _Pending] = {}

    def transfer_config(self) -> TransferConfig:
        return TransferConfig("decode", self.transfer_backend, self.config.transfer_timeout_s,
                              self.worker_id, host=self.config.host, port=self.config.port,
                              cluster_key=self.config.cluster_key)

    def status_fields(self) -> dict:
        return {"transfer_backend": self.transfer_backend, "transfer_addresses": self.addresses}

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest
        return super().metrics_text() + generate_latest(self.connector.stats.registry).decode()

    def busy(self) -> bool:
        return self.core.scheduler.has_unfinished()

    def poll_ms(self) -> int:
        """Requests whose token 1 is here wait only for their KV: look again soon (1 ms)."""
        if self.busy():
            return 0
        return 1 if any(p.first_token is not None for p in self.pending.values()) else 10

    def held_request_ids(self) -> set[str]:
        return super().held_request_ids() | set(self.pending)

    def handle(self, msg) -> None:
        if isinstance(msg, Admit):
            self.send(self._admit(msg))
        elif isinstance(msg, StartDecode):
            pending = self.pending.get(msg.request_id)
            if pending is not None:
                pending.first_token = msg
                self._start_ready()
        elif isinstance(msg, AbortRequest):
            pending = self.pending.pop(msg.request_id, None)
            if pending is not None:
                self.connector.cancel(msg.request_id)
                self._free(pending.request)
            else:
                self.abort_in_scheduler(msg.request_id)

    def _admit(self, msg: Admit) -> AdmitReply:
        try:
            request = make_request(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.priority)
            self.core.check_request(request.prompt_token_ids, request.sampling_params)
        except (ValueError, TypeError) as e:
            return AdmitReply(msg.request_id, ok=False, error=str(e))
        sched = self.core.scheduler
        if len(self.pending) + len(sched.running) + len(sched.waiting) >= sched.config.max_running_requests:
            return AdmitReply(msg.request_id, ok=False, error="decode worker at --max-running-requests",
                              retryable=True)
        num_pages = -(-request.num_prompt_tokens // self.core.kv_pool.layout.page_size)
        page_ids = self.core.allocator.allocate(num_pages)
        if page_ids is None:
            return AdmitReply(msg.request_id, ok=False, error="decode KV cache full", retryable=True)
        request.page_ids = page_ids
        self.pending[msg.request_id] = _Pending(request)
        # No deadline until the KV starts to arrive: the prompt may wait its turn on prefill, while
        # the gateway's pings keep the reservation (or drop it: _reconcile, _gateway_gone).
        # Before the reply: no KV reaches a rank that does not expect it.
        self.connector.expect(msg.request_id, page_ids)
        return AdmitReply(msg.request_id, ok=True, dst_page_ids=page_ids,
                          transfer_addresses=self.addresses)

    def tick(self) -> None:
        for result in self.connector.poll():  # a failed one is cancelled on every rank already
            pending = self.pending.get(result.request_id)
            if pending is None:
                continue
            if result.ok:
                pending.kv_arrived = True
            else:
                del self.pending[result.request_id]
                self._free(pending.request)
                self.fail(result.request_id, f"KV transfer failed: {result.error}")
        self._start_ready()
        if self.core.scheduler.has_unfinished():
            self.step_and_stream()

    def _start_ready(self) -> None:
        """Requests with both their KV and token 1 join the running batch."""
        ready = [p for p in self.pending.values() if p.kv_arrived and p.first_token is not None]
        finished_items = []
        for p in ready:
            request, first = p.request, p.first_token
            del self.pending[request.request_id]
            request.num_computed_tokens = request.num_prompt_tokens
            request.output_token_ids.append(first.first_token_id)
            if first.logprob is not None:
                request.output_logprobs.append(first.logprob.to_engine())
            reason = token_stop_reason(request, self.core.eos_token_ids,
                                       self.core.max_model_len)
            self.core.scheduler.add_running(request)
            if reason is not None:  # token 1 already ends it (EOS, max_tokens=1)
                self.core.scheduler.finish(request, reason)
                finished_items.append(end_row(request.request_id, reason))
        if finished_items:
            self.send(TokenBatch(self.worker_id, finished_items))

    def _free(self, request: Request) -> None:
        self.core.allocator.free(request.page_ids)
        request.page_ids = []
