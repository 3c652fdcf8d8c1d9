"""The FP8 GEMM for few rows (kernels/fp8_gemm.py) against its torch reference: rows 1-64, N and
K off the blocks, K split over programs (a short last split included). On CPU the kernel runs
in Triton's interpreter; the CUDA variant compiles it and holds it to torch._scaled_mm."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import fp8_gemm as fg
from kernels.fp8_quant import quantize_per_token
from pd_serve.model import fp8

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def operands(m: int, n: int, k: int, device: str):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g)
    x[0] *= 30  # rows of different scales
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 2] *= 8  # channels of different scales
    weight, scale = fp8.quantize_weight(w)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, a = quantize_per_token(x.to(device, dtype), None)
    return q, a, weight.to(device), scale.to(device)


@needs_triton
@pytest.mark.parametrize("m,n,k,config", [
    (1, 200, 300, None),
    (7, 72, 100, None),
    (64, 256, 512, None),
    (5, 130, 1000, (0, 64, 128, 3, 4, 4)),  # ragged N and K, a short last split
    (16, 128, 1024, (64, 32, 256, 4, 4, 4)),  # a 64-row tile for 16 rows
    (33, 64, 256, (0, 64, 64, 2, 4, 4)),
    (64, 96, 8192, None),  # long rows: block_config splits K
])
def test_fp8_gemm_equals_the_reference(m, n, k, config):
    q, a, weight, scale = operands(m, n, k, "cpu")
    if config is None:
        config = fg.block_config(m, n, k, q.device)
        assert fg.splits(k, config[2], config[3])[1] > 1 or k < 8192, "meant to split K"
    before = fg.triton_launches
    out = fg.fp8_gemm(q, a, weight, scale, torch.float32, config)
    split_k = fg.splits(k, config[2], config[3])[1]
    assert fg.triton_launches == before + (2 if split_k > 1 else 1)
    ref = fg.fp8_gemm_ref(q, a, weight, scale, torch.float32)  # (summed in another order)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


@needs_triton
def test_fp8_gemm_refuses_what_it_cannot_hold():
    q, a, weight, scale = operands(65, 64, 128, "cpu")
    with pytest.raises(ValueError, match="1 to 64 rows"):
        fg.fp8_gemm(q, a, weight, scale, torch.float32)
    q, a, weight, scale = operands(20, 64, 128, "cpu")
    with pytest.raises(ValueError, match="BLOCK_M 16 < 20 rows"):
        fg.fp8_gemm(q, a, weight, scale, torch.float32, (16, 64, 128, 1, 4, 4))
    with pytest.raises(ValueError, match="shapes"):
        fg.fp8_gemm(q, a, weight[:, :64], scale, torch.float32)


@needs_triton
@pytest.mark.parametrize("rows,runs_kernel", [(3, True), (64, True), (65, False)])
def test_fp8_linear_runs_few_rows_on_the_kernel(monkeypatch, rows, runs_kernel):
    """fp8_linear takes the kernel for up to 64 rows where _scaled_mm would run (FP8 tensor
    cores, here pretended on the CPU), and the same product comes out either way."""
    monkeypatch.setattr(fp8, "scaled_mm_supported", lambda device, dtype: True)
    monkeypatch.setattr(fp8, "fp8_linear_scaled_mm", lambda *args: fp8.fp8_linear_ref(*args))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g)
    weight, scale = fp8.quantize_weight(torch.randn(192, 256, generator=g))
    bias = torch.randn(192, generator=g)
    before = fg.triton_launches
    out = fp8.fp8_linear(x, weight, scale, None, bias)
    assert (fg.triton_launches > before) == runs_kernel
    torch.testing.assert_close(out, fp8.fp8_linear_ref(x, weight, scale, None, bias),
                               rtol=1e-4, atol=1e-4)


@needs_gpu
@pytest.mark.parametrize("device", ["cuda"])
@pytest.mark.parametrize("m", [1, 2, 16, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (200, 304)])
def test_fp8_gemm_gpu_equals_scaled_mm(device, m, n, k):
    q, a, weight, scale = operands(m, n, k, device)
    out = fg.fp8_gemm(q, a, weight, scale, torch.bfloat16)
    ref = fg.fp8_gemm_ref(q, a, weight, scale, torch.float32)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    if n % 16 == 0 and k % 16 == 0:
        cublas = torch._scaled_mm(q, weight.t(), scale_a=a, scale_b=scale.reshape(1, -1),
                                  out_dtype=torch.bfloat16)
        torch.testing.assert_close(out, cublas, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
