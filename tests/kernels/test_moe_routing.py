"""The one-launch Triton routing (kernels/moe_routing.py) against `select_experts`.

On CPU the kernel runs in Triton's interpreter (tests/kernels/conftest.py). The ids must be
the reference's exactly where the logits differ; equal logits go lowest id first (torch.topk's
order among them is its algorithm's, so there the weights are checked as values)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import moe_routing as mr
from kernels.fused_moe import select_experts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = [
    pytest.param("cpu", torch.float32, id="cpu-float32"),
    pytest.param("cpu", torch.float16, id="cpu-float16"),
    *[pytest.param("cuda", dtype, id=f"cuda-{str(dtype)[6:]}", marks=needs_cuda)
      for dtype in (torch.float32, torch.float16, torch.bfloat16)],
]


def _logits(tokens, experts, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(tokens, experts, generator=gen)).to(device=device, dtype=dtype)


def _lowest_id_first(logits, top_k):
    """The kernel's rule: descending logits, equal ones by ascending id."""
    return torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :top_k]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("experts", [8, 60, 128])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
def test_routing_equals_select_experts(device, dtype, tokens, experts, top_k, renormalize):
    logits = _logits(tokens, experts, dtype, device, seed=tokens * experts + top_k)
    weights, ids = mr.route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32  # the kernel ran
    _check(logits, top_k, weights, ids, *select_experts(logits, top_k, renormalize))


