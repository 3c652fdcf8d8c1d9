"""Per-channel FP8 GEMM for a few rows: the linear layers of a decode step at batch 2-64.

    q        float8_e4m3fn [M, K]   activations, token t scaled by a[t]   (a: float32 [M, 1])
    weight   float8_e4m3fn [N, K]   channel n scaled by s[n]              (s: float32 [N])
    y[t, n] = a[t] * s[n] * sum_k q[t, k] * weight[n, k]

the product `torch._scaled_mm` computes with row-wise scales (pd_serve/model/fp8.py). At a few
rows the layer is a read of the weight, and cuBLAS's FP8 tiles read it at about 2 TB/s on an
H200 at 64 rows (its bf16 GEMM at 3.5-4.3). Here a program owns BLOCK_N output channels and all
M rows in one tile (BLOCK_M >= M), so each weight byte is read once, and walks its share of K
on FP8 tensor cores with float32 accumulation; the scales apply once, after the sum. A layer
of long rows splits K over SPLIT_K programs as well, so that more SMs stream weights: each
writes its float32 partial sum [SPLIT_K, M, N] and a second launch adds them in split order and
rounds (deterministic, no atomics). On an H100 at Llama-3.1-8B's layers this takes 0.49-0.91x
_scaled_mm's time at 2-64 rows, and an FP8 decode step at batch 64 from 8.97 to 7.95 ms
(docs/performance.md).

Before the PDL wait (kernels/_triton.py) a program loads its channels' scales and first weight
tile: the kernel before (the activation quantization) writes q and a, never these.

`fp8_gemm` runs on CUDA tensors (or CPU ones under PD_SERVE_TRITON_CPU=1, Triton's interpreter,
where the FP8 dot is taken in float32: the tests); `fp8_gemm_ref` is the torch reference.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels._triton import launch_options, lazy_kernel, pdl

FP8_DTYPE = torch.float8_e4m3fn
MAX_ROWS = 64  # the rows one tile holds; more rows go to cuBLAS (whose tiles share weight reads)

triton_launches = 0  # the tests read it to confirm the Triton path ran
tl = None  # triton.language, bound when _kernel is first built


def fp8_gemm_ref(q: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                 weight_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Torch reference: the float32 product of the FP8 values, scaled, in out_dtype."""
    acc = q.float() @ weight.float().t()  # [M, N]
    scales = a_scale.float().reshape(-1, 1) * weight_scale.float().reshape(1, -1)
    return (acc * scales).to(out_dtype)


