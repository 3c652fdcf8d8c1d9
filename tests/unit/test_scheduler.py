"""Scheduler plans built from fake requests: budgets, chunking, admission, preemption, priority."""

from pd_serve.cache.allocator import PageAllocator
from pd_serve.config import SchedulerConfig
from pd_serve.engine.request import FinishReason, Request, RequestStatus
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.engine.scheduler import Scheduler


def make_scheduler(num_pages=64, page_size=4, **kwargs) -> Scheduler:
    return Scheduler(SchedulerConfig(**kwargs), PageAllocator(num_pages), page_size)


def make_request(num_prompt: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(list(range(1, num_prompt + 1)), SamplingParams(temperature=0),
                   priority=priority, arrival_time=arrival)


def run_step(sched: Scheduler, token: int = 7):
    plan = sched.schedule()
    sched.update(plan, [token] * sum(c.sample for c in plan.chunks))
    return plan


def test_chunked_prefill_splits_prompt_under_budget():
    sched = make_scheduler(chunked_prefill_size=8)
    req = make_request(20)
    sched.add(req)
    sizes = []
    while not req.output_token_ids:
        plan = run_step(sched)
        sizes.append([(c.start, c.num_tokens, c.sample) for c in plan.chunks])
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert len(req.page_ids) == 5  # 20 tokens / page size 4


def test_decodes_run_before_new_prefills_and_share_budget():
    sched = make_scheduler(chunked_prefill_size=6)
    a, b = make_request(4, arrival=0), make_request(10, arrival=1)
    sched.add(a)
    run_step(sched)  # a prefilled, sampled its first token
    sched.add(b)
    plan = run_step(sched)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(a, 1), (b, 5)]
    assert plan.num_tokens == 6


def _long_then_short(threshold: int, num_pages: int = 64):
    """A 40-token prompt alone for a step under a 16-token budget, then a 4-token one arrives:
    each step's chunks as (request, start, tokens, sample) until the short one has its token."""
    sched = make_scheduler(num_pages=num_pages, chunked_prefill_size=16,
                           long_prefill_token_threshold=threshold)
    long, short = make_request(40, arrival=0), make_request(4, arrival=1)
    sched.add(long)
    steps = [run_step(sched)]
    sched.add(short)
    while not short.output_token_ids:
        steps.append(run_step(sched))
    names = {id(long): "long", id(short): "short"}
    return [[(names[id(c.request)], c.start, c.num_tokens, c.sample) for c in p.chunks] for p in steps]


def test_without_long_prefill_threshold_a_short_prompt_waits_out_a_long_one():
    assert _long_then_short(0) == [[("long", 0, 16, False)], [("long", 16, 16, False)],
                                   [("long", 32, 8, True), ("short", 0, 4, True)]]


def test_long_prefill_threshold_admits_a_waiting_prompt_and_gives_the_rest_back():
    # The long prompt alone takes the whole budget; with the short one waiting it is cut to 6,
    # the short one takes 4, and the 6 left over go back to the long one's chunk.
    assert _long_then_short(6) == [[("long", 0, 16, False)],
                                   [("long", 16, 12, False), ("short", 0, 4, True)]]


def test_long_prefill_threshold_gives_back_only_what_pages_allow():
    # 7 pages of 4 tokens: the long prompt holds 4 after step 1, its cut chunk (to 22 tokens)
    # 2 more, the short one the last: the 6 tokens left over would need an 8th page, so the
    # chunk stays at 6 and nothing is preempted.
    steps = _long_then_short(6, num_pages=7)
    assert steps[1] == [("long", 16, 6, False), ("short", 0, 4, True)]


def test_long_prefill_threshold_shares_a_step_between_long_prompts():
    sched = make_scheduler(chunked_prefill_size=16, long_prefill_token_threshold=6)
    a, b = make_request(40, arrival=0), make_request(40, arrival=1)
    sched.add(a)
    sched.add(b)
    plan = run_step(sched)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(a, 10), (b, 6)]


