"""StepPlan / StepResult on the wire, the PlanBuilder's diffs (a request in full once, then only
what changed), and an Executor fed hand-written plans (no scheduler, no processes) giving the
tokens EngineCore gives."""

from __future__ import annotations

import msgpack
import torch

from pd_serve.cache.allocator import PageAllocator
from pd_serve.config import EngineConfig, SchedulerConfig
from pd_serve.engine.core import resolve_model
from pd_serve.engine.executor import Executor
from pd_serve.engine.plan import (KVSend, NewRequest, RequestDiff, StepChunk, StepPlan, StepResult,
                                  sampling_from_wire, sampling_to_wire)
from pd_serve.engine.request import FinishReason, Request, TokenLogprob
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.engine.scheduler import PlanBuilder, Scheduler

PAGE_SIZE = 4


def _wire(obj):
    return msgpack.unpackb(msgpack.packb(obj.to_wire(), use_bin_type=True), raw=False)


def test_plan_and_result_round_trip_through_msgpack():
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=7, logprobs=2, prompt_logprobs=1,
                            repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5,
                            logit_bias={3: 1.5, 9: -100.0})
    plan = StepPlan(chunks=[StepChunk("a", 0, 5, True), StepChunk("b", 9, 1, False)],
                    new_requests=[NewRequest("a", [1, 2, 3, 4, 5], 5, [7, 2], sampling_to_wire(params))],
                    request_diffs=[RequestDiff("b", [42], [11])], finished_ids=["c"],
                    preempted_ids=["d"], kv_sends=[KVSend("a", ["tcp://x:1", "tcp://y:2"], [7, 2], [0, 1])])
    assert StepPlan.from_wire(_wire(plan)) == plan
    assert sampling_from_wire(plan.new_requests[0].sampling) == params
    assert StepPlan.from_wire(_wire(StepPlan())) == StepPlan()
    result = StepResult([5, 6], [None, TokenLogprob(6, -0.25, [(6, -0.25), (1, -2.0)])],
                        {"a": (3, [TokenLogprob(4, -1.5, [(9, -0.5)]), TokenLogprob(5, -0.75, [])])})
    assert StepResult.from_wire(_wire(result)) == result


def test_a_request_goes_out_in_full_once_then_as_diffs():
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=6), PageAllocator(8), PAGE_SIZE)
    builder = PlanBuilder()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    a = Request(list(range(1, 10)), params, request_id="a")  # 9 tokens: chunks of 6 and 3
    scheduler.add(a)

    out = scheduler.schedule()
    plan = builder.build(out)
    (new,) = plan.new_requests
    assert (new.request_id, new.token_ids, new.num_prompt_tokens) == ("a", a.prompt_token_ids, 9)
    assert new.page_ids == [0, 1]
    assert plan.chunks == [StepChunk("a", 0, 6, False)] and not plan.request_diffs
    scheduler.update(out, [])

    out = scheduler.schedule()  # the rest of the prompt: one more page, no tokens, no repeat
    plan = builder.build(out)
    assert not plan.new_requests and plan.request_diffs == [RequestDiff("a", [], [2])]
    assert plan.chunks == [StepChunk("a", 6, 3, True)]
    scheduler.update(out, [77])

    out = scheduler.schedule()  # decode: the sampled token, the page it already has
    plan = builder.build(out)
    assert plan.request_diffs == [RequestDiff("a", [77], [])] and plan.chunks == [StepChunk("a", 9, 1, True)]
    scheduler.update(out, [78])
    out = scheduler.schedule()
    assert builder.build(out).request_diffs == [RequestDiff("a", [78], [])]
    scheduler.update(out, [79])

    b = Request([5, 6], params, request_id="b")
    scheduler.add(b)
    scheduler.finish(a, FinishReason.STOP)
    plan = builder.build(scheduler.schedule())
    assert plan.finished_ids == ["a"] and [n.request_id for n in plan.new_requests] == ["b"]
    assert builder.build(scheduler.schedule()).finished_ids == []  # named once