def fp8_gemm(q: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
             weight_scale: torch.Tensor, out_dtype: torch.dtype,
             config: tuple[int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton GEMM: q float8 [M, K] (M <= MAX_ROWS) with scales a_scale [M, 1] or [M],
    weight float8 [N, K] (contiguous) with scales weight_scale [N] -> [M, N] in out_dtype.

    config: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), BLOCK_M >= M (0:
    the power of two from 16 that holds M); None: `block_config`'s."""
    global triton_launches
    (m, k), n = q.shape, weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"fp8_gemm takes 1 to {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or weight_scale.numel() != n or a_scale.numel() != m:
        raise ValueError(f"fp8_gemm shapes: q {tuple(q.shape)}, a_scale {tuple(a_scale.shape)}, "
                         f"weight {tuple(weight.shape)}, weight_scale {tuple(weight_scale.shape)}")
    if q.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE or not weight.is_contiguous():
        raise ValueError("fp8_gemm takes float8_e4m3fn q and a contiguous float8_e4m3fn weight")
    kernels = _kernel.load()
    q = q if q.stride(-1) == 1 else q.contiguous()
    a_scale = a_scale.float().reshape(m).contiguous()
    weight_scale = weight_scale.float().reshape(n).contiguous()
    block_m, block_n, block_k, split_k, num_warps, num_stages = (
        config or block_config(m, n, k, q.device))
    block_m = block_m or max(16, _next_pow2(m))
    if block_m < m:
        raise ValueError(f"BLOCK_M {block_m} < {m} rows")
    k_per_split, split_k = splits(k, block_k, split_k)
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32,
                                                  device=q.device)
    gemm, reduce = kernels
    on_gpu = q.is_cuda
    # FP8 dots everywhere but in Triton's interpreter (which has none): a compile for the GPU
    # from CPU tensors (tests/kernels/test_compile_for_hopper.py) builds the GPU's kernel
    interpreted = not on_gpu and os.environ.get("TRITON_INTERPRET", "0") == "1"
    gemm[(-(-n // block_n), split_k)](
        q, a_scale, weight, weight_scale, partial, m, n, k, q.stride(0), k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        EVEN_N=n % block_n == 0, UPCAST=interpreted, num_warps=num_warps,
        num_stages=num_stages if on_gpu else 1, **launch_options(pdl(q)))
    triton_launches += 1
    if split_k > 1:
        block = 1024
        reduce[(-(-(m * n) // block),)](partial, out, m * n, SPLIT_K=split_k, BLOCK=block,
                                       num_warps=4, **launch_options(pdl(q)))
        triton_launches += 1
    return out


def splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(K per split, a whole number of K blocks; how many splits that makes, none empty)."""
    k_per_split = -(-(-(-k // split_k)) // block_k) * block_k
    return k_per_split, -(-k // k_per_split)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def block_config(m: int, n: int, k: int,
                 device: torch.device) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for an [m, k] x [n, k]
    product: one 64-row tile (Hopper's FP8 tensor-core instruction takes 64 rows; at 2 and 16
    rows it is as fast as a 16-row tile or faster), K in steps of 256, the widest of 128 / 64 /
    32 channels a program that still gives two thirds of the SMs a program, and K split in
    two from 8192 up. Chosen from `python bench/fp8_gemm.py --sweep` on an H100 at
    Llama-3.1-8B's layers (bench/results/fp8-gemm-sweep-h100.json): within 2 % of the best
    configuration of each layer at 2, 16 and 64 rows."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132  # (CPU: an H100's)
    block_n = next((bn for bn in (128, 64) if -(-n // bn) >= sms * 2 // 3), 32)
    return 64, block_n, 256, 2 if k >= 8192 else 1, 4, 4


@lazy_kernel("the FP8 GEMM for few rows")
def _kernel(triton):
    """(the GEMM kernel, the split-K reduce kernel)."""
    @triton.jit
    def fp8_gemm_kernel(q_ptr, a_ptr, w_ptr, s_ptr, out_ptr, M, N, K, q_stride, K_PER_SPLIT,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, UPCAST: tl.constexpr,
                        PDL: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        col_ok, row_ok = cols < N, rows < M
        ks = tl.arange(0, BLOCK_K)
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(K, k_start + K_PER_SPLIT)
        w_offs = cols.to(tl.int64)[None, :] * K + ks[:, None]  # [BK, BN]: W.T's tile
        q_offs = rows[:, None] * q_stride + ks[None, :]  # [BM, BK]
        # The channels' scales and the first weight tile before the PDL wait (docstring)
        w_scale = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
        if EVEN_K and EVEN_N:
            w = tl.load(w_ptr + w_offs + k_start)
        else:
            w = tl.load(w_ptr + w_offs + k_start,
                        mask=col_ok[None, :] & (k_start + ks < k_end)[:, None], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if EVEN_K:
            a = tl.load(q_ptr + q_offs + k_start, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(q_ptr + q_offs + k_start,
                        mask=row_ok[:, None] & (k_start + ks < k_end)[None, :], other=0.0)
        if UPCAST:  # the interpreter has no FP8 dot
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            acc = tl.dot(a, w)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            if EVEN_K and EVEN_N:
                w = tl.load(w_ptr + w_offs + k0)
            else:
                w = tl.load(w_ptr + w_offs + k0, mask=col_ok[None, :] & (k0 + ks < k_end)[:, None],
                            other=0.0)
            if EVEN_K:
                a = tl.load(q_ptr + q_offs + k0, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(q_ptr + q_offs + k0, mask=row_ok[:, None] & (k0 + ks < k_end)[None, :],
                            other=0.0)
            if UPCAST:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:
                acc += tl.dot(a, w)
        a_scale = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
        y = acc * a_scale[:, None] * w_scale[None, :]
        out = out_ptr + pid_k * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def split_k_reduce_kernel(partial_ptr, out_ptr, NUMEL, SPLIT_K: tl.constexpr,
                              BLOCK: tl.constexpr, PDL: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < NUMEL
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        total = tl.load(partial_ptr + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(partial_ptr + s * NUMEL + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)

    return fp8_gemm_kernel, split_k_reduce_kernel
