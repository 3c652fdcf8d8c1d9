"""A worker role's logic without its process: gateway messages in, messages out.

Each role (colocated here, prefill/scheduler.py, decode/scheduler.py) is a RoleScheduler over
an EngineCore. It owns admission and its tables (which requests it holds and in what phase):

    handle(msg) -> messages          a gateway message (Generate, Prefill, Admit, StartDecode, abort)
    on_transfer(result) -> messages  a KV transfer's result, from the connector (prefill, decode)
    step() -> messages               one engine step: the core schedules, plans and runs it
                                     (engine/core.py); postprocess() turns its outcome into messages

The worker around it (worker.py) only moves messages between these methods and its sockets, so
every role is unit-tested without processes or sockets (tests/unit/test_role_schedulers.py).
Pages are taken and given back only through the engine's Scheduler.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pd_serve.engine.core import EngineCore
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.scheduler import SchedulerOutput
from pd_serve.protocol import AbortRequest, Generate, Logprob, TokenBatch, TokenDelta
from pd_serve.transfer.base import TransferResult


class WorkerMetrics:
    """The worker's own series; the gateway adds a `worker` label when it merges them."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.pages_used = Gauge("pd_serve:kv_pages_used", "KV pages requests hold (the prefix "
                                "cache's own: prefix_cache_pages)", registry=r)
        self.pages_total = Gauge("pd_serve:kv_pages_total", "KV pages in the pool", registry=r)
        self.running = Gauge("pd_serve:num_requests_running", "requests in the batch", registry=r)
        self.waiting = Gauge("pd_serve:num_requests_waiting", "requests queued", registry=r)
        self.prompt_tokens = Counter("pd_serve:prompt_tokens", "prompt tokens computed", registry=r)
        self.generation_tokens = Counter("pd_serve:generation_tokens", "tokens generated", registry=r)
        self.cache_hit_tokens = Counter("pd_serve:prefix_cache_hit_tokens",
                                        "prompt tokens whose KV the prefix cache held", registry=r)
        self.cache_query_tokens = Counter("pd_serve:prefix_cache_query_tokens",
                                          "prompt tokens looked up in the prefix cache", registry=r)
        self.cache_evicted_pages = Counter("pd_serve:prefix_cache_evicted_pages",
                                           "pages the prefix cache gave back", registry=r)
        self.cache_pages = Gauge("pd_serve:prefix_cache_pages", "pages the prefix cache holds", registry=r)
        self._cache_totals = (0, 0, 0)

    def record_cache(self, cache) -> None:
        """Bring the prefix cache's series up to its totals (cache/radix.py keeps them)."""
        totals = (cache.hit_tokens, cache.query_tokens, cache.evicted_pages)
        for counter, now, before in zip((self.cache_hit_tokens, self.cache_query_tokens,
                                         self.cache_evicted_pages), totals, self._cache_totals):
            counter.inc(now - before)
        self._cache_totals = totals
        self.cache_pages.set(cache.num_pages)


def new_token_row(request: Request, reason: FinishReason | None) -> TokenDelta:
    """The gateway's row for a request's newest token, with its logprob when the request asked
    for them (and with token 1 the prompt's); `reason`: the token ended the request."""
    logprobs = None
    if request.sampling_params.logprobs is not None:
        logprobs = [Logprob.of(request.output_logprobs[-1])]
    first = len(request.output_token_ids) == 1
    return TokenDelta(request.request_id, request.output_token_ids[-1:], logprobs, request.finished,
                      None if reason is None else reason.value,
                      cached_tokens=request.num_cached_tokens if first else 0,
                      prompt_logprobs=prompt_logprob_rows(request) if first else None)


def prompt_logprob_rows(request: Request) -> list[Logprob] | None:
    """The request's prompt logprobs on the wire, if it asked for them."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    return [Logprob.of(lp) for lp in request.prompt_logprobs]


def end_row(request_id: str, reason: FinishReason | None, error: str = "") -> TokenDelta:
    """The gateway's row for a request that ended without a new token: finished for `reason`,
    or failed with `error`."""
    return TokenDelta(request_id, [], None, True, None if reason is None else reason.value, error)


class RoleScheduler:
    """What every role shares: request checks, the step and its postprocessing, aborts."""

    role = ""

    def __init__(self, core: EngineCore, worker_id: str, connector=None,
                 metrics: WorkerMetrics | None = None):
        """connector: the KV hand-off (transfer/connector.py), prefill and decode only."""
        self.core = core
        self.scheduler = core.scheduler
        self.worker_id = worker_id
        self.connector = connector
        self.metrics = metrics or WorkerMetrics()
        # The last step ran nothing though requests wait (for pages held outside the batch,
        # a grammar's compile): the worker then looks again after 1 ms, not in a busy loop.
        self.stalled = False

    # ---- messages in ----------------------------------------------------------------------
    def handle(self, msg) -> list:
        raise NotImplementedError

    def on_transfer(self, result: TransferResult) -> list:
        return []

    def new_request(self, msg) -> Request:
        """A Request from a message's fields; ValueError (one line) if this worker cannot take it."""
        request = Request(list(msg.prompt_token_ids), msg.sampling, request_id=msg.request_id,
                          priority=msg.priority)
        self.core.check_request(request.prompt_token_ids, request.sampling_params)
        return request

    # ---- the step -------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Something to step: requests to run, or a step in flight to settle."""
        return self.scheduler.has_unfinished()

    def poll_ms(self) -> int:
        """How long the worker may wait for a message before its next tick."""
        return self.work_poll_ms() if self.has_work() else 10

    def work_poll_ms(self) -> int:
        return 1 if self.stalled else 0

    def step(self) -> list:
        out, sampled = self.core.step()
        self.note_step(out, sampled)
        return self.postprocess(out, sampled)

    def note_step(self, out: SchedulerOutput, sampled: list[Request]) -> None:
        """Whether that step stalled: it ran nothing, gave nothing, and none is in flight."""
        self.stalled = not out.chunks and not sampled and not self.core.step_in_flight

    def postprocess(self, out: SchedulerOutput, sampled: list[Request]) -> list:
        """A step's outcome as messages: each sampled request's new token (the stop rules ended
        it, or not), and the requests the scheduler ended (more KV than the pool holds)."""
        self.metrics.prompt_tokens.inc(sum(c.num_tokens for c in out.chunks if c.num_tokens > 1))
        self.metrics.generation_tokens.inc(len(sampled))
        rows = [new_token_row(r, reason) for r, reason in self.core.apply_stops(sampled)]
        rows += [end_row(r.request_id, r.finish_reason) for r in out.finished]
        return self.token_batch(rows)

    # ---- tables ---------------------------------------------------------------------------
    def held_request_ids(self) -> set[str]:
        """Every request this worker holds state for (handle(AbortRequest) frees it)."""
        return self.scheduler.request_ids()

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests, for the worker's status."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def token_batch(self, rows: list[TokenDelta]) -> list:
        return [TokenBatch(self.worker_id, rows)] if rows else []

    def fail(self, request_id: str, error: str) -> list:
        return self.token_batch([end_row(request_id, None, error)])


class ColocatedScheduler(RoleScheduler):
    """Both phases in one worker: the baseline the disaggregated path is compared against."""

    role = "colocated"

    def handle(self, msg) -> list:
        if isinstance(msg, Generate):
            try:
                request = self.new_request(msg)
            except (ValueError, TypeError) as e:
                return self.fail(msg.request_id, str(e))
            self.scheduler.add(request)
        elif isinstance(msg, AbortRequest):
            self.scheduler.abort(msg.request_id)
        return []
