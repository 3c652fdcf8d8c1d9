"""The runner's CUDA-graph decode path without a GPU: capture is replaced by a stand-in whose
replay() reruns the captured forward eagerly on the same fixed buffers, so bucketing, padding
rows (slot -1), the fixed-buffer planning of the Triton backend (in Triton's interpreter) and
the sampling of the right rows are all checked against the eager torch backend."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import assert_pages_settled
from kernels import argmax
from pd_serve import Engine, SamplingParams
from pd_serve.cli import build_parser, engine_config_from_args
from pd_serve.engine.runner import ModelRunner, graph_batch_sizes

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    # The interpreter runs only where TRITON_INTERPRET=1 preceded triton's import (CPU machines);
    # on a GPU, tests/gpu captures real graphs.
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-in; tests/gpu covers the GPU"),
]


class EagerGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() recomputes the bucket into its output."""

    replays = 0

    def __init__(self, runner: ModelRunner, bs: int):
        self.runner, self.bs = runner, bs

    def replay(self) -> None:
        EagerGraph.replays += 1
        self.runner.graph_logits[self.bs].copy_(self.runner._graph_forward(self.bs))


def _capture(self: ModelRunner, bs: int, pool) -> EagerGraph:
    self.graph_logits[bs] = self._graph_forward(bs)
    return EagerGraph(self, bs)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(256)[-3:] == [240, 248, 256]


def test_graph_decode_equals_eager(monkeypatch, tiny_checkpoints):
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")
    monkeypatch.setattr(ModelRunner, "_capture", _capture)
    model = tiny_checkpoints["llama3"]
    prompts = [list(range(7, 7 + n)) for n in (3, 18, 33, 5, 9)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = Engine(model, device="cpu", attention_backend="torch", max_total_tokens=1024)
    graphed = Engine(model, device="cpu", attention_backend="triton", max_total_tokens=1024,
                     page_size=4)
    graphed.runner.capture_cuda_graphs(8, 64)
    assert sorted(graphed.runner.graphs) == [1, 2, 4, 8]
    # the graphs' logits are rows of one [8, V] buffer, not a buffer each (1 + 2 + 4 + 8 rows)
    out = graphed.runner.graph_logits_out
    assert out.shape == (8, graphed.model_config.vocab_size)
    assert {lg.data_ptr() for lg in graphed.runner.graph_logits.values()} == {out.data_ptr()}
    for batch in ([prompts[0]], prompts[:3], prompts):  # buckets 1, 4 (one padded row), 8 (three)
        EagerGraph.replays = 0
        want = [o.token_ids for o in eager.generate(batch, params)]
        argmax_launches = argmax.triton_launches
        got = [o.token_ids for o in graphed.generate(batch, params)]
        assert got == want
        assert EagerGraph.replays >= params.max_tokens - 1  # decode steps went through the graphs
        # each replay took its tokens from kernels/argmax.py's kernel
        assert argmax.triton_launches - argmax_launches >= EagerGraph.replays
        assert_pages_settled(graphed)


def test_graph_steps_resolve_tokens_from_every_kind_of_step(monkeypatch, tiny_checkpoints):
    """Pending ids in a graph step come from the graph's own argmax (greedy rows), from the
    Sampler's output copied into the graph's token buffer (seeded sampling, logprobs), or, after
    an eager step that sampled more rows than the largest bucket, are resolved before the
    replay: every token is the eager engine's."""
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")
    monkeypatch.setattr(ModelRunner, "_capture", _capture)
    model = tiny_checkpoints["llama3"]
    prompts = [list(range(3 + n, 12 + 2 * n)) for n in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)] * 2 + [
        greedy, SamplingParams(temperature=0.8, seed=11, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=7, ignore_eos=True), greedy]
    eager = Engine(model, device="cpu", attention_backend="torch", max_total_tokens=1024)
    graphed = Engine(model, device="cpu", attention_backend="triton", max_total_tokens=1024,
                     page_size=4)
    graphed.runner.capture_cuda_graphs(4, 64)  # six rows run eagerly; four, in a graph
    graphed.overlap = True  # (on by default on GPU only): ids are pending when planned
    for batch, batch_params in ((prompts, params), (prompts[2:], [greedy] * 4)):
        EagerGraph.replays = 0
        want = eager.generate(batch, batch_params)
        got = graphed.generate(batch, batch_params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert EagerGraph.replays >= 4
        assert_pages_settled(graphed)
        if batch is prompts:  # the logprobs row: its values as the eager engine's
            ours, ref = got[4].logprobs, want[4].logprobs
            assert len(ours) == len(ref) == 7 and all(len(lp.top) == 2 for lp in ours)
            assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in ref], abs=1e-4)


