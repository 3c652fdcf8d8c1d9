"""The fused MoE (Triton) against its torch reference, and moe_align's sorted, padded layout.

On CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py). Kernel and reference
round at the same points (gate/up and down outputs to the dtype, the weighted sum in float32),
but their GEMMs sum in different orders, so the check allows a few units in the last place.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import fused_moe as fm

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = [
    pytest.param("cpu", torch.float32, id="cpu-float32"),
    pytest.param("cpu", torch.float16, id="cpu-float16"),
    *[pytest.param("cuda", dtype, id=f"cuda-{str(dtype)[6:]}", marks=needs_cuda)
      for dtype in (torch.float32, torch.float16, torch.bfloat16)],
]
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
# (tokens, hidden, intermediate, experts, top k): one decode row, a few rows (block 16), many
# rows (block 64), sizes that are not multiples of the tiles, more experts than pairs.
SHAPES = [(1, 64, 32, 8, 2), (7, 96, 48, 6, 2), (80, 64, 64, 4, 2), (5, 40, 24, 16, 4)]


def _inputs(shape, device, dtype, seed=0, ties=False):
    tokens, hidden, inter, experts, top_k = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    router = torch.randn(experts, hidden, generator=gen)
    if ties:  # experts score in equal pairs, and the first rows score every expert alike
        router = router[torch.arange(experts) // 2]
        x[:2] = 0.0
    weights, ids = fm.select_experts(x @ router.T, top_k, renormalize=True)
    cast = dict(device=device, dtype=dtype)
    return x.to(**cast), w13.to(**cast), w2.to(**cast), weights.to(device), ids.to(device)


@needs_triton
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_fused_moe_equals_the_reference(device, dtype, shape, ties):
    x, w13, w2, weights, ids = _inputs(shape, device, dtype, ties=ties)
    if ties:  # the all-alike rows: torch.topk's pick, equal weights
        assert torch.equal(weights[:2], torch.full_like(weights[:2], 1 / shape[4]))
    launches = fm.triton_launches
    got = fm.fused_moe(x, w13, w2, weights, ids)
    assert fm.triton_launches == launches + 3  # the Triton path ran: GEMMs and reduce
    want = fm.fused_moe_ref(x, w13, w2, weights, ids)
    rtol, atol = TOLERANCE[dtype]
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_sorts_and_pads_by_expert(block_m):
    gen = torch.Generator().manual_seed(1)
    num_experts, tokens, top_k = 8, 37, 3
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[ids == 5] = 4  # expert 5 gets no token (and some tokens pick 4 twice: fine for the layout)
    sorted_ids, block_experts, num_padded = fm.moe_align(ids, num_experts, block_m)
    flat, num_pairs = ids.reshape(-1), ids.numel()
    used = int(num_padded)
    assert used % block_m == 0 and sorted_ids.numel() >= used
    real = sorted_ids[:used][sorted_ids[:used] < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    assert (sorted_ids[used:] == num_pairs).all()
    for b in range(used // block_m):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        assert len(rows) and (flat[rows] == block_experts[b]).all()  # one expert per block
        assert (rows.diff() > 0).all()  # stable: token order inside an expert
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())


@needs_triton
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("tokens,experts,top_k,block_m,offset", [
    (1, 8, 2, 16, 0), (37, 6, 3, 16, 0), (100, 16, 4, 32, 0), (9, 128, 8, 16, 0),
    (50, 8, 2, 64, 4),  # an expert-parallel rank's slice: ids outside [0, 8) are left out
])
def test_moe_align_kernel_equals_its_torch_ops(device, tokens, experts, top_k, block_m, offset):
    """The one-program Triton alignment writes exactly what the torch ops write."""
    from kernels import moe_align as ma
    gen = torch.Generator().manual_seed(tokens)
    total = experts + offset
    ids = torch.stack([torch.randperm(total, generator=gen)[:top_k] for _ in range(tokens)])
    ids = (ids - offset).to(device)
    assert ids.numel() <= ma.MAX_PAIRS and ma._kernel.runs_on(ids)
    got = ma.moe_align(ids, experts, block_m)
    want = ma.moe_align_ref(ids, experts, block_m)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
    # the offset taken inside (fused_moe's expert_offset), int32 ids as kernels/moe_routing.py's
    raw = (ids + offset).to(torch.int32)
    for g, w in zip(ma.moe_align(raw, experts, block_m, offset),
                    ma.moe_align_ref(raw, experts, block_m, offset)):
        assert torch.equal(g.cpu(), w.cpu())
    for g, w in zip(got, ma.moe_align_ref(raw, experts, block_m, offset)):
        assert torch.equal(g.cpu(), w.cpu())


@needs_triton
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("fn", ["fused_moe", "fused_moe_ref"])
def test_expert_slices_sum_to_the_whole(device, dtype, fn):
    """Expert parallelism: two ranks' unreduced pairs (experts 0-3 and 4-7), summed, then
    reduced over K, are bit for bit the one-rank result."""
    run = getattr(fm, fn)
    x, w13, w2, weights, ids = _inputs((9, 64, 32, 8, 3), device, dtype, seed=2)
    halves = [run(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], weights, ids,
                  expert_offset=r * 4, reduce=False) for r in range(2)]
    assert halves[0].dtype == torch.float32 and halves[0].shape == (9, 3, 64)
    whole = run(x, w13, w2, weights, ids)
    assert torch.equal((halves[0] + halves[1]).sum(dim=1).to(dtype), whole)


@needs_triton
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("offset", [0, 4])
def test_reduce_kernel_sums_over_k_as_torch(device, dtype, offset):
    """The reduce launch is the float32 sum over K in top-k order, one add after another,
    rounded once, bit for bit (as the reference's; torch's sum(dim=1) adds in another order on
    CUDA); under an expert offset the pairs of other ranks' experts add nothing."""
    x, w13, w2, weights, ids = _inputs((6, 64, 32, 12, 8), device, dtype, seed=5)
    w13, w2 = w13[offset:offset + 8], w2[offset:offset + 8]
    pairs = fm.fused_moe(x, w13, w2, weights, ids, expert_offset=offset, reduce=False)
    launches = fm.triton_launches
    got = fm.fused_moe(x, w13, w2, weights, ids, expert_offset=offset)
    assert fm.triton_launches == launches + 3
    total = pairs[:, 0]
    for k in range(1, 8):
        total = total + pairs[:, k]
    assert torch.equal(got, total.to(dtype))
    local = ids - offset
    assert (pairs[(local < 0) | (local >= 8)] == 0).all()


