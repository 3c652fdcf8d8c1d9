"""An MoE model on a GPU (skipped without CUDA): decode through CUDA graphs with the fused
Triton MoE gives the greedy tokens of the eager engine on the torch reference MoE, at a batch
size that needs bucket padding (float32, so the two only differ in summation order); and the
routing kernel against its reference, eager and replayed in a CUDA graph."""

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


def test_batch1_kernels_keep_the_eager_references_tokens(tiny_moe_checkpoints):
    """--enable-batch1-kernels on Qwen3-MoE, one prompt at a time through CUDA graphs: the
    experts on kernels/moe_batch1.py and the q/k norms inside the RoPE + KV store kernel give
    the eager torch-MoE engine's greedy tokens (float32: the two differ in summation order;
    so the Triton attention backend, as flashinfer runs bf16 / fp16 only)."""
    from kernels import kv_store, moe_batch1

    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (6, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for batch1 in (False, True):
        # counted from before the engine: its graphs capture the launches, steps replay them
        experts, stores = moe_batch1.triton_launches, kv_store.triton_launches
        engine = Engine(tiny_moe_checkpoints["qwen3_moe"], device="cuda", dtype="float32",
                        max_total_tokens=4096, moe_runner_backend="triton" if batch1 else "torch",
                        attention_backend="triton", enable_batch1_kernels=batch1,
                        disable_cuda_graph=not batch1)
        outs[batch1] = [engine.generate([p], params)[0].token_ids for p in prompts]
        assert (moe_batch1.triton_launches > experts) == batch1
        assert kv_store.triton_launches > stores
        del engine
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (64, 128, 8), (5, 60, 4), (3, 8, 2)])
def test_routing_kernel_equals_the_reference_and_replays(dtype, tokens, experts, top_k):
    """kernels/moe_routing.py on the GPU against select_experts (ids exact where no chosen
    logit ties; equal logits go lowest id first), then in a CUDA graph on new logits."""
    from kernels.fused_moe import select_experts
    from kernels.moe_routing import route

    def check(logits, weights, ids):
        want_weights, want_ids = select_experts(logits, top_k, True)
        lowest_first = torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :top_k]
        assert torch.equal(ids.long(), lowest_first)
        assert torch.equal(logits.gather(1, ids.long()), logits.gather(1, want_ids))
        torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)

    gen = torch.Generator().manual_seed(tokens + experts)
    logits = (2 * torch.randn(tokens, experts, generator=gen)).to("cuda", dtype)
    logits[0, : 2 * top_k] = 1.5  # a tie across the top-k boundary
    weights, ids = route(logits, top_k, True)
    assert ids.dtype == torch.int32
    check(logits, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route(logits, top_k, True)
    logits.copy_((2 * torch.randn(tokens, experts, generator=gen)).to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    check(logits, weights, ids)
