"""An MoE model on a GPU (skipped without CUDA): decode through CUDA graphs with the fused
Triton MoE gives the greedy tokens of the eager engine on the torch reference MoE, at a batch
size that needs bucket padding (float32, so the two only differ in summation order)."""

from __future__ import annotations

import pytest
import torch

from pd_serve import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_graphs_with_the_fused_moe_equal_the_eager_reference(tiny_moe_checkpoints, kind):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 30, 77)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for backend, graphs in (("torch", False), ("triton", True)):
        engine = Engine(tiny_moe_checkpoints[kind], device="cuda", dtype="float32",
                        max_total_tokens=4096, moe_runner_backend=backend,
                        disable_cuda_graph=not graphs)
        assert engine.executor.moe_backend == backend
        outs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
        del engine
        torch.cuda.empty_cache()
    assert outs["triton"] == outs["torch"]