@needs_cuda
@pytest.mark.parametrize("device", ["cuda"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape,batch1", [((8, 64, 32, 8, 2), False), ((1, 256, 128, 16, 4), True)],
                         ids=["tokens", "batch1"])
def test_fused_moe_replays_in_a_cuda_graph(device, fp8, shape, batch1):
    """No host sync: captured once, replayed on new inputs and new routing, it follows them
    (batch1: one token on kernels/moe_batch1.py)."""
    from pd_serve.model.fp8 import quantize_experts

    x, w13, w2, weights, ids = _inputs(shape, device, torch.bfloat16, seed=3)
    scales = {}
    if fp8:
        (w13, scales["w13_scale"]), (w2, scales["w2_scale"]) = quantize_experts(w13), quantize_experts(w2)
    fm.fused_moe(x, w13, w2, weights, ids, batch1=batch1, **scales)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w13, w2, weights, ids, batch1=batch1, **scales)
    x2, _, _, weights2, ids2 = _inputs(shape, device, torch.bfloat16, seed=4)
    x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fm.fused_moe_ref(x, w13, w2, weights, ids, **scales),
                               rtol=TOLERANCE[torch.bfloat16][0], atol=TOLERANCE[torch.bfloat16][1])


@needs_triton
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_fused_moe_equals_the_reference(device, dtype, shape):
    """FP8 experts (per-channel scales in the epilogue) against the reference, and against the
    experts of the dequantized weights (which round W * scale to the dtype first)."""
    from pd_serve.model.fp8 import dequantize_weight, quantize_experts

    x, w13, w2, weights, ids = _inputs(shape, device, torch.float32, ties=True)
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    x = x.to(dtype)
    launches = fm.triton_launches
    got = fm.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    assert fm.triton_launches == launches + 3
    want = fm.fused_moe_ref(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    rtol, atol = TOLERANCE[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    dense = [torch.stack([dequantize_weight(q[e], s[e], dtype) for e in range(q.shape[0])])
             for q, s in ((q13, s13), (q2, s2))]
    torch.testing.assert_close(got, fm.fused_moe_ref(x, *dense, weights, ids),
                               rtol=2 * rtol, atol=2 * atol)


def test_fp8_experts_are_checked():
    from pd_serve.model.fp8 import quantize_experts

    x, w13, w2, weights, ids = _inputs((3, 64, 48, 8, 2), "cpu", torch.float32)
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    with pytest.raises(ValueError, match="both"):
        fm.fused_moe_ref(x, q13, q2, weights, ids, w13_scale=s13)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fm.fused_moe_ref(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="scales"):
        fm.fused_moe_ref(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s13)


# kernels/moe_batch1.py's block sizes: its defaults, and small ones that take the input in
# several steps, leave channels of the last block masked (hidden 40, intermediate 24) and give
# a gate/up program two experts (the last one's second masked at top 3); down with all K
# slots in a program, or split over programs (one or two slots each) whose last one sums
BATCH1_CONFIGS = [None, *({"gate_up": (2, 4, 16, 1, 1), "down": (slots, 8, 16, 1, 1)}
                          for slots in (16, 2, 1))]


@needs_triton
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", [(1, 64, 32, 8, 2), (1, 40, 24, 16, 4), (1, 40, 24, 16, 3)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", BATCH1_CONFIGS,
                         ids=["default-blocks", "small-blocks", "down-split-2", "down-split-1"])
@pytest.mark.parametrize("fp8", [False, True], ids=["dense", "fp8"])
def test_batch1_experts_equal_the_reference(device, dtype, shape, config, fp8):
    """One token through kernels/moe_batch1.py (two launches, no alignment) against the
    reference: gate/up, down and the weighted sum over the top k, dense and FP8 experts."""
    from kernels import moe_batch1
    from pd_serve.model.fp8 import quantize_experts

    x, w13, w2, weights, ids = _inputs(shape, device, torch.float32)
    scales = {}
    if fp8:
        (w13, scales["w13_scale"]), (w2, scales["w2_scale"]) = quantize_experts(w13), quantize_experts(w2)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    x = x.to(dtype)
    launches, batched = moe_batch1.triton_launches, fm.triton_launches
    if config is None:
        got = fm.fused_moe(x, w13, w2, weights, ids, batch1=True, **scales)
    else:
        got = moe_batch1.moe_batch1(x, w13, w2, weights, ids, config=config, **scales)
    assert moe_batch1.triton_launches == launches + 2 and fm.triton_launches == batched
    want = fm.fused_moe_ref(x, w13, w2, weights, ids, **scales)
    rtol, atol = TOLERANCE[dtype]
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@needs_triton
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("fp8", [False, True], ids=["dense", "fp8"])
def test_batch1_down_split_sums_bit_for_bit(device, dtype, fp8):
    """The down kernel's top k split over programs gives the one-program sum's bits (the last
    program sums the stored products in top-k order), and leaves its counters zero."""
    from kernels import moe_batch1
    from pd_serve.model.fp8 import quantize_experts

    x, w13, w2, weights, ids = _inputs((1, 40, 24, 16, 4), device, torch.float32)
    scales = {}
    if fp8:
        (w13, scales["w13_scale"]), (w2, scales["w2_scale"]) = quantize_experts(w13), quantize_experts(w2)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    outs = [moe_batch1.moe_batch1(x.to(dtype), w13, w2, weights, ids, **scales,
                                  config={"gate_up": (2, 4, 16, 1, 1), "down": (slots, 8, 8, 1, 1)})
            for slots in (4, 2, 1)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert int(moe_batch1._counter_buffers[x.device].count_nonzero()) == 0


def test_batch1_only_takes_one_token_on_one_rank():
    """batch1 is for one token whose experts all live here: more tokens, an expert-parallel
    slice or unreduced pairs take the general kernels."""
    calls = []
    real = fm.moe_batch1
    try:
        fm.moe_batch1 = lambda *a, **k: calls.append(1) or real(*a, **k)
        for shape, kwargs in (((2, 64, 32, 8, 2), {}), ((1, 64, 32, 8, 2), {"expert_offset": 4}),
                              ((1, 64, 32, 8, 2), {"reduce": False})):
            x, w13, w2, weights, ids = _inputs(shape, "cpu", torch.float32)
            fm.fused_moe(x, w13, w2, weights, ids, batch1=True, **kwargs)
        assert not calls
        x, w13, w2, weights, ids = _inputs((1, 64, 32, 8, 2), "cpu", torch.float32)
        fm.fused_moe(x, w13, w2, weights, ids, batch1=True)
        assert calls == [1]
    finally:
        fm.moe_batch1 = real