def test_batch1_kernels_flag_runs_the_gemv_and_keeps_greedy_tokens(monkeypatch, tiny_checkpoints):
    """--enable-batch1-kernels: one-row decode steps go through kernels/gemv.py (Triton's
    interpreter here), and in float32 the greedy tokens stay those of cuBLAS-style F.linear."""
    from kernels import gemv
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")
    # The interpreter runs one program at a time: 64 rows a program, not 2, take the LM head
    # (49,152 rows) from 24,576 programs a step to 768 (the block sizes' own masking paths are
    # tests/kernels/test_gemv.py's).
    block_config = gemv._block_config
    monkeypatch.setattr(gemv, "_block_config", lambda n, k, fp8: (64, *block_config(n, k, fp8)[1:]))
    model = tiny_checkpoints["llama3"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [list(range(7, 25))]
    want = Engine(model, device="cpu", attention_backend="torch", max_total_tokens=1024)
    args = build_parser().parse_args(["chat", "hi", "--enable-batch1-kernels"])
    assert engine_config_from_args(args).enable_batch1_kernels
    fast = Engine(model, device="cpu", attention_backend="torch", max_total_tokens=1024,
                  enable_batch1_kernels=True)
    before = gemv.triton_launches
    got = fast.generate(prompt, params)[0].token_ids
    assert gemv.triton_launches - before >= params.max_tokens - 1  # each decode step's layers
    assert got == want.generate(prompt, params)[0].token_ids


def test_batch1_kernels_flag_on_cpu_says_it_does_nothing(monkeypatch, tiny_checkpoints, caplog):
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    with caplog.at_level("WARNING"):
        Engine(tiny_checkpoints["llama3"], device="cpu", max_total_tokens=256,
               enable_batch1_kernels=True)
    assert "--enable-batch1-kernels has no effect on cpu" in caplog.text


def test_a_one_token_chunk_that_scores_the_prompt_runs_eagerly(monkeypatch, tiny_checkpoints):
    """With one-token prefill chunks every prompt step looks like decode; one whose logits score
    the prompt (prompt logprobs) must not go through the graphs, which keep the last row's only."""
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")
    monkeypatch.setattr(ModelRunner, "_capture", _capture)
    model, prompt = tiny_checkpoints["llama3"], list(range(7, 19))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    want = Engine(model, device="cpu", attention_backend="torch", max_total_tokens=1024).generate(
        [prompt], params)[0]
    graphed = Engine(model, device="cpu", attention_backend="triton", max_total_tokens=1024,
                     page_size=4, chunked_prefill_size=1)
    graphed.runner.capture_cuda_graphs(8, 64)
    EagerGraph.replays = 0
    got = graphed.generate([prompt], params)[0]
    assert EagerGraph.replays >= 2  # the decode steps did replay
    assert got.token_ids == want.token_ids
    assert [e.token_id for e in got.prompt_logprobs] == prompt[1:]
    assert [e.logprob for e in got.prompt_logprobs] == pytest.approx([e.logprob for e in want.prompt_logprobs],
                                                                       abs=1e-4)
    assert_pages_settled(graphed)
