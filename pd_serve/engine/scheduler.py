"""Continuous batching with chunked prefill: decides which tokens of which requests run each step.

The scheduler returns what runs (SchedulerOutput), which PlanBuilder turns into the executor's
StepPlan; the executor runs it without touching scheduler state; update() takes the sampled
tokens back.

Under the overlap schedule (engine/core.py) a step can still be running on the device when
requests end or are preempted: their pages are given back only once the device is done with
every step launched so far (launched() / completed()), so no other writer (a KV transfer into a
reserved page) can meet a write of that step.

With a prefix cache (cache/radix.py) a request admitted from the queue starts on the cached
pages of its longest cached prefix (num_computed_tokens past them), its prompt's full pages are
cached (shared) once the prompt is computed, an ended request's full computed pages go into
the cache instead of back to the pool, and a reservation the pool cannot meet evicts cached
pages first.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from pd_serve.cache.allocator import PageAllocator
from pd_serve.cache.pool import pages_for
from pd_serve.cache.radix import PrefixCache
from pd_serve.config import SchedulerConfig
from pd_serve.engine.plan import NewRequest, RequestDiff, StepChunk, StepPlan, sampling_to_wire
from pd_serve.engine.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of a request; sample after them if `sample`."""

    request: Request
    start: int
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (KV too small)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int,
                 max_model_len: int = 1 << 62, cache: PrefixCache | None = None):
        """max_model_len: the context length (a request at it gets no more steps); cache: the
        prefix cache over allocator's pages (None: none)."""
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.cache = cache
        self._random = random.Random(0)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._num_launched = 0  # steps handed to the device
        self._num_completed = 0  # of those, the ones known to be done
        self._deferred: list[tuple[int, list[int]]] = []  # (steps launched then, pages)
        # ready(request): whether a waiting request may start now (EngineCore: its grammar is
        # compiled); the ones that may not keep their place and the rest go ahead of them
        self.ready = None

    # ---- queue management -------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def get(self, request_id: str) -> Request | None:
        """The running or waiting request of that id."""
        return next((r for r in self.running + self.waiting if r.request_id == request_id), None)

    def request_ids(self) -> set[str]:
        return {r.request_id for r in self.running + self.waiting}

    def abort(self, request_id: str) -> bool:
        """End a running or waiting request (its pages are freed); False if there is none."""
        request = self.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request is not None

    def num_available_pages(self) -> int:
        """Pages a reservation can get now: free ones and those only the prefix cache holds."""
        cached = 0 if self.cache is None else self.cache.num_evictable_pages()
        return self.allocator.num_free_pages + cached

    def has_unfinished(self) -> bool:
        """Requests to run, or pages still waiting for a step in flight (step again to settle)."""
        return bool(self.waiting or self.running or self._num_launched > self._num_completed)

    def launched(self) -> int:
        """Count a step handed to the device; returns its number."""
        self._num_launched += 1
        return self._num_launched

    def completed(self, step: int) -> None:
        """Steps up to number `step` are done on the device: free the pages held back for them."""
        self._num_completed = max(self._num_completed, step)
        for _, token_ids, pages in [d for d in self._deferred if d[0] <= step]:
            self._give_back(token_ids, pages)
        self._deferred = [d for d in self._deferred if d[0] > step]

    def reserve_prompt(self, request: Request) -> bool:
        """Give a request that is in no table pages for its whole prompt, whose KV will come
        from elsewhere (decode); False when the pool has no room. With a prefix cache the
        leading pages are the cached ones of its longest cached prefix, at least one page
        short of the prompt (request.num_cached_tokens: their tokens), so only the rest has
        to arrive. The caller owns the pages until add_running() or release()."""
        cached = []
        if self.cache is not None:
            cached = self.cache.match(request.prompt_token_ids,
                                      (request.num_prompt_tokens - 1) // self.page_size)
        page_ids = self._allocate(pages_for(request.num_prompt_tokens, self.page_size) - len(cached))
        if page_ids is None:
            self.allocator.free(cached)
            return False
        request.page_ids = cached + page_ids
        request.num_cached_tokens = len(cached) * self.page_size
        return True

    def add_running(self, request: Request) -> None:
        """Admit a request whose prompt's KV is already in its pages (decode after a transfer)."""
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def detach(self, request: Request) -> None:
        """Take a running request out but keep its pages: the caller now owns them and hands
        them back with release() (prefill, while the pages are being sent)."""
        self.running.remove(request)
        request.status = RequestStatus.FINISHED

    def release(self, request: Request) -> None:
        """Free the pages of a request in no table (detached, or reserved and never started)."""
        self._release(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request from any state; its pages are freed exactly once."""
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._token_budget()
        cap = self.config.long_prefill_token_threshold or budget
        self.running.sort(key=self._priority_key)
        # Running requests first: decodes (1 token) and prefills already under way.
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budget == 0 or self._at_limit(request):
                continue
            num = min(request.num_uncomputed_tokens, budget, cap)
            if not self._reserve_or_preempt(request, num, out):
                continue  # preempted, finished, or waiting in place for pages held elsewhere
            out.chunks.append(self._chunk(request, num))
            budget -= num
        # Then admit waiting requests while there is budget, room and no preemption this step.
        self._order_waiting()
        not_ready = []
        while self.waiting and not out.preempted and budget > 0 \
                and len(self.running) < self.config.max_running_requests:
            request = self.waiting[0]
            if self.ready is not None and not self.ready(request):
                not_ready.append(self.waiting.pop(0))
                continue
            self._match_prefix(request)
            num = min(request.num_uncomputed_tokens, budget, cap)
            if not self._reserve(request, num):
                fits = self._fits_pool(request, num)
                self._unmatch_prefix(request)
                if not self.running and not out.chunks and not fits:
                    self._finish_too_large(request, out)
                    continue
                break  # room comes back as requests end (or reservations and deferrals go)
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num))
            budget -= num
        self.waiting[:0] = not_ready
        if budget > 0 and cap < self._token_budget():
            self._extend_capped(out, budget)
        return out

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int] | None) -> None:
        """Advance the requests of a step; sampled ids come in order of sampling chunks. None:
        the step is in flight, its tokens become pending."""
        tokens = iter(sampled_token_ids or ())
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            if self.cache is not None and chunk.start < request.num_prompt_tokens <= request.num_computed_tokens:
                # the prompt is computed (or will be, by a step queued before any that could read
                # it): its full pages are cached now, shared with the request, not at its end
                num_full = request.num_prompt_tokens // self.page_size
                self.cache.insert(request.prompt_token_ids[:num_full * self.page_size],
                                  request.page_ids[:num_full], share=True)
            if not chunk.sample:
                continue
            if sampled_token_ids is None:
                request.num_pending += 1  # the step before's may still be pending too, briefly
            else:
                request.output_token_ids.append(next(tokens))

    # ---- internals --------------------------------------------------------------------
    def _extend_capped(self, out: SchedulerOutput, budget: int) -> None:
        """--long-prefill-token-threshold: the step's budget the waiting prompts left goes to the
        chunks the threshold cut short, in order, as far as their pages can be reserved (never
        by preempting), so a long prompt alone runs as fast as without the threshold."""
        for chunk in out.chunks:
            request = chunk.request
            extra = min(request.num_uncomputed_tokens - chunk.num_tokens, budget)
            if extra <= 0 or not self._reserve(request, chunk.num_tokens + extra):
                continue
            chunk.num_tokens += extra
            chunk.sample = chunk.start + chunk.num_tokens == request.num_tokens
            budget -= extra
            if budget == 0:
                return

    def _at_limit(self, request: Request) -> bool:
        """A request whose pending token is its last (max_tokens, context): its caller ends it
        once the token is known, so it gets no step meanwhile."""
        return request.num_pending > 0 and (
            len(request.output_token_ids) + request.num_pending >= request.sampling_params.max_tokens
            or request.num_tokens >= self.max_model_len)

    def _token_budget(self) -> int:
        size = self.config.chunked_prefill_size
        return size if size > 0 else 1 << 62

    def _priority_key(self, request: Request):
        if self.config.schedule_policy == "priority":
            return (request.priority, request.arrival_time)
        return (request.arrival_time,)

    def _chunk(self, request: Request, num: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, num, sample=start + num == request.num_tokens)

    def _pages_needed(self, request: Request, num: int) -> int:
        total = pages_for(request.num_computed_tokens + num, self.page_size)
        return max(0, total - len(request.page_ids))

    def _reserve(self, request: Request, num: int) -> bool:
        page_ids = self._allocate(self._pages_needed(request, num))
        if page_ids is None:
            return False
        request.page_ids.extend(page_ids)
        return True

    def _allocate(self, num_pages: int) -> list[int] | None:
        """num_pages from the pool, evicting cached pages if it is short; None: no room."""
        short = num_pages - self.allocator.num_free_pages
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.allocator.allocate(num_pages)

    def _match_prefix(self, request: Request) -> None:
        """A request about to be admitted with nothing computed starts on the cached pages of
        its prompt's (and outputs', after a preemption) longest cached prefix, leaving at least
        one token to compute (its logits give the next token). One that scores its prompt
        (prompt logprobs) computes it all."""
        if self.cache is None or request.page_ids or request.num_computed_tokens or request.scores_prompt:
            return
        max_pages = (request.num_known_tokens - 1) // self.page_size
        request.page_ids = self.cache.match(request.all_token_ids, max_pages)
        request.num_computed_tokens = len(request.page_ids) * self.page_size
        if not request.num_preemptions:
            request.num_cached_tokens = request.num_computed_tokens

    def _unmatch_prefix(self, request: Request) -> None:
        """Undo _match_prefix for a request that stays in the queue: it holds no pages there."""
        if request.page_ids and request.status is RequestStatus.WAITING:
            self._give_back(request.all_token_ids[:request.num_computed_tokens], request.page_ids)
            request.page_ids = []
            request.num_computed_tokens = 0

    def _order_waiting(self) -> None:
        """The queue in admission order under --schedule-policy."""
        policy = self.config.schedule_policy
        if policy == "random":
            self._random.shuffle(self.waiting)
        elif policy in ("lpm", "dfs-weight") and self.cache is not None:
            self.waiting.sort(key=self._priority_key)
            if policy == "lpm":
                lengths = {id(r): self.cache.match_length(r.all_token_ids) for r in self.waiting}
                self.waiting.sort(key=lambda r: -lengths[id(r)])  # stable: fcfs among equals
            else:
                self.waiting = self.cache.dfs_order(self.waiting, lambda r: r.all_token_ids)
        else:
            self.waiting.sort(key=self._priority_key)

    def _reserve_or_preempt(self, request: Request, num: int, out: SchedulerOutput) -> bool:
        """Reserve pages for `num` more tokens, preempting the lowest-priority requests if needed.

        Returns False when `request` itself was preempted, finished (it needs more than the
        whole pool), or must wait: alone in the batch, it keeps its pages and waits in place
        for the ones held outside it (prompts reserved for KV on its way, pages of an ended
        request that a step in flight may still read, a prefill's KV being sent).
        """
        while not self._reserve(request, num):
            # Running is sorted by priority and served in order, so the victim (the lowest
            # priority) is `request` itself or one not yet scheduled this step.
            victim = max(self.running, key=self._priority_key)
            if victim is request and len(self.running) == 1:
                if not self._fits_pool(request, num):
                    self._finish_too_large(request, out)
                return False
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free the request's pages; it is recomputed from its prompt and outputs later."""
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.insert(0, request)
        out.preempted.append(request)

    def _fits_pool(self, request: Request, num: int) -> bool:
        """Whether the pool could hold the request's pages after `num` more tokens if nothing
        else held any."""
        return pages_for(request.num_computed_tokens + num, self.page_size) <= self.allocator.num_pages

    def _finish_too_large(self, request: Request, out: SchedulerOutput) -> None:
        logger.warning("request %s needs more KV pages than the pool holds (%d); ending it",
                       request.request_id, self.allocator.num_pages)
        self.finish(request, FinishReason.LENGTH)
        out.finished.append(request)

    def _release(self, request: Request) -> None:
        if request.page_ids:
            # the full pages whose tokens are known and whose KV is computed (or being computed
            # by a step in flight, which the deferral waits for) can serve later prompts
            num_cached = 0
            if self.cache is not None:
                computed = min(request.num_computed_tokens, request.num_known_tokens)
                num_cached = min(computed // self.page_size, len(request.page_ids))
            token_ids = request.all_token_ids[:num_cached * self.page_size]
            if self._num_launched > self._num_completed:
                self._deferred.append((self._num_launched, token_ids, request.page_ids))
            else:
                self._give_back(token_ids, request.page_ids)
        request.page_ids = []
        request.num_computed_tokens = 0

    def _give_back(self, token_ids: list[int], page_ids: list[int]) -> None:
        """Pages of an ended request: the ones holding token_ids to the cache, the rest (and
        the cache's duplicates) to the pool."""
        num_cached = len(token_ids) // self.page_size
        rest = page_ids[num_cached:]
        if num_cached:
            rest = self.cache.insert(token_ids, page_ids[:num_cached]) + rest
        self.allocator.free(rest)


class PlanBuilder:
    """Turns SchedulerOutputs into StepPlans (engine/plan.py): remembers what the executor has
    been sent of each request, so a request goes out in full once and then as diffs.

    Every SchedulerOutput goes through build(); one with no chunks launches nothing and gives
    None, and what it preempted goes out with the next plan. A request that has finished (or
    been detached) is named in the next plan's finished_ids and forgotten."""

    def __init__(self):
        self._sent: dict[str, tuple[Request, int, int]] = {}  # id -> (request, tokens, pages) sent
        self._preempted: list[str] = []

    def build(self, out: SchedulerOutput, kv_sends: list | None = None) -> StepPlan | None:
        """The plan of a step that runs out.chunks and sends kv_sends; None without chunks."""
        for request in out.preempted:
            if request.request_id in self._sent:
                self._preempted.append(request.request_id)
                self._sent[request.request_id] = (request, self._sent[request.request_id][1], 0)
        if not out.chunks:
            return None
        plan = StepPlan(kv_sends=list(kv_sends or ()))
        plan.finished_ids = [i for i, (r, _, _) in self._sent.items() if r.finished]
        for request_id in plan.finished_ids:
            del self._sent[request_id]
        plan.preempted_ids, self._preempted = [i for i in self._preempted if i in self._sent], []
        for chunk in out.chunks:
            request = chunk.request
            request_id = request.request_id
            num_known = request.num_known_tokens
            if request_id not in self._sent:
                plan.new_requests.append(NewRequest(
                    request_id, request.all_token_ids, request.num_prompt_tokens,
                    list(request.page_ids), sampling_to_wire(request.sampling_params)))
            else:
                _, num_tokens, num_pages = self._sent[request_id]
                new_pages = request.page_ids[num_pages:]
                if num_tokens < num_known or new_pages:
                    plan.request_diffs.append(RequestDiff(
                        request_id, _known_tokens(request, num_tokens), list(new_pages)))
            self._sent[request_id] = (request, num_known, len(request.page_ids))
            plan.chunks.append(StepChunk(request_id, chunk.start, chunk.num_tokens, chunk.sample))
        return plan


def _known_tokens(request: Request, start: int) -> list[int]:
    """The request's known token ids from position start on."""
    n = request.num_prompt_tokens
    if start >= n:
        return request.output_token_ids[start - n:]
    return request.prompt_token_ids[start:] + request.output_token_ids