def test_preempted_requests_lose_their_pages_and_get_new_ones_as_a_diff():
    builder = PlanBuilder()
    scheduler = Scheduler(SchedulerConfig(), PageAllocator(3), PAGE_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    a, b = Request([1] * 4, params, request_id="a"), Request([2] * 4, params, request_id="b")
    for r in (a, b):
        scheduler.add(r)
    out = scheduler.schedule()
    builder.build(out)
    scheduler.update(out, [10, 20])
    out = scheduler.schedule()  # both need a second page; one page left: b is preempted
    assert out.preempted == [b]
    plan = builder.build(out)
    assert plan.preempted_ids == ["b"] and [c.request_id for c in plan.chunks] == ["a"]
    scheduler.update(out, [11])
    scheduler.finish(a, FinishReason.STOP)
    plan = builder.build(scheduler.schedule())  # b again: new pages, its prompt + token known
    assert plan.finished_ids == ["a"] and not plan.new_requests
    assert plan.request_diffs == [RequestDiff("b", [20], b.page_ids)]
    assert plan.chunks == [StepChunk("b", 0, 5, True)]


def _executor(model_dir) -> Executor:
    config = EngineConfig.from_flat(model=str(model_dir), device="cpu", max_total_tokens=256,
                                    page_size=PAGE_SIZE)
    model_dir, _, max_len = resolve_model(config)
    return Executor(config, model_dir, max_len, torch.device("cpu"))


def test_an_executor_fed_plans_gives_the_engines_tokens(tiny_checkpoints):
    """Two requests (one greedy with logprobs, one seeded) by hand: prefill (the first in two
    chunks), then decode steps carrying only each step's sampled tokens and new pages."""
    from pd_serve import Engine

    prompts = [[5, 17, 300, 42, 9, 1000, 7], [88, 3, 4096]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=6, ignore_eos=True)]
    engine = Engine(tiny_checkpoints["llama3"], device="cpu", max_total_tokens=256, page_size=PAGE_SIZE)
    want = engine.generate(prompts, params)

    executor = _executor(tiny_checkpoints["llama3"])
    pages = {"a": [0, 1], "b": [4]}
    new = [NewRequest("a", prompts[0], 7, pages["a"], sampling_to_wire(params[0])),
           NewRequest("b", prompts[1], 3, pages["b"], sampling_to_wire(params[1]))]
    first = executor.execute(StepPlan(chunks=[StepChunk("a", 0, 4, False), StepChunk("b", 0, 3, True)],
                                      new_requests=new))
    second = executor.execute(StepPlan(chunks=[StepChunk("a", 4, 3, True)]))
    tokens = {"a": second.token_ids, "b": first.token_ids}
    logprobs = second.logprobs
    free = iter(range(8, 64))
    for step in range(5):
        diffs = []
        for request_id, length in (("a", 7), ("b", 3)):
            pos = length + step  # the newest token's position
            new_pages = [next(free)] if pos % PAGE_SIZE == 0 else []
            pages[request_id] += new_pages
            diffs.append(RequestDiff(request_id, tokens[request_id][-1:], new_pages))
        result = executor.execute(StepPlan(
            chunks=[StepChunk("a", 7 + step, 1, True), StepChunk("b", 3 + step, 1, True)],
            request_diffs=diffs))
        tokens["a"].append(result.token_ids[0])
        tokens["b"].append(result.token_ids[1])
        logprobs.append(result.logprobs[0])
    assert [tokens["a"], tokens["b"]] == [o.token_ids for o in want]
    assert [lp.token_id for lp in logprobs] == want[0].token_ids
    executor.update(StepPlan(finished_ids=["a", "b"]))
    assert not executor.requests


def test_a_request_whose_first_token_came_from_elsewhere_skips_its_draws(tiny_checkpoints):
    """Decode after prefill: a new request that already has an output token continues its
    seeded stream where the side that sampled it left it."""
    executor = _executor(tiny_checkpoints["llama3"])
    params = sampling_to_wire(SamplingParams(temperature=1.0, seed=11))
    prompt = [5, 17, 300]
    first = executor.execute(StepPlan([StepChunk("x", 0, 3, True)],
                                      [NewRequest("x", prompt, 3, [0], params)]))
    executor.update(StepPlan(new_requests=[NewRequest("y", prompt + first.token_ids, 3, [1], params)]))
    x, y = executor.requests["x"].generator, executor.requests["y"].generator
    assert y.get_state().equal(x.get_state())
    assert not y.get_state().equal(torch.Generator().manual_seed(11).get_state())
