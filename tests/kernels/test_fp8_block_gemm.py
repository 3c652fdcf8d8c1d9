"""The block-scaled FP8 GEMM (kernels/fp8_block_gemm.py) against its torch reference, at ragged
N and K (not multiples of the 128 block) and M in {1, 7, 64}. On CPU the kernel runs in Triton's
interpreter (upcast to float32 there); the GPU variant compiles it and skips without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import fp8_block_gemm as bg

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
BLOCK = (128, 128)


def operands(m: int, n: int, k: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g) * 0.05
    w[: min(n, 128), : min(k, 128)] *= 8  # blocks of different scales
    weight, scale_inv = bg.quantize_blocks(w, BLOCK)
    return x, weight.to(device), scale_inv.to(device)


def test_quantize_blocks_round_trip():
    w = torch.randn(200, 300)
    weight, scale_inv = bg.quantize_blocks(w, BLOCK)
    assert weight.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
    back = bg.dequantize_blocks(weight, scale_inv, BLOCK)
    assert torch.allclose(back, w, rtol=0.07, atol=1e-3)


def test_quantize_per_group_ragged():
    x = torch.randn(5, 300)
    q, scale = bg.quantize_per_group(x, 128)
    assert q.shape == (5, 300) and scale.shape == (5, 3)
    back = q.float() * scale.repeat_interleave(128, 1)[:, :300]
    assert torch.allclose(back, x, rtol=0.07, atol=1e-2)


@needs_triton
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("n,k", [(200, 300), (128, 256), (72, 100)])
def test_block_gemm_interpreter(m, n, k):
    x, weight, scale_inv = operands(m, n, k, "cpu", torch.float32)
    before = bg.triton_launches
    out = bg.block_linear(x, weight, scale_inv, BLOCK)
    assert bg.triton_launches == before + 1, "the Triton path did not run"
    ref = bg.block_linear_ref(x, weight, scale_inv, BLOCK)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_reference_without_triton(monkeypatch):
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "0")
    x, weight, scale_inv = operands(3, 200, 300, "cpu", torch.float32)
    before = bg.triton_launches
    out = bg.block_linear(x, weight, scale_inv, BLOCK)
    assert bg.triton_launches == before
    exact = x @ bg.dequantize_blocks(weight, scale_inv, BLOCK).T
    torch.testing.assert_close(out, exact, rtol=0.1, atol=0.3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("device", ["cuda"])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("n,k", [(200, 300), (2048, 7168), (576, 2048)])
def test_block_gemm_gpu(device, m, n, k):
    x, weight, scale_inv = operands(m, n, k, device, torch.bfloat16)
    out = bg.block_linear(x, weight, scale_inv, BLOCK)
    ref = bg.block_linear_ref(x.float(), weight, scale_inv, BLOCK)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@needs_triton
def test_row_scales_interpreter():
    """Per-row scales (what a fused or sharded layer keeps) give the same product."""
    x, weight, scale_inv = operands(7, 200, 300, "cpu", torch.float32)
    rows = bg.row_scales(scale_inv, 200, BLOCK)
    assert rows.shape == (200, 3)
    torch.testing.assert_close(bg.block_linear(x, weight, rows, BLOCK),
                               bg.block_linear_ref(x, weight, scale_inv, BLOCK), rtol=1e-4, atol=1e-4)
