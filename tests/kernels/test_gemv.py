"""The one-row GEMV kernel against F.linear and against the FP8 layer's reference.

On CPU the kernel runs in Triton's interpreter (fp16/fp32: its bf16 arithmetic is wrong); on a
CUDA machine the cuda-parametrised tests compile it at Llama-3.1-8B layer shapes.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from kernels import activation, gemv
from pd_serve.model import fp8

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # of max |ref|
# (N, K): ragged ones leave partial channel and K blocks; K >= 8192 takes the wide-block config
SHAPES = [(64, 256), (70, 1030), (24, 8200)]


@pytest.fixture(params=["tile", "rowsum"])
def form(request, monkeypatch):
    """Run the test with each way of summing over K (kernels/gemv.py's ROWSUM), whichever
    _block_config picks for the shape."""
    block_config = gemv._block_config
    rowsum = request.param == "rowsum"
    monkeypatch.setattr(gemv, "_block_config",
                        lambda n, k, fp8: (*block_config(n, k, fp8)[:4], rowsum))
    return request.param


@contextlib.contextmanager
def expect_launches(n: int):
    before = gemv.triton_launches
    yield
    assert gemv.triton_launches - before == n, "the Triton path did not run as expected"


def random(shape, dtype, device, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device, dtype)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype] * ref.float().abs().max().item(), err


def run_dense(device, dtype, n, k, with_bias):
    x = random((1, k), dtype, device, 1)
    w = random((n, k), dtype, device, 2, 0.05)
    bias = random((n,), dtype, device, 3) if with_bias else None
    with expect_launches(1):
        out = gemv.linear(x, w, bias)
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
    assert_close(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_dense_matches_linear(dtype, n, k, with_bias, form):
    run_dense("cpu", dtype, n, k, with_bias)


@needs_triton
def test_strided_row_and_other_shapes_fall_back():
    """A strided row is copied first; two rows (and [K] vectors) go to F.linear."""
    w = random((64, 256), torch.float32, "cpu", 2, 0.05)
    x = random((1, 512), torch.float32, "cpu", 1)[:, ::2]
    with expect_launches(1):
        assert_close(gemv.linear(x, w), F.linear(x, w), torch.float32)
    two = random((2, 256), torch.float32, "cpu", 1)
    with expect_launches(0):
        assert torch.equal(gemv.linear(two, w), F.linear(two, w))
        assert torch.equal(gemv.linear(two[0], w), F.linear(two[0], w))


def test_cpu_without_interpreter_is_f_linear(monkeypatch):
    monkeypatch.delenv("PD_SERVE_TRITON_CPU")
    x, w = random((1, 256), torch.float32, "cpu", 1), random((64, 256), torch.float32, "cpu", 2)
    with expect_launches(0):
        assert torch.equal(gemv.linear(x, w), F.linear(x, w))


def run_fp8(device, dtype, n, k, with_bias):
    """FP8 weights run weight-only: x @ (weight * weight_scale).T in float32, x not quantized."""
    x = random((1, k), dtype, device, 1)
    weight, weight_scale = fp8.quantize_weight(random((n, k), torch.float32, device, 2, 0.05))
    bias = random((n,), dtype, device, 3) if with_bias else None
    with expect_launches(1):
        out = gemv.gemv(x, weight, weight_scale, bias)
    ref = F.linear(x.float(), weight.float()) * weight_scale  # float32 math
    ref = ref.to(dtype) if bias is None else (ref.to(dtype) + bias)
    assert_close(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_fp8_weight_only_matches_reference(dtype, n, k, with_bias, form):
    run_fp8("cpu", dtype, n, k, with_bias)


def run_silu_and_mul(device, dtype, inner, k, fp8_weight):
    """The activation in the epilogue is bit for bit the GEMV followed by silu_and_mul."""
    x = random((1, k), dtype, device, 1)
    scale = None
    if fp8_weight:
        w, scale = fp8.quantize_weight(random((2 * inner, k), torch.float32, device, 2, 0.05))
    else:
        w = random((2 * inner, k), dtype, device, 2, 0.05)
    with expect_launches(1):
        fused = gemv.gemv(x, w, scale, silu_and_mul=True)
    with expect_launches(1):
        dense = gemv.gemv(x, w, scale)
    assert fused.shape == (1, inner) and fused.is_contiguous()
    assert torch.equal(fused, activation.silu_and_mul(dense))
    if not fp8_weight:
        ref = activation.silu_and_mul_ref(F.linear(x.float(), w.float()).to(dtype))
        assert_close(fused, ref, dtype)


@needs_triton
@pytest.mark.parametrize("fp8_weight", [False, True], ids=["dense", "fp8"])
@pytest.mark.parametrize("inner,k", [(32, 256), (35, 1030), (12, 8200)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_silu_and_mul_epilogue(dtype, inner, k, fp8_weight, form):
    run_silu_and_mul("cpu", dtype, inner, k, fp8_weight)


@needs_triton
def test_linear_silu_and_mul_takes_the_gemv_for_one_row_only():
    w = random((64, 256), torch.float32, "cpu", 2, 0.05)
    x = random((1, 256), torch.float32, "cpu", 1)
    with expect_launches(1):
        one = gemv.linear_silu_and_mul(x, w)
    assert torch.equal(one, gemv.gemv(x, w, silu_and_mul=True))
    two = random((2, 256), torch.float32, "cpu", 3)
    with expect_launches(0):
        assert torch.equal(gemv.linear_silu_and_mul(two, w),
                           activation.silu_and_mul(F.linear(two, w)))


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(2, 8)), r"x must be \[1, K\]"),
    (dict(w=torch.zeros(4, 16)), r"weight must be contiguous \[N, 8\]"),
    (dict(w=torch.zeros(8, 4).t()), "weight must be contiguous"),
    (dict(w=torch.zeros(4, 8, dtype=torch.float16)), "weight is torch.float16"),
    (dict(w=torch.zeros(4, 8, dtype=torch.float8_e4m3fn)), "needs weight_scale"),
    (dict(scale=torch.ones(4)), "takes no weight_scale"),
    (dict(w=torch.zeros(4, 8, dtype=torch.float8_e4m3fn), scale=torch.ones(3)),
     r"weight_scale must be float32 \[4\]"),
    (dict(bias=torch.zeros(5)), r"bias must be torch.float32 \[4\]"),
    (dict(w=torch.zeros(5, 8), glu=True), "silu_and_mul needs a .* even N"),
    (dict(bias=torch.zeros(4), glu=True), "and no bias"),
])
def test_bad_input_is_a_clear_error(bad, match):
    x = bad.get("x", torch.zeros(1, 8))
    w = bad.get("w", torch.zeros(4, 8))
    with pytest.raises(ValueError, match=match):
        gemv.gemv(x, w, bad.get("scale"), bad.get("bias"), silu_and_mul=bad.get("glu", False))


# ----------------------------------------------------------------------------- CUDA

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@needs_cuda
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_dense(device, dtype, n, k, form):
    run_dense(device, dtype, n, k, with_bias=True)


@needs_cuda
@pytest.mark.parametrize("fp8_weight", [False, True], ids=["dense", "fp8"])
@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_silu_and_mul_epilogue(device, fp8_weight, form):
    run_silu_and_mul(device, torch.bfloat16, 14336, 4096, fp8_weight)


@needs_cuda
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_fp8(device, n, k, form):
    run_fp8(device, torch.bfloat16, n, k, with_bias=False)


def test_model_switch_turns_the_gemv_on():
    """Linear layers run F.linear until llama.use_batch1_kernels (--enable-batch1-kernels)."""
    from torch import nn

    from pd_serve.model.llama import Linear, use_batch1_kernels
    layer = Linear(256, 64)
    model = nn.Sequential(layer)
    x = random((1, 256), torch.float32, "cpu", 1)
    with torch.no_grad(), expect_launches(0):
        assert torch.equal(model(x), F.linear(x, layer.weight, layer.bias))
    use_batch1_kernels(model)
    with torch.no_grad(), expect_launches(1):
        assert_close(model(x), F.linear(x, layer.weight, layer.bias), torch.float32)


def test_model_mlp_runs_its_activation_in_the_gemv():
    """Under use_batch1_kernels a one-row MLP is two GEMV launches (gate/up with the
    activation, down) and gives what the separate kernels give."""
    from types import SimpleNamespace

    from pd_serve.model.llama import MLP, use_batch1_kernels
    mlp = MLP(SimpleNamespace(hidden_size=256, intermediate_size=96))
    x = random((1, 256), torch.float32, "cpu", 1)
    with torch.no_grad():
        separate = mlp.down_proj(activation.silu_and_mul(mlp.gate_up_proj(x)))
        use_batch1_kernels(mlp)
        with expect_launches(2):
            fused = mlp(x)
        gated = activation.silu_and_mul(gemv.gemv(x, mlp.gate_up_proj.weight))
        assert torch.equal(fused, gemv.gemv(gated, mlp.down_proj.weight))
    assert_close(fused, separate, torch.float32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_fp8_mlp_runs_its_activation_in_the_gemv(device):
    """An FP8 MLP under use_batch1_kernels: on CUDA a one-row call is two GEMV launches (gate/up
    with the activation in the epilogue, down), bit for bit the plain GEMV and silu_and_mul; on
    the CPU the reference runs, with the activation applied after it."""
    from types import SimpleNamespace

    from pd_serve.model.llama import MLP, use_batch1_kernels
    from pd_serve.model.quant import Fp8Linear
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    mlp = MLP(SimpleNamespace(hidden_size=256, intermediate_size=96)).to(device, dtype)
    config = fp8.Fp8Config(static_activation=False)
    for name, sizes in (("gate_up_proj", [96, 96]), ("down_proj", [256])):
        setattr(mlp, name, Fp8Linear.from_linear(getattr(mlp, name), sizes, config,
                                                 keep_dense=False))
    use_batch1_kernels(mlp)
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    x = random((1, 256), dtype, device, 1)
    with torch.no_grad():
        with expect_launches(2 if device == "cuda" else 0):
            fused = mlp(x)
        gated = activation.silu_and_mul(gate_up(x))
        assert gated.shape == (1, 96)
        assert torch.equal(fused, down(gated))
