"""Per-token FP8 activation quantization: the Triton kernel against its torch reference, bit for
bit. On CPU the kernel runs in Triton's interpreter, whose float32 -> FP8 cast rounds wrongly
(ties away from zero, 31.0 to 16.0, subnormals): CPU tests compare the scales on random rows
and the FP8 values on rows that scale to exact FP8 values; the GPU test compares both on
random rows."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import fp8_quant

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rows(shape, dtype, device, exact: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    x[1] = 0.0  # an all-zero row: the smallest scale
    if exact:  # FP8 values times 2**-5, each nonzero row holding +-448: x / s is exact
        x = (x * 30).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        x[0, 5], x[2:, 7] = -448.0, 448.0
        x = x * 2 ** -5
    return x.to(device, dtype)


def check(x: torch.Tensor, input_scale, compare_q: bool) -> None:
    before = fp8_quant.triton_launches
    q, scale = fp8_quant.quantize_per_token(x, input_scale)
    assert fp8_quant.triton_launches == before + 1, "the Triton path did not run"
    ref_q, ref_scale = fp8_quant.quantize_per_token_ref(x, input_scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    assert scale.shape == (x.shape[0], 1) and scale.is_contiguous()
    assert torch.equal(scale, ref_scale)
    if compare_q:
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("k", [256, 1000, 2600])  # one block, a ragged one, several
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_matches_reference(dtype, k, static):
    scale = torch.tensor([2 ** -5]) if static else None
    check(rows((5, k), dtype, "cpu", exact=False), scale, compare_q=False)
    check(rows((5, k), dtype, "cpu", exact=True), scale, compare_q=True)


@needs_triton
def test_strided_rows_and_empty_batch():
    x = rows((5, 512), torch.float32, "cpu", exact=True)[:, :256]  # row stride 512
    check(x, None, compare_q=True)
    q, scale = fp8_quant.quantize_per_token(torch.zeros(0, 64))
    assert q.shape == (0, 64) and scale.shape == (0, 1)


@pytest.mark.parametrize("x, scale, match", [
    (torch.zeros(4), None, r"x must be \[T, K\]"),
    (torch.zeros(4, 8, dtype=torch.int32), None, "x must be"),
    (torch.zeros(8, 4).t(), None, "contiguous rows"),
    (torch.zeros(2, 8), torch.ones(2), "input_scale must be one float32"),
    (torch.zeros(2, 8), torch.ones(1, dtype=torch.float16), "input_scale must be one float32"),
])
def test_bad_input_is_a_clear_error(x, scale, match):
    with pytest.raises(ValueError, match=match):
        fp8_quant.quantize_per_token(x, scale)


@needs_cuda
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("k", [4096, 14336])
@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_bit_exact(device, k, static):
    scale = torch.tensor([0.01], device=device) if static else None
    check(rows((64, k), torch.bfloat16, device, exact=False), scale, compare_q=True)
