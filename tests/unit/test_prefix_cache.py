"""The prefix cache (cache/radix.py) alone, under the scheduler, and through the engine: the
same tokens with it on and off, and no page lost or shared wrongly."""

from __future__ import annotations

import random

import pytest

from helpers import assert_pages_settled
from pd_serve import Engine, SamplingParams
from pd_serve.cache.allocator import PageAllocator
from pd_serve.cache.radix import PrefixCache
from pd_serve.config import SchedulerConfig
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.scheduler import Scheduler

PS = 4  # page size


def cached(alloc: PageAllocator, cache: PrefixCache, tokens: list[int]) -> list[int]:
    """Pages for tokens, allocated and handed to the cache as an ended request would."""
    pages = alloc.allocate(len(tokens) // PS)
    assert cache.insert(tokens, pages) == []
    return pages


def test_match_is_page_granular_and_shares_by_refcount():
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, PS)
    pages = cached(alloc, cache, list(range(12)))
    assert cache.match(list(range(11))) == pages[:2]  # the third page is not full
    assert [alloc.refcount(p) for p in pages] == [2, 2, 1]
    assert cache.match(list(range(12)) + [99], max_pages=1) == pages[:1]
    assert cache.match([0, 1, 2, 9]) == [] and cache.match_length(list(range(8)) + [7] * 4) == 8
    # a request that computed the same prefix again: the cache keeps its own pages
    again = alloc.allocate(2)
    assert cache.insert(list(range(8)), again) == again
    alloc.free(again)
    assert cache.num_pages == 3 and cache.hit_tokens == 8 + 4


def test_eviction_takes_least_recently_used_leaves_that_only_the_cache_holds():
    alloc = PageAllocator(6)
    cache = PrefixCache(alloc, PS)
    a = cached(alloc, cache, [1] * 8)  # a chain of two pages
    b = cached(alloc, cache, [2] * 8)
    cache.match([1] * 8)  # a is in use
    assert alloc.num_free_pages == 2
    assert cache.evict(1) == 1 and alloc.refcount(b[1]) == 0  # b's leaf first
    assert cache.evict(5) == 1 and alloc.refcount(b[0]) == 0  # then its parent; a is held
    assert cache.num_evictable_pages() == 0 and cache.flush() == 0
    alloc.free(a)  # the request ends
    assert cache.num_evictable_pages() == 2 and cache.flush() == 2
    assert alloc.num_free_pages == 6 and cache.num_pages == 0


def test_pages_given_back_without_an_insert_can_still_be_evicted():
    """A holder may give cached pages back without inserting their path (decode's reservation
    that failed, or was aborted before its KV came). Eviction drops a leaf in use from its
    heap when it pops it; once only the cache holds the pages again, they are found."""
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, PS)
    cached(alloc, cache, list(range(12)))  # 3 pages
    held = cache.match(list(range(12)) + [99])
    assert cache.evict(3) == 0  # in use
    alloc.free(held)  # given back as they were, no insert
    assert cache.num_evictable_pages() == 3
    assert cache.evict(3) == 3 and alloc.num_free_pages == 8 and cache.num_pages == 0


def test_a_failed_reservation_leaves_its_cached_prefix_evictable():
    """Decode: a reservation matches a cached prefix, finds no room for the rest and gives the
    prefix back; a later reservation that needs the whole pool evicts it."""
    sched = scheduler_with_cache(8)
    cached(sched.allocator, sched.cache, list(range(12)))  # 3 pages, only the cache holds them
    elsewhere = sched.allocator.allocate(4)  # another request's: 1 page left free
    short = Request(list(range(12)) + [50] * 8, SamplingParams(temperature=0))  # 3 cached + 2
    assert not sched.reserve_prompt(short) and sched.cache.num_evictable_pages() == 3
    sched.allocator.free(elsewhere)
    whole = Request([60] * 32, SamplingParams(temperature=0))  # all 8 pages
    assert sched.reserve_prompt(whole) and len(whole.page_ids) == 8
    sched.release(whole)
    assert sched.allocator.num_free_pages == 8


def scheduler_with_cache(num_pages: int, **config) -> Scheduler:
    alloc = PageAllocator(num_pages)
    return Scheduler(SchedulerConfig(**config), alloc, PS, cache=PrefixCache(alloc, PS))


