"""W4A16 GEMM on GPTQ INT4 weights: the Triton kernel against the torch reference.

Layers are made with `quantize_rtn` (round-to-nearest packing in the GPTQ layout). On CPU the
kernel runs in Triton's interpreter (an autouse fixture sets PD_SERVE_TRITON_CPU=1 for each CPU
test; its bf16 arithmetic is wrong, so CPU tests use fp16 and fp32 activations); on a CUDA
machine the cuda-marked tests compile it, at the shapes of a Llama-8B layer.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from kernels import w4a16
from pd_serve.model import gptq

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # of max |ref|

# name -> (in_features, out_features, group_size, sym, act_order, checkpoint_format, zeros)
LAYERS = {
    "sym-g128": (256, 64, 128, True, False, "gptq", True),
    "asym-g128": (256, 64, 128, False, False, "gptq", True),
    "asym-g128-v2": (256, 64, 128, False, False, "gptq_v2", True),
    "asym-g128-k384": (384, 64, 128, False, False, "gptq", True),  # split 2: a masked step
    "asym-per-channel": (256, 64, -1, False, False, "gptq", True),
    "asym-g32": (256, 64, 32, False, False, "gptq", True),  # BLOCK_K shrinks to the group
    "asym-g40": (160, 64, 40, False, False, "gptq", True),  # per-row groups, computed
    "asym-act-order": (256, 64, 64, False, True, "gptq", True),
    "sym-act-order-no-zeros": (256, 64, 64, True, True, "gptq", False),
    "ragged": (264, 72, -1, False, False, "gptq", True),  # K, N past whole blocks
}


@contextlib.contextmanager
def expect_launches(n: int):
    """Fails unless the block launched the Triton kernel exactly n times."""
    before = w4a16.triton_launches
    yield
    assert w4a16.triton_launches - before == n, "the Triton path did not run"


def make_layer(spec: tuple, device="cpu", seed: int = 0) -> tuple[dict, str]:
    """A GPTQ layer of a LAYERS entry as the kernel takes it, and its checkpoint format.
    Trivial groupings pass g_idx None (the fast path)."""
    in_features, out_features, group_size, sym, act_order, fmt, zeros = spec
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05  # [out, in]
    g_idx = None
    if act_order:
        perm = torch.randperm(in_features, generator=g)
        g_idx = gptq.trivial_g_idx(in_features, group_size)[perm]
    qweight, qzeros, scales, g_idx = gptq.quantize_rtn(weight, group_size, sym, g_idx=g_idx,
                                                       checkpoint_format=fmt)
    layer = {"qweight": qweight, "qzeros": qzeros if zeros else None, "scales": scales,
             "g_idx": g_idx if act_order else None}
    return {k: v.to(device) if v is not None else None for k, v in layer.items()}, fmt


def random_x(shape, dtype, device, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device, dtype)


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[ref.dtype] * ref.float().abs().max().item(), err


@needs_triton
@pytest.mark.parametrize("split_k", [None, 2])
@pytest.mark.parametrize("layer_name", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_matches_reference(dtype, layer_name, split_k):
    layer, fmt = make_layer(LAYERS[layer_name])
    x = random_x((3, layer["qweight"].shape[0] * 8), dtype, "cpu")  # [M, K]
    ref = w4a16.w4a16_matmul_ref(x, **layer, checkpoint_format=fmt)
    with expect_launches(1):
        out = w4a16.w4a16_matmul(x, **layer, checkpoint_format=fmt, split_k=split_k)
    assert_matches_reference(out, ref)


@needs_triton
@pytest.mark.parametrize("split_k", [None, 2])
@pytest.mark.parametrize("layer_name", [n for n, spec in LAYERS.items() if not spec[4]])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_one_row_kernel(dtype, layer_name, split_k, monkeypatch):
    """One row of a trivially grouped layer runs the one-row kernel (nibbles turned into floats
    by bit tricks, zero points factored out per group), never the tiled one."""
    monkeypatch.setattr(w4a16, "_launch", lambda *a, **k: pytest.fail("the tiled kernel ran"))
    layer, fmt = make_layer(LAYERS[layer_name])
    x = random_x((1, layer["qweight"].shape[0] * 8), dtype, "cpu")  # [1, K]
    with expect_launches(1):
        out = w4a16.w4a16_matmul(x, **layer, checkpoint_format=fmt, split_k=split_k)
    assert_matches_reference(out, w4a16.w4a16_matmul_ref(x, **layer, checkpoint_format=fmt))


@needs_triton
@pytest.mark.parametrize("m", [1, 20, 40, 70])  # each block configuration
@pytest.mark.parametrize("layer_name", ["asym-g128", "asym-act-order"])
def test_block_configurations(layer_name, m):
    layer, fmt = make_layer(LAYERS[layer_name])
    x = random_x((m, 256), torch.float16, "cpu")
    with expect_launches(1):
        out = w4a16.w4a16_matmul(x, **layer, checkpoint_format=fmt)
    assert_matches_reference(out, w4a16.w4a16_matmul_ref(x, **layer, checkpoint_format=fmt))


@needs_triton
@pytest.mark.parametrize("layer_name", ["asym-g128", "asym-act-order",
                                        "sym-act-order-no-zeros", "ragged"])
def test_dequantize_then_matmul_path(layer_name, monkeypatch):
    """From DEQUANT_MIN_M rows the kernel writes W.T once and torch multiplies."""
    monkeypatch.setattr(w4a16, "DEQUANT_MIN_M", 4)
    layer, fmt = make_layer(LAYERS[layer_name])
    x = random_x((5, layer["qweight"].shape[0] * 8), torch.float16, "cpu")
    with expect_launches(1):
        out = w4a16.w4a16_matmul(x, **layer, checkpoint_format=fmt)
    assert_matches_reference(out, w4a16.w4a16_matmul_ref(x, **layer, checkpoint_format=fmt))


@needs_triton
@pytest.mark.parametrize("dequant_min_m", [128, 1], ids=["in-register", "dequantize"])
@pytest.mark.parametrize("layer_name", ["asym-act-order", "sym-act-order-no-zeros"])
def test_sorted_act_order_layer_with_perm(layer_name, dequant_min_m, monkeypatch):
    """sort_act_order + perm: the trivial-grouping fast path computes the unsorted layer."""
    monkeypatch.setattr(w4a16, "DEQUANT_MIN_M", dequant_min_m)
    layer, fmt = make_layer(LAYERS[layer_name])
    qweight, g_idx, perm = gptq.sort_act_order(layer["qweight"], layer["g_idx"])
    assert g_idx is None  # GPTQ's act-order groups are of equal size
    x = random_x((3, 256), torch.float16, "cpu")
    ref = w4a16.w4a16_matmul_ref(x, **layer, checkpoint_format=fmt)
    sorted_layer = {**layer, "qweight": qweight, "g_idx": None}
    with expect_launches(1):
        out = w4a16.w4a16_matmul(x, **sorted_layer, perm=perm, checkpoint_format=fmt)
    assert_matches_reference(out, ref)
    assert_matches_reference(w4a16.w4a16_matmul_ref(x, **sorted_layer, perm=perm,
                                                    checkpoint_format=fmt), ref)


@needs_triton
def test_matches_dense_matmul_of_the_dequantized_weight():
    """The reference is x @ dequantize(...).T: check it against torch.nn.functional.linear."""
    layer, fmt = make_layer(LAYERS["asym-act-order"])
    x = random_x((5, 256), torch.float32, "cpu")
    dense = gptq.dequantize(**layer, checkpoint_format=fmt, dtype=torch.float32)  # [out, in]
    expected = torch.nn.functional.linear(x, dense)
    with expect_launches(1):
        out = w4a16.w4a16_matmul(x, **layer, checkpoint_format=fmt)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_triton
def test_strided_and_batched_x():
    layer, _ = make_layer(LAYERS["asym-g128"])
    wide = random_x((4, 512), torch.float16, "cpu")
    x = wide[:, 128:384]  # [4, 256], row stride 512
    with expect_launches(2):
        out = w4a16.w4a16_matmul(x, **layer)
        batched = w4a16.w4a16_matmul(x.reshape(2, 2, 256), **layer)
    ref = w4a16.w4a16_matmul_ref(x.contiguous(), **layer)
    assert_matches_reference(out, ref)
    assert batched.shape == (2, 2, 64) and torch.equal(batched.reshape(4, 64), out)


@needs_triton
def test_no_rows_launches_nothing():
    layer, _ = make_layer(LAYERS["sym-g128"])
    with expect_launches(0):
        out = w4a16.w4a16_matmul(torch.empty(0, 256, dtype=torch.float16), **layer)
    assert out.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_without_interpreter_cpu_uses_the_reference(monkeypatch, dtype):
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    layer, fmt = make_layer(LAYERS["asym-act-order"])
    x = random_x((3, 256), dtype, "cpu")
    with expect_launches(0):
        out = w4a16.w4a16_matmul(x, **layer, checkpoint_format=fmt)
    assert torch.equal(out, w4a16.w4a16_matmul_ref(x, **layer, checkpoint_format=fmt))


def _bad_calls():
    layer, _ = make_layer(LAYERS["asym-g128"])
    x = random_x((2, 256), torch.float16, "cpu")
    yield "x of other width", lambda: w4a16.w4a16_matmul(x[:, :128], **layer)
    yield "x int", lambda: w4a16.w4a16_matmul(x.to(torch.int32), **layer)
    yield "unknown format", lambda: w4a16.w4a16_matmul(x, **layer, checkpoint_format="awq")
    yield "scales of other groups", lambda: w4a16.w4a16_matmul(
        x, **{**layer, "scales": layer["scales"][:1]})
    yield "g_idx too short", lambda: w4a16.w4a16_matmul(
        x, **{**layer, "g_idx": torch.zeros(8, dtype=torch.int32)})
    yield "perm too short", lambda: w4a16.w4a16_matmul(x, **layer, perm=torch.arange(8))


@pytest.mark.parametrize("call", [pytest.param(c, id=name) for name, c in _bad_calls()])
def test_rejects_bad_inputs(call):
    with expect_launches(0), pytest.raises(ValueError):
        call()


# ----------------------------------------------------------------------------- CUDA

CUDA_LAYERS = {  # a Llama-8B q/o projection: in 4096, out 4096, groups of 128
    "sym-g128": (4096, 4096, 128, True, False, "gptq", True),
    "asym-act-order": (4096, 4096, 128, False, True, "gptq", True),
}


@needs_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 16, 64, 128, 512])  # 512: dequantize, then cuBLAS
@pytest.mark.parametrize("layer_name", list(CUDA_LAYERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_matches_reference(device, dtype, layer_name, m):
    layer, fmt = make_layer(CUDA_LAYERS[layer_name], device)
    x = random_x((m, 4096), dtype, device)
    ref = w4a16.w4a16_matmul_ref(x, **layer, checkpoint_format=fmt)
    with expect_launches(1):
        out = w4a16.w4a16_matmul(x, **layer, checkpoint_format=fmt)
    assert_matches_reference(out, ref)
    if layer["g_idx"] is not None:  # the same layer sorted, on the fast path
        qweight, g_idx, perm = gptq.sort_act_order(layer["qweight"], layer["g_idx"])
        with expect_launches(1):
            out = w4a16.w4a16_matmul(x, **{**layer, "qweight": qweight, "g_idx": g_idx},
                                     perm=perm, checkpoint_format=fmt)
        assert g_idx is None
        assert_matches_reference(out, ref)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_graph_replay_with_split_k(device):
    """No host syncs: the call (split-K partials and their sum included) captures and replays."""
    layer, _ = make_layer(CUDA_LAYERS["sym-g128"], device)
    x = random_x((4, 4096), torch.bfloat16, device)
    w4a16.w4a16_matmul(x, **layer, split_k=4)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16.w4a16_matmul(x, **layer, split_k=4)
    x.copy_(random_x((4, 4096), torch.bfloat16, device, seed=7))
    graph.replay()
    assert_matches_reference(out, w4a16.w4a16_matmul_ref(x, **layer))