def _check(logits, top_k, weights, ids, want_weights, want_ids):
    """ids by the lowest-id rule, the reference's where no chosen logit ties (fp16 logits
    sometimes do); the same chosen values and weights as the reference's always."""
    assert torch.equal(ids.long(), _lowest_id_first(logits, top_k))
    chosen = logits.gather(1, want_ids)
    assert torch.equal(logits.gather(1, ids.long()), chosen)
    untied = torch.tensor([row.unique().numel() == top_k and int((logits[t] == row.min()).sum()) == 1
                           for t, row in enumerate(chosen)], device=ids.device)
    assert torch.equal(ids.long()[untied], want_ids[untied])
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4), (128, 8)])
def test_ties_go_to_the_lowest_id(device, dtype, experts, top_k):
    """Rows of equal logits in pairs, a row of all-equal logits (CUDA-graph padding: zeros),
    and a row whose top K are one value: the kernel takes the lowest ids, with the reference's
    weights."""
    logits = _logits(4, experts, dtype, device, seed=7)
    logits[0] = logits[0, torch.arange(experts) // 2]  # every value twice, side by side
    logits[1] = logits[1].flip(0)[torch.arange(experts) // 2]
    logits[2] = 0.0
    logits[3, ::3] = 5.0  # more than K experts share the top value
    weights, ids = mr.route(logits, top_k, renormalize=True)
    _check(logits, top_k, weights, ids, *select_experts(logits, top_k, renormalize=True))


@pytest.mark.parametrize("device,dtype", CASES)
def test_nan_logits_still_choose_valid_experts(device, dtype):
    """A NaN logit counts as -inf for the choice: a row with NaNs takes its finite top K, an
    all-NaN row the lowest ids; no slot is left without a valid expert."""
    logits = _logits(2, 60, dtype, device, seed=5)
    logits[0, logits[0].topk(3).indices] = float("nan")
    logits[1] = float("nan")
    _, ids = mr.route(logits, 4, renormalize=True)
    finite = logits[0].float().nan_to_num(float("-inf"))
    assert ids[0].tolist() == _lowest_id_first(finite[None], 4)[0].tolist()
    assert ids[1].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("top_k", [3, 6])
def test_signed_zeros_minus_infinity_and_a_top_k_below_its_power_of_two(device, dtype, top_k):
    """The choice orders negative logits, -0.0 equal to 0.0 (a tie: lowest id first) and -inf
    as the floats do; a top k of 3 or 6 (DeepSeek-V2's) renormalises over its own
    k slots only."""
    logits = _logits(3, 64, dtype, device, seed=11)
    logits[0, :8] = torch.tensor([-0.0, 0.0, -0.0, -1.5, -1e-3, 0.0, -0.0, -1.5])
    logits[0, 8:] = -2.0 - logits[0, 8:].abs()  # the row's top k among the eight above
    logits[1, [4, 9]] = 60.0
    logits[1, [2, 30, 31]] = float("-inf")
    logits[2] = -logits[2].abs()  # all negative
    weights, ids = mr.route(logits, top_k, renormalize=True)
    _check(logits, top_k, weights, ids, *select_experts(logits, top_k, renormalize=True))
    assert ids[0].tolist() == [0, 1, 2, 5, 6, 4][:top_k]


@pytest.mark.parametrize("device,dtype", CASES[:2])
def test_sigmoid_scores_and_strided_logits(device, dtype):
    """Sigmoid scoring (DeepSeek-V3 without groups), and logits that are a column slice of a
    wider tensor (a row stride != E)."""
    wide = _logits(5, 80, dtype, device, seed=3)
    logits = wide[:, 10:70]
    for scoring in ("sigmoid", "softmax"):
        weights, ids = mr.route(logits, 4, renormalize=scoring == "softmax", scoring_func=scoring)
        _check(logits, 4, weights, ids, *select_experts(logits, 4, scoring == "softmax", scoring))


def test_no_tokens_and_bad_arguments():
    weights, ids = mr.route(torch.zeros(0, 8), 2, True)
    assert weights.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k"):
        mr.route(torch.zeros(3, 8), 9, True)
    with pytest.raises(ValueError, match="scoring_func"):
        mr.route(torch.zeros(3, 8), 2, True, scoring_func="relu")


def _one_row_case(experts, hidden, dtype, device, seed):
    """x, residual, norm weight, router weight for route_one_row. In float32 random; in 16-bit
    dtypes, where a summation order could round two logits to a tie, rows whose normalised sum
    is one-hot at `seed` (x + residual = 2 there, 0 elsewhere; norm weight 1) and a router
    column of distinct logits exact in the dtype (random values elsewhere)."""
    gen = torch.Generator().manual_seed(experts + hidden + seed)
    weight = torch.randn(experts, hidden, generator=gen) / hidden ** 0.5
    if dtype == torch.float32:
        x, residual = torch.randn(2, 1, hidden, generator=gen)
        norm_weight = 1 + torch.randn(hidden, generator=gen) / 4
    else:
        x, residual, norm_weight = torch.zeros(1, hidden), torch.zeros(1, hidden), torch.ones(hidden)
        x[0, seed], residual[0, seed] = 1.5, 0.5
        weight[:, seed] = (torch.randperm(experts, generator=gen) - experts // 2) * 0.125
    return [t.to(device=device, dtype=dtype) for t in (x, residual, norm_weight, weight)]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("experts,top_k,hidden", [(8, 2, 64), (60, 4, 200), (128, 8, 2048)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
def test_one_row_routing_equals_norm_router_then_select_experts(device, dtype, experts, top_k,
                                                                 hidden, renormalize):
    """route_one_row: the post-attention norm, the router's logits and the routing in one
    launch, twice in a row (the last program zeroes its counter for the next launch)."""
    from kernels.norm import rms_norm_ref

    for seed in (1, 2):
        x, residual, norm_weight, weight = _one_row_case(experts, hidden, dtype, device, seed)
        normed, summed, weights, ids = mr.route_one_row(x, residual, norm_weight, 1e-6, weight,
                                                        top_k, renormalize)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32  # the kernel ran
        assert int(mr._counters[x.device][0]) == 0
        want_normed, want_sum = rms_norm_ref(x, norm_weight, 1e-6, residual)
        assert torch.equal(summed, want_sum)
        eps = torch.finfo(dtype).eps  # the row's sum of squares in another order: a unit or so
        torch.testing.assert_close(normed, want_normed, rtol=2 * eps, atol=2 * eps)
        logits = (normed.float() @ weight.float().T).to(dtype)  # [1, E], up to summation order
        want_weights, want_ids = select_experts(logits, top_k, renormalize)
        assert torch.equal(ids.long(), want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("experts,top_k,hidden", [(8, 2, 64), (128, 8, 2048)])
def test_one_row_routing_ties_and_nan(device, dtype, experts, top_k, hidden):
    """Router rows equal in pairs give equal logits, taken lowest id first with the
    reference's weights; a NaN in the row (every logit NaN) still fills all K slots with
    distinct valid ids, the lowest (for the choice NaN counts as -inf), and NaN weights."""
    x, residual, norm_weight, weight = _one_row_case(experts, hidden, dtype, device, 1)
    weight = weight[torch.arange(experts, device=weight.device) // 2 * 2].contiguous()
    normed, _, weights, ids = mr.route_one_row(x, residual, norm_weight, 1e-6, weight, top_k, True)
    logits = (normed.float() @ weight.float().T).to(dtype)
    assert torch.equal(ids.long(), _lowest_id_first(logits, top_k))
    want_weights, _ = select_experts(logits, top_k, True)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    x[0, 0] = float("nan")
    _, _, weights, ids = mr.route_one_row(x, residual, norm_weight, 1e-6, weight, top_k, True)
    assert ids.tolist() == [list(range(top_k))] and bool(weights.isnan().all())
    assert int(mr._counters[x.device][0]) == 0


def test_one_row_routing_checks_its_arguments():
    x, norm_weight, weight = torch.zeros(1, 16), torch.ones(16), torch.zeros(8, 16)
    with pytest.raises(ValueError, match="want \\[1, H\\]"):
        mr.route_one_row(torch.zeros(2, 16), torch.zeros(2, 16), norm_weight, 1e-6, weight, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        mr.route_one_row(x, x, norm_weight, 1e-6, weight, 9, True)
    with pytest.raises(ValueError, match="scoring_func"):
        mr.route_one_row(x, x, norm_weight, 1e-6, weight, 2, True, "relu")


@needs_cuda
@pytest.mark.parametrize("device", ["cuda"])
def test_one_row_routing_replays_in_a_cuda_graph(device):
    """Captured once, replayed on new rows (the 16-bit case above), it follows them."""
    x, residual, norm_weight, weight = _one_row_case(128, 2048, torch.bfloat16, device, 0)
    for j in range(1, 4):
        weight[:, j] = _one_row_case(128, 2048, torch.bfloat16, device, j)[3][:, j]
    mr.route_one_row(x, residual, norm_weight, 1e-6, weight, 8, True)  # compile, the counter
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, _, weights, ids = mr.route_one_row(x, residual, norm_weight, 1e-6, weight, 8, True)
    for j in range(1, 4):
        x.zero_(), residual.zero_()
        x[0, j], residual[0, j] = 1.5, 0.5
        graph.replay()
        torch.cuda.synchronize()
        assert normed[0, j] > 0 and int((normed != 0).sum()) == 1
        want_weights, want_ids = select_experts((normed.float() @ weight.float().T).to(x.dtype), 8, True)
        assert torch.equal(ids.long(), want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