def finish_all(sched: Scheduler, token: int = 7) -> None:
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, [token] * sum(c.sample for c in out.chunks))
        for c in out.chunks:
            if c.sample:
                sched.finish(c.request, FinishReason.LENGTH)


def request(tokens: list[int], arrival: float = 0.0) -> Request:
    return Request(list(tokens), SamplingParams(temperature=0, max_tokens=1), arrival_time=arrival)


def test_a_request_starts_after_its_cached_prefix_and_leaves_one_token_to_compute():
    sched = scheduler_with_cache(16)
    sched.add(request(range(10)))
    finish_all(sched)  # 10 prompt tokens + 1 output: two full pages cached
    assert sched.cache.num_pages == 2
    again = request(range(8))  # fully cached: the last page is computed again for the logits
    longer = request(list(range(10)) + [50, 51, 52])
    sched.add(again)
    sched.add(longer)
    out = sched.schedule()
    assert [(c.request, c.start, c.num_tokens) for c in out.chunks] == [(again, 4, 4), (longer, 8, 5)]
    assert (again.num_cached_tokens, longer.num_cached_tokens) == (4, 8)
    assert again.page_ids[0] == longer.page_ids[0]  # one page, shared
    sched.update(out, [1, 1])
    for r in (again, longer):
        sched.finish(r, FinishReason.LENGTH)
    assert sched.allocator.num_free_pages + sched.cache.num_evictable_pages() == 16
    assert sched.cache.flush() == 3 and sched.allocator.num_free_pages == 16


def test_a_computed_prompt_is_cached_while_its_request_still_runs():
    """A prompt's full pages enter the cache once it is computed (shared with the running
    request), so a request arriving meanwhile starts on them; nothing is freed twice."""
    sched = scheduler_with_cache(16)
    first = request(range(10))
    sched.add(first)
    out = sched.schedule()
    sched.update(out, [1])
    assert sched.cache.num_pages == 2 and not first.finished
    assert [sched.allocator.refcount(p) for p in first.page_ids[:2]] == [2, 2]
    assert sched.cache.num_evictable_pages() == 0  # in use
    second = request(list(range(8)) + [60, 61])
    sched.add(second)
    out = sched.schedule()
    assert [(c.request, c.start) for c in out.chunks if c.request is second] == [(second, 8)]
    assert second.page_ids[:2] == first.page_ids[:2]
    sched.update(out, [1, 1])
    for r in (first, second):
        sched.finish(r, FinishReason.LENGTH)
    alloc = sched.allocator
    assert alloc.num_free_pages + sched.cache.num_evictable_pages() == 16
    assert sched.cache.flush() == sched.cache.evicted_pages and alloc.num_free_pages == 16


def test_lpm_and_dfs_weight_order_a_queue_as_sglang_does():
    sched = scheduler_with_cache(64, schedule_policy="lpm", max_running_requests=1)
    for prefix in ([1] * 8, [2] * 4, [1] * 4 + [3] * 4):
        sched.add(request(prefix + [9]))
        finish_all(sched)
    # cached: 1111/1111, 1111/3333, 2222
    queue = {"none": request([5] * 9, 0), "one2": request([2] * 4 + [6] * 5, 1),
             "two1": request([1] * 8 + [6], 2), "one1": request([1] * 4 + [6] * 5, 3),
             "two13": request([1] * 4 + [3] * 4 + [6], 4), "one1b": request([1] * 4 + [7] * 5, 5)}
    names = {id(r): n for n, r in queue.items()}
    for r in queue.values():
        sched.add(r)
    sched._order_waiting()
    assert [names[id(r)] for r in sched.waiting] == ["two1", "two13", "one2", "one1", "one1b", "none"]
    sched.config = SchedulerConfig(schedule_policy="dfs-weight")
    sched._order_waiting()
    # under 1111 (weight 4): its children 1111 and 3333 (one each, in queue order), then its own
    # two; then 2222 (weight 1); then the root's own
    assert [names[id(r)] for r in sched.waiting] == ["two1", "two13", "one1", "one1b", "one2", "none"]


