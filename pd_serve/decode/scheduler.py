"""The decode role: reserves pages for a prompt, receives its KV, then decodes in continuous batches.

Lifecycle of a request here: Admit (pages reserved, receiver told to expect them) -> the KV
arrives (transfer result) and StartDecode brings token 1 -> running in the batch -> finished.
Abort or a failed transfer at any point frees the pages exactly once. A request with a grammar
also waits for its compile (started at Admit, on the grammar thread: seconds for a large
schema), so that the running batch never waits for it.

Decode-side reuse: with the prefix cache on (the default; --disable-radix-cache), a finished
request's pages (prompt and output) stay cached here, and an admitted prompt starts on the
cached pages of its longest cached prefix: prefill sends only the pages after them, so a
multi-turn conversation routed back here (the gateway's cache_aware decode policy) moves only
its new turn's KV.

Under --tp N every rank receives its own KV heads on a receiver of its own (the gateway hands
prefill all N addresses); the connector (transfer/connector.py) expects and cancels on every
rank and reports the KV arrived once every rank's receiver says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_serve.engine.core import GRAMMAR_POLL_S
from pd_serve.engine.request import Request
from pd_serve.protocol import AbortRequest, Admit, AdmitReply, StartDecode
from pd_serve.role import RoleScheduler, end_row
from pd_serve.transfer.base import TransferResult


@dataclass
class _Pending:
    request: Request
    kv_arrived: bool = False  # in every rank's pages
    first_token: StartDecode | None = None


class DecodeScheduler(RoleScheduler):
    role = "decode"

    def __init__(self, core, worker_id: str, connector, metrics=None):
        super().__init__(core, worker_id, connector, metrics)
        self.pending: dict[str, _Pending] = {}  # admitted, not yet in the batch
        self._compiling = False  # a pending request has its KV and token 1, not its grammar

    def handle(self, msg) -> list:
        if isinstance(msg, Admit):
            return [self._admit(msg)]
        if isinstance(msg, StartDecode):
            pending = self.pending.get(msg.request_id)
            if pending is None:
                return []
            # A token 1 outside the vocabulary would fail the step, and with it the worker (the
            # step takes -1 for a token still pending): only this request fails.
            vocab = self.core.model_config.vocab_size
            if not 0 <= msg.first_token_id < vocab:
                self._drop_pending(msg.request_id)
                return self.fail(msg.request_id, f"token 1 ({msg.first_token_id}) is outside "
                                                 f"the vocabulary [0, {vocab})")
            pending.first_token = msg
            return self._start_ready()
        elif isinstance(msg, AbortRequest):
            if not self._drop_pending(msg.request_id):
                self.scheduler.abort(msg.request_id)
        return []

    def _drop_pending(self, request_id: str) -> bool:
        """Forget a request still waiting for its KV or token 1: its transfer cancelled, its
        reserved pages freed. False when it is not pending."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return False
        self.connector.cancel(request_id)
        self.scheduler.release(pending.request)
        return True

    def _admit(self, msg: Admit) -> AdmitReply:
        try:
            request = self.new_request(msg)
        except (ValueError, TypeError) as e:
            return AdmitReply(msg.request_id, ok=False, error=str(e))
        running, waiting = self.load()
        if len(self.pending) + running + waiting >= self.scheduler.config.max_running_requests:
            return AdmitReply(msg.request_id, ok=False, error="decode worker at --max-running-requests",
                              retryable=True)
        if not self.scheduler.reserve_prompt(request):
            return AdmitReply(msg.request_id, ok=False, error="decode KV cache full", retryable=True)
        self.pending[msg.request_id] = _Pending(request)
        self.core.grammar_ready(request)  # its compile starts now, while the KV comes
        # Only the pages after the cached prefix are sent. No deadline until the KV starts to
        # arrive: the prompt may wait its turn on prefill, while the gateway's pings keep the
        # reservation (or drop it: the worker's reconcile).
        # Before the reply: no KV reaches a rank that does not expect it.
        missing = request.page_ids[request.num_cached_tokens // self.core.kv_pool.layout.page_size:]
        self.connector.expect(msg.request_id, missing)
        return AdmitReply(msg.request_id, ok=True, dst_page_ids=missing,
                          transfer_addresses=self.connector.addresses,
                          cached_tokens=request.num_cached_tokens)

    def on_transfer(self, result: TransferResult) -> list:
        """A failed transfer is cancelled on every rank already: free the pages, fail the request."""
        pending = self.pending.get(result.request_id)
        if pending is None:
            return []
        if not result.ok:
            del self.pending[result.request_id]
            self.scheduler.release(pending.request)
            return self.fail(result.request_id, f"KV transfer failed: {result.error}")
        pending.kv_arrived = True
        return self._start_ready()

    def _start_ready(self) -> list:
        """Requests with their KV, token 1 and compiled grammar join the running batch. The
        gateway has token 1 already (from prefill): a token 1 that ends the request (EOS,
        max_tokens=1) is told as an end without a token."""
        arrived = [p for p in self.pending.values() if p.kv_arrived and p.first_token is not None]
        ready = [p for p in arrived if self.core.grammar_ready(p.request)]
        self._compiling = len(ready) < len(arrived)
        for p in ready:
            request, first = p.request, p.first_token
            del self.pending[request.request_id]
            request.output_token_ids.append(first.first_token_id)
            if first.logprob is not None:
                request.output_logprobs.append(first.logprob.to_engine())
            self.scheduler.add_running(request)
        ended = [(r, reason) for r, reason in self.core.apply_stops([p.request for p in ready])
                 if reason is not None]
        return self.token_batch([end_row(r.request_id, reason) for r, reason in ended])

    def has_work(self) -> bool:
        return super().has_work() or self._compiling

    def step(self) -> list:
        """One engine step, after the requests whose grammar has compiled since join it; with
        nothing else to run, a short wait for a compile (not a busy loop)."""
        started = self._start_ready() if self._compiling else []
        if not super().has_work():
            if self._compiling:
                self.core.executor.wait_for_grammars(GRAMMAR_POLL_S)
            return started
        return started + super().step()

    def poll_ms(self) -> int:
        """Requests whose token 1 is here wait only for their KV: look again soon (1 ms)."""
        if self.has_work():
            return self.work_poll_ms()
        return 1 if any(p.first_token is not None for p in self.pending.values()) else 10

    def held_request_ids(self) -> set[str]:
        return super().held_request_ids() | set(self.pending)
