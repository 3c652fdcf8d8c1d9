"""The overlap schedule (step N+1 planned while step N runs; engine/core.py) gives the same
tokens, logprobs and finish reasons as waiting for every step, and frees every page.

It is on by default on GPU only; here it is switched on by hand so its bookkeeping (pending
tokens read on the device, one wasted row after a stop, deferred page frees) runs on CPU.
tests/model/test_engine.py runs its 200 random requests with aborts under it too."""

from __future__ import annotations

import pytest

from helpers import assert_pages_settled
from pd_serve import Engine, SamplingParams
from pd_serve.cache.allocator import PageAllocator
from pd_serve.config import SchedulerConfig
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.scheduler import Scheduler


def overlapped(engine: Engine) -> Engine:
    engine.overlap = True
    return engine


def assert_settled(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert_pages_settled(engine)


@pytest.fixture(scope="module")
def engines(default_model_dir) -> tuple[Engine, Engine]:
    sync = Engine(default_model_dir, device="cpu", max_total_tokens=4096)
    return sync, overlapped(Engine(default_model_dir, device="cpu", max_total_tokens=4096))


@pytest.fixture(scope="module")
def prompts(engines) -> list[list[int]]:
    texts = ["Once upon a time", "The three primary colours are", "Water boils at",
             "def add(a, b):", "In 1492,", "The capital of France is"]
    return [engines[0].tokenizer.encode(t) for t in texts]


def test_mixed_sampling_equals_the_synchronous_schedule(engines, prompts):
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),  # may stop at EOS
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),  # ends early: wasted row
        SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, stop=[" is", "."]),
    ]
    sync, overlap = engines
    want = sync.generate(prompts, params)
    got = overlap.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.text == w.text
        assert g.finish_reason == w.finish_reason
    # Batches differ (a row that ends skips its last step), so logprobs agree to rounding.
    for g, w in zip(got[3].logprobs, want[3].logprobs):
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-4)
    assert_settled(overlap)


def test_context_length_and_preemption_with_chunked_prefill(default_model_dir, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    options = dict(device="cpu", max_total_tokens=160, page_size=16, chunked_prefill_size=12,
                   context_length=40)
    want = Engine(default_model_dir, **options).generate(prompts, params)
    engine = overlapped(Engine(default_model_dir, **options))
    got = engine.generate(prompts, params)
    assert sum(o.num_preemptions for o in got) > 0, "the budget should force preemption"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["length"] * len(prompts)
    assert all(len(p) + len(o.token_ids) == 40 for p, o in zip(prompts, got))
    assert_settled(engine)


def test_pages_freed_while_a_step_is_in_flight_wait_for_it():
    allocator = PageAllocator(8)
    scheduler = Scheduler(SchedulerConfig(), allocator, page_size=4)
    request = Request(list(range(6)), SamplingParams(max_tokens=4))
    scheduler.add(request)
    plan = scheduler.schedule()
    scheduler.update(plan, None)  # launched, its token pending
    step = scheduler.launched()
    assert request.num_tokens == 7 and request.num_pending == 1
    scheduler.finish(request, FinishReason.ABORT)
    assert allocator.num_free_pages == 6 and scheduler.has_unfinished()
    scheduler.completed(step)
    assert allocator.num_free_pages == 8 and not scheduler.has_unfinished()