def test_1000_requests_with_shared_prefixes_and_aborts_lose_no_page():
    rng = random.Random(0)
    sched = scheduler_with_cache(48, chunked_prefill_size=32, max_running_requests=16)
    prefixes = [[rng.randrange(100) for _ in range(rng.choice([4, 8, 13]))] for _ in range(6)]
    live: list[Request] = []
    alloc = sched.allocator
    for i in range(1000):
        r = Request(rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 9))],
                    SamplingParams(temperature=0, max_tokens=rng.randrange(1, 6)), arrival_time=i)
        if rng.random() < 0.15:  # decode's admission: pages reserved on the cached prefix
            if sched.reserve_prompt(r):
                if rng.random() < 0.5:
                    sched.release(r)  # aborted before its KV arrived
                else:
                    r.output_token_ids.append(rng.randrange(100))  # token 1, from prefill
                    sched.add_running(r)  # its KV arrived: it decodes
                    live.append(r)
        else:
            sched.add(r)
            live.append(r)
        if i % 50 == 0:  # the allocator's count of evictable pages against a walk of the tree
            assert alloc.num_evictable_pages == sum(alloc.refcount(n.page_id) == 1
                                                    for n in sched.cache.nodes())
        for _ in range(rng.randrange(0, 3)):
            out = sched.schedule()
            sched.update(out, [rng.randrange(100) for c in out.chunks if c.sample])
            for c in out.chunks:
                if c.sample and len(c.request.output_token_ids) >= c.request.sampling_params.max_tokens:
                    sched.finish(c.request, FinishReason.LENGTH)
        if live and rng.random() < 0.2:
            sched.finish(rng.choice(live), FinishReason.ABORT)
        live = [r for r in live if not r.finished]
    for r in live:
        sched.finish(r, FinishReason.ABORT)
    assert not sched.has_unfinished()
    assert sched.cache.hit_tokens > 0
    assert alloc.num_free_pages + sched.cache.num_evictable_pages() == alloc.num_pages
    sched.cache.flush()
    assert alloc.num_free_pages == alloc.num_pages
    assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))


ARCHITECTURES = [("llama3", False), ("qwen2", False), ("qwen2", True), ("qwen3", False),
                 ("mistral", False), ("mixtral", False), ("qwen2_moe", False), ("qwen3_moe", False)]


@pytest.mark.parametrize("arch,overlap", ARCHITECTURES)
def test_engine_tokens_equal_with_the_cache_on_and_off(tiny_checkpoints, tiny_moe_checkpoints, arch,
                                                       overlap):
    """Every supported architecture: shared system prompts, turns that extend earlier ones, a
    pool small enough to evict."""
    model = {**tiny_checkpoints, **tiny_moe_checkpoints}[arch]
    rng = random.Random(1)
    system = [[rng.randrange(3, 400) for _ in range(n)] for n in (37, 21)]
    waves = []
    for turn in range(3):
        waves.append([s + [rng.randrange(3, 400) for _ in range(5 + 7 * turn + i)]
                      for i, s in enumerate(system * 3)])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(device="cpu", page_size=8, max_total_tokens=8 * 40, chunked_prefill_size=48)
    on = Engine(model, **options)
    off = Engine(model, disable_radix_cache=True, **options)
    on.overlap = off.overlap = overlap
    assert off.prefix_cache is None
    for wave in waves:
        want = [o.token_ids for o in off.generate(wave, params)]
        assert [o.token_ids for o in on.generate(wave, params)] == want
    assert on.prefix_cache.hit_tokens > 0 and on.prefix_cache.evicted_pages > 0
    assert_pages_settled(on)


def test_worker_metrics_follow_the_cache_totals():
    from prometheus_client import generate_latest

    from pd_serve.role import WorkerMetrics

    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, PS)
    cached(alloc, cache, list(range(8)))
    alloc.free(cache.match(list(range(9))))  # 8 of 9 tokens found
    metrics = WorkerMetrics()
    metrics.record_cache(cache)
    cache.flush()
    metrics.record_cache(cache)  # totals, not increments: nothing counted twice
    text = generate_latest(metrics.registry).decode()
    for line in ("pd_serve:prefix_cache_hit_tokens_total 8.0", "pd_serve:prefix_cache_query_tokens_total 9.0",
                 "pd_serve:prefix_cache_evicted_pages_total 2.0", "pd_serve:prefix_cache_pages 0.0"):
        assert line in text