def test_max_running_requests_caps_admission():
    sched = make_scheduler(max_running_requests=2)
    reqs = [make_request(3, arrival=i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    plan = run_step(sched)
    assert [c.request for c in plan.chunks] == reqs[:2]
    assert reqs[2].status is RequestStatus.WAITING


def test_priority_policy_orders_admission():
    sched = make_scheduler(max_running_requests=1, schedule_policy="priority")
    low, high = make_request(3, priority=5, arrival=0), make_request(3, priority=1, arrival=1)
    sched.add(low)
    sched.add(high)
    plan = run_step(sched)
    assert [c.request for c in plan.chunks] == [high]


def test_out_of_pages_preempts_latest_and_frees_its_pages():
    # 4 pages of 4 tokens; two requests of 8 tokens fill them; the next decode needs a 5th.
    sched = make_scheduler(num_pages=4, page_size=4)
    a, b = make_request(8, arrival=0), make_request(8, arrival=1)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 pages each, 9 tokens now (8 prompt + 1 sampled)
    assert sched.allocator.num_free_pages == 0
    plan = run_step(sched)  # a needs a 3rd page -> b is preempted
    assert plan.preempted == [b] and b.status is RequestStatus.WAITING
    assert b.page_ids == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [c.request for c in plan.chunks] == [a]
    assert sched.allocator.num_free_pages == 1


def test_request_larger_than_pool_finishes_instead_of_hanging():
    sched = make_scheduler(num_pages=2, page_size=4)
    big = make_request(12)
    sched.add(big)
    plan = sched.schedule()
    assert plan.finished == [big] and big.finish_reason is FinishReason.LENGTH
    assert sched.allocator.num_free_pages == 2 and not sched.has_unfinished()


def test_finish_frees_pages_once_from_any_state():
    sched = make_scheduler()
    a, b = make_request(5), make_request(5)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(a, FinishReason.ABORT)
    sched.finish(a, FinishReason.ABORT)  # second finish is a no-op, not a double free
    sched.finish(b, FinishReason.ABORT)  # still waiting: holds no pages
    assert sched.allocator.num_free_pages == 64 and not sched.has_unfinished()


def test_a_request_waits_for_pages_held_outside_the_batch():
    """Decode's pool full of reserved prompts (KV on its way) and one running request that
    needs another page: it waits for room (in place, keeping its pages), not ends as too
    large; a waiting request with nothing running waits too. Once the reservations go, both
    run to their max_tokens."""
    sched = make_scheduler(num_pages=6, page_size=4)
    a = Request(list(range(1, 5)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    sched.add(a)
    run_step(sched)  # 4 prompt tokens + 1: one page, full
    held = make_request(16)
    assert sched.reserve_prompt(held)  # the other 4 pages... and the last one below
    also_held = make_request(4)
    assert sched.reserve_prompt(also_held) and sched.allocator.num_free_pages == 0
    late = make_request(2)
    sched.add(late)
    for _ in range(3):
        plan = run_step(sched)
        assert not plan.chunks and not plan.finished and not plan.preempted
        assert a.status is RequestStatus.RUNNING and len(a.page_ids) == 1
        assert late.status is RequestStatus.WAITING and not late.finished
    sched.release(held)
    sched.release(also_held)
    while sched.has_unfinished():
        plan = run_step(sched)
        for request in (a, late):
            if request in [c.request for c in plan.chunks] and len(request.output_token_ids) >= 3:
                sched.finish(request, FinishReason.LENGTH)
    assert len(a.output_token_ids) == 3 and len(late.output_token_ids) == 3
    assert sched.allocator.num_free_pages == 6


def test_a_running_request_past_the_whole_pool_ends():
    """Alone and needing more pages than the pool has: finished (length), not left waiting."""
    sched = make_scheduler(num_pages=2, page_size=4)
    a = make_request(8)
    sched.add(a)
    run_step(sched)  # 8 prompt tokens in both pages, 1 sampled
    plan = sched.schedule()
    assert plan.finished == [a] and a.finish_reason is FinishReason.LENGTH
    assert sched.allocator.num_free_pages == 2
