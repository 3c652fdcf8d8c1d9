"""Tensor-parallel shards (model/parallel.py) in real processes over gloo: greedy tokens and
logits of TP 2 and TP 4 equal the unsharded model's, on a Llama and a Qwen3 tiny checkpoint.

Every rank runs the same scheduler, plans and executor on its own KV pool (its KV heads), as
the ranks of a TP worker do; TP 4 on a model with 2 KV heads replicates each KV head on two ranks."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from helpers import assert_pages_settled
from pd_serve.cache.allocator import PageAllocator
from pd_serve.config import EngineConfig
from pd_serve.engine.executor import Executor
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.engine.scheduler import PlanBuilder, Scheduler
from pd_serve.model.loader import load_model
from pd_serve.model.parallel import TPGroup, kv_heads_of, shard_config, shard_model
from pd_serve.ports import free_port

PAGE_SIZE, NUM_PAGES, STEPS = 4, 64, 12
PROMPTS = [[5, 17, 300, 42, 9, 1000, 7], [88, 3, 4096], [12] * 11]


def greedy(model_dir: str | Path, tp: TPGroup | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of PROMPTS batched together (chunked prefill of 8 tokens), and the logits of
    every step, through the engine's scheduler, its plans and an executor (this rank's shard)."""
    config = EngineConfig.from_flat(model=str(model_dir), device="cpu", dtype="float32",
                                    attention_backend="torch", page_size=PAGE_SIZE,
                                    max_total_tokens=NUM_PAGES * PAGE_SIZE, chunked_prefill_size=8)
    executor = Executor(config, Path(model_dir), 1024, torch.device("cpu"), tp)
    scheduler = Scheduler(config.scheduler, PageAllocator(NUM_PAGES), PAGE_SIZE)
    plans = PlanBuilder()
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
                for p in PROMPTS]
    for r in requests:
        scheduler.add(r)
    logits: list[torch.Tensor] = []
    compute = executor.model.compute_logits
    executor.model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, executor.execute(plans.build(out)).token_ids)
        for r in requests:
            if len(r.output_token_ids) >= STEPS and not r.finished:
                scheduler.finish(r, FinishReason.LENGTH)
    return [r.output_token_ids for r in requests], logits


def _rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.save(greedy(model_dir, TPGroup(rank, world)), Path(out) / f"rank{rank}.pt")
    # Every rank done before any tears down: rank 0 holds the group's TCP store, and leaving it
    # while another rank still talks to it aborted rank 0 once in CI (exit -6, "terminate
    # called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_tp(model_dir: Path, world: int, out: Path) -> list[tuple]:
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, str(model_dir), str(out)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_give_the_unsharded_tokens_and_logits(kind, tp, tiny_checkpoints, tmp_path):
    want_tokens, want_logits = greedy(tiny_checkpoints[kind])
    ranks = run_tp(tiny_checkpoints[kind], tp, tmp_path)
    for tokens, logits in ranks:  # every rank sampled the same tokens from the gathered logits
        assert tokens == want_tokens
        assert len(logits) == len(want_logits)
        for got, want in zip(logits, want_logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_shard_shapes_and_clear_errors(tiny_checkpoints):
    full = load_model(tiny_checkpoints["llama3"], torch.float32, "cpu").config
    assert (full.num_heads, full.num_kv_heads) == (4, 2)
    assert shard_config(full, 2).num_kv_heads == 1 and shard_config(full, 4).num_kv_heads == 1
    assert [kv_heads_of(r, 4, 2) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [kv_heads_of(r, 2, 2) for r in range(2)] == [range(0, 1), range(1, 2)]
    with pytest.raises(ValueError, match="--tp 3 does not divide this model: 4 attention heads"):
        shard_config(full, 3)


def test_a_tp_that_does_not_divide_the_model_fails_before_a_follower_starts(tiny_checkpoints,
                                                                            monkeypatch):
    """The engine checks the shapes before starting its followers: a follower's traceback
    came before the one-line error (a red-team pass, --tp 2 on a model of 9 heads)."""
    from pd_serve import Engine
    from pd_serve.engine import tp_group

    monkeypatch.setattr(tp_group, "start", lambda *a, **kw: pytest.fail("a follower started"))
    with pytest.raises(ValueError, match="--tp 3 does not divide this model: 4 attention heads"):
        Engine(str(tiny_checkpoints["llama3"]), device="cpu", tp=3)


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlap"])
def test_engine_with_tp_2_equals_tp_1(tiny_checkpoints, overlap):
    """Engine(tp=2): a follower process runs rank 1; rank 0 broadcasts every step (prefill,
    decode, a preemption under a tight KV budget) and samples, seeded sampling included. Under
    the overlap schedule (switched on by hand, as tests/model/test_overlap.py does on CPU) the
    follower reads a step's pending tokens from rank 0's samples (engine/executor.py); a
    penalised row makes some steps wait for the one before, and a short row ends early."""
    from pd_serve import Engine

    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1,
                             prompt_logprobs=2)]
    prompts = PROMPTS
    if overlap:
        params = params + [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                          repetition_penalty=1.3),
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)]
        prompts = PROMPTS + [[7, 8, 9, 10], [300, 301]]
    options = dict(device="cpu", max_total_tokens=32, page_size=4, chunked_prefill_size=8)
    want = Engine(tiny_checkpoints["qwen3"], **options).generate(prompts, params)
    engine = Engine(tiny_checkpoints["qwen3"], tp=2, **options)
    engine.overlap = overlap
    try:
        follower = engine._tp_followers[0]
        assert follower.is_alive()
        got = engine.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        # the third prompt's logprobs (every rank computes their logits: the all-gather needs each)
        g, w = got[2].prompt_logprobs, want[2].prompt_logprobs
        assert [e.token_id for e in g] == [e.token_id for e in w] == prompts[2][1:]
        assert [e.logprob for e in g] == pytest.approx([e.logprob for e in w], abs=1e-4)
        assert sum(o.num_preemptions for o in got) > 0, "the budget should force preemption"
        assert_pages_settled(engine)
    finally:
        engine.close()
    follower.join(timeout=10)
    assert follower.exitcode == 0


def test_a_dead_follower_fails_the_next_step_at_once(tiny_checkpoints):
    import os
    import signal
    import time

    from pd_serve import Engine

    engine = Engine(tiny_checkpoints["llama3"], device="cpu", tp=2, max_total_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        assert len(engine.generate([[5, 6, 7]], params)[0].token_ids) == 3
        follower = engine._tp_followers[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            engine.generate([[5, 6, 7]], params)
        assert time.monotonic() - start < 10
    finally:
        engine.close()  # does not raise with the follower gone


def test_shard_of_a_bf16_model_keeps_float32_rope_tables_and_the_dtype(tiny_checkpoints):
    """On GPU models load in bf16: sharding must not cast the RoPE tables (shared with the
    full model) down to it, and every parameter keeps the model's dtype."""
    full = load_model(tiny_checkpoints["llama3"], torch.bfloat16, "cpu")
    shard = shard_model(full, TPGroup(0, 1))
    for model in (full, shard):
        assert model.rope.cos.dtype == model.rope.sin.dtype == torch.float32
    assert {p.dtype for p in shard.parameters()} == {torch.bfloat16}
