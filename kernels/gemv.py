"""GEMV: `x @ W.T (+ bias)` for one row of x, the shape of every linear layer at decode batch 1.

One row reads each weight once and does two FLOPs per weight element, so the layer is a read
of W at the memory rate or it is slow. cuBLAS picks GEMM tiles for it (128 x 8 outputs, with a
split-K reduce kernel after the narrow layers) that read Llama-3.1-8B's q/k/v and o weights at
only 3.1 and 2.5 TB/s on an H200. Here a program owns BLOCK_N output channels and walks the
whole K range in BLOCK_K steps, loading a [BLOCK_N, BLOCK_K] weight tile per step and keeping
float32 products in a tile of the same shape, summed over K once at the end: no split-K, no
second kernel, and BLOCK_N small enough that every SM has programs in flight.

FP8 weights (float8_e4m3fn [N, K] with a float32 per-channel weight_scale [N]) run weight-only
(W8A16): the weight tile is widened to float32 in registers and multiplied by x as it is, and

    y[n] = acc[n] * weight_scale[n]      (rounded to x's dtype, then + bias)

x is not rounded to FP8 (which `pd_serve.model.fp8.fp8_linear` does on tensor cores for two
rows and more): at one row the layer is a read of the weight, and an activation scale would
cost a pass over x and a division per x element in every program. Until 2026-11-30 this kernel
did round x (dynamic per-token or static scale, the tensor-core path's arithmetic) and read FP8
weight at only 2.0-3.0 TB/s (`torch._scaled_mm` / here, us: q/k/v 30.8 / 12.3, o 26.5 / 8.2,
gate/up 58.7 / 40.9, down 57.2 / 21.0).

Block sizes are a fixed choice by shape (no autotuning), from timings under CUDA graphs over 32
distinct copies of each Llama-3.1-8B layer on an H200 (bf16, us per call, cuBLAS / here):
q/k/v 16.3 / 13.9, o 13.5 / 10.7, gate/up 55.1 / 54.4, down 31.6 / 28.7, LM head 243 / 235.
FP8 (weight-only) tile configurations came from a sweep of 48 (bench/probes/fp8_gemv_variants.py,
bench/results/probe-fp8-gemv-variants-h200-3852923.json, us, the choice / the sweep's best):
q/k/v 11.0 / 10.5, o 7.0 / 7.0, gate/up 36.8 / 36.3, down 19.2 / 19.2, which is 2.3-3.2 TB/s
of FP8 weight (bf16 here: 3.3-4.4 TB/s); the decode step at batch 1 went from 3.40 to 3.10 ms.
No faster over the four layers: a tensor-core form (the FP8 tile widened to float16 or
bfloat16, x in row 0 of a 16-row tl.dot: 12.0 / 9.6 / 34.3 / 26.1 us in float16, faster on
gate/up alone), loading the next tile ahead, evict-first loads, num_stages (Triton pipelines
only loads that feed a tl.dot), and widening e4m3 to float32 by bit moves instead of the two
conversions (bench/probes/fp8_gemv_bits.py, ...-bits-h200-4d49ef6.json: best 10.4 / 7.6 / 35.2 /
21.1 us against this kernel's 11.1 / 7.1 / 36.8 / 19.3 in the same run: the conversions are not
what bounds it). A form that builds the
tile's [BLOCK_N, BLOCK_K] pointers once and moves them along K was 6-8 % faster alone
(bench/probes/fp8_gemv_prefetch.py, ...-prefetch-h200-117d036.json: 9.1 / 6.7 / 32.6 / 17.2 us
with (16, 512) tiles) but slower in the model: batch-1 steps of 3.33 ms in FP8 against 3.10,
and 4.50 ms in bf16 against 4.25 at 3ade399 (bench/results/one-batch-h200-llama3-8b{,-fp8}-
batch1-kernels-7cb46b5.json). Likely cause, not checked: registers, as the GLU form keeps two
such pointer tiles live and bf16's (16, 1024) tile alone is 64 int64 pointers a thread. Not
kept. Nor RMSNorm inside the GEMVs (bench/results/ab-norm-fusion-83dd870/, one run, batch 1,
ms a step FP8 / bf16, norms as kernels of their own 3.09 / 4.29): the residual add in the
GEMV before and the norm in the one after, its mean square from per-program partial sums the
first wrote, 3.27 / 4.58; each program summing the row's squares in its own K loop and
scaling at the end (no norm launch left in a layer), 3.12 / 4.63. Likely cause, not checked:
the extra loads and arithmetic in every program of qkv and gate/up cost more than sixty-four
launches fewer save. The FP8 gate/up with the activation in its epilogue (tiled, block_n
halved) was 3.13 against 3.09 for the GEMV and the silu_and_mul kernel; in the row-sum form
(below) it gains: at aaffda0 the FP8 model fuses it, ~0.02 ms a step
(bench/results/ab-argmax-glu-aaffda0/). From two rows up
cuBLAS wins (its tiles share the weight read between rows; this kernel's do not), so `linear`
takes this path for one row only.

With FP8 weights a program loads its first weight tile (and the up half's with silu_and_mul)
before the PDL wait (kernels/_triton.py): the kernel before writes x, never the weights, so
that read overlaps its tail. Batch-1 decode step, Llama-3.1-8B shape, one H200, A/B against
f6dabf1 on one machine start: FP8 3.01 against 3.085 ms (bench/results/ab-fp8-prewait/). For
bf16 weights it was 1 % slower (4.29 against 4.24 ms; 56 registers a thread against 48 in the
gate/up form, `bench/probes/gemv_registers.py` at 8fe3e0d), so they load after the wait, as
before. (Those FP8 programs, tiled, held 168 registers a thread: 3 programs an SM, in Triton
3.9's code.) The FP8 scales (and a bias, in any dtype) load before the wait too: read in the
epilogue, after the K loop, they were a trip to memory at the end of every call. FP8 batch-1
step 2.48 against 2.56 ms with RMSNorm's and RoPE's reads moved as well, 2.63 with neither
(bench/results/ab-prewait-reads-e356090/).

Two ways to sum over K (ROWSUM, chosen by _block_config). The tile form keeps the float32
products in a [BLOCK_N, BLOCK_K] tile, summed once at the end; the row-sum form sums each
step's products into [BLOCK_N] (a cross-thread sum a step, but registers for more programs an
SM: 125-128 a thread at the FP8 choices, 4 programs an SM, in Triton 3.9's code); it issues a
step's weight loads (gate and up with silu_and_mul) before x's, at the row starts plus k0.
FP8 layers take the row-sum form, bf16 ones the tile. bench/probes/gemv_forms.py times both
forms in this kernel over 22 configurations, medians of three rounds, FP8, us, row-sum / best
tile (bench/results/probe-gemv-forms-h200-3969c77.json): q/k/v 8.46 / 9.69, o 5.99 / 6.45,
gate/up (with silu_and_mul) 30.65 / 34.41, down 16.21 / 17.96. As first written (x loaded
first, weight pointers at the row starts plus kk, the up half loaded after the gate's sum)
the row-sum form ran o / gate/up / down at 6.77 / 32.50 / 19.87 us at (4, 2048, 4 warps)
(probe-gemv-forms-h200-bb0c64c.json); bench/probes/gemv_rowsum_prefetch.py's own kernel,
ordered as above, at 6.11 / 31.03 / 16.39 on another machine start
(...-rowsum-prefetch-h200-49c3da2.json). Which of those differences matters was not
separated. Loading the next weight tile ahead as well was slower on every layer there.
Batch-1 decode step, Llama-3.1-8B shape, one H200, alternating on one machine start
(bench/results/ab-gemv-rowsum-3969c77/): FP8 2.746 / 2.744 ms (1.26x the floor) against
3.042 / 3.041 all tiled (3b2e4e1) and 2.856 / 2.856 with only q/k/v and gate/up row-summed as
first written (e0d1d24); bf16 4.255 against 4.260. bf16's layers were no faster row-summed
(probe-gemv-forms-h200-bb0c64c.json: q/k/v 15.2 against 13.5 us tiled; down 32.4 against
33.3, a step 4.247 against 4.279 ms in one sample, bench/results/ab-gemv-rowsum-e0d1d24/,
inside the 2 % runs differ by). Sums are the tile form's terms in another order, so a
row-sum layer may differ from the tile form in the last bit.

`linear_silu_and_mul` (and `gemv(..., silu_and_mul=True)`, which the FP8 MLP calls through
pd_serve/model/fp8.py) is the Llama MLP's fused gate/up projection with its activation in the
GEMV's epilogue: a program takes BLOCK_N channels of the gate half and the same channels of the
up half, rounds both to x's dtype (what the separate GEMV would store) and writes
`silu(gate) * up` with kernels/activation.py's arithmetic, so it is bit for bit that GEMV
followed by `silu_and_mul`, with one launch fewer and no [1, 2I] intermediate.

The model's layers call it only under --enable-batch1-kernels (pd_serve/model/llama.py's
use_batch1_kernels): a row computed here rounds differently from the same row in a cuBLAS
GEMM, so with it a request's greedy output can depend on whether it decoded alone.

`linear` runs the kernel for one-row CUDA inputs (or CPU ones when PD_SERVE_TRITON_CPU=1,
Triton's interpreter, how the tests exercise it) and `F.linear` otherwise. Triton is imported
lazily, so importing this module never imports it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import launch_options, lazy_kernel, pdl
from kernels import activation

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
tl = None  # triton.language, bound when _kernel is first built


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; one-row inputs [1, K] on the GPU run the GEMV kernel.

    Parameters
    ----------
    x : [T, K] (or [K]) float16/bfloat16/float32.
    weight : [N, K] in x's dtype.
    bias : [N] in x's dtype, or None.

    Returns
    -------
    [T, N] (or [N]) in x's dtype.
    """
    if (x.dim() == 2 and x.shape[0] == 1 and weight.dtype == x.dtype and x.dtype in _DTYPES
            and _kernel.runs_on(x)):
        return gemv(x, weight, bias=bias)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(F.linear(x, weight))` for a fused [gate | up] weight [2I, K]; one-row
    inputs [1, K] on the GPU run the GEMV with the activation in its epilogue.

    Returns
    -------
    [T, I] in x's dtype.
    """
    if (x.dim() == 2 and x.shape[0] == 1 and weight.dtype == x.dtype and x.dtype in _DTYPES
            and _kernel.runs_on(x)):
        return gemv(x, weight, silu_and_mul=True)
    return activation.silu_and_mul(F.linear(x, weight))


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """One row through a linear layer, on the Triton kernel.

    Parameters
    ----------
    x : [1, K] float16/bfloat16/float32 (any strides).
    weight : [N, K], contiguous: x's dtype, or float8_e4m3fn with weight_scale.
    weight_scale : float32 [N] for an FP8 weight (W[n] = weight[n] * weight_scale[n]); else None.
    bias : [N] in x's dtype, or None.
    silu_and_mul : weight is [gate | up] (N = 2I): return silu(gate) * up, [1, I] (no bias).

    Returns
    -------
    [1, N] (or [1, N / 2] with silu_and_mul), new and contiguous, in x's dtype.
    """
    _check(x, weight, weight_scale, bias, silu_and_mul)
    global triton_launches
    kernel = _kernel.load()
    x = x.contiguous()
    n, k = weight.shape
    if silu_and_mul:
        n //= 2
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    fp8 = weight_scale is not None
    block_n, block_k, num_warps, num_stages, rowsum = _block_config(weight.shape[0], k, fp8)
    if silu_and_mul:  # the same weight rows a program: half of them gate, half up
        block_n = max(1, block_n // 2)
    kernel[(-(-n // block_n),)](
        x, weight, out, weight_scale if fp8 else weight, bias if bias is not None else x, n, k,
        FP8=fp8, HAS_BIAS=bias is not None, GLU=silu_and_mul, ROWSUM=rowsum, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages, **launch_options(pdl(x)))
    triton_launches += 1
    return out


def _block_config(n: int, k: int, fp8: bool) -> tuple[int, int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, ROWSUM) by the layer's shape and weight dtype
    (see the module docstring for the timings behind them). n counts the output rows a call
    reads: both halves with silu_and_mul."""
    if fp8:  # q/k/v; o, gate/up (its two halves) and down
        return (8, 1024, 4, 1, True) if k < n < 4 * k else (4, 2048, 4, 1, True)
    return (16, 1024, 8, 4, False) if k >= 8192 else (2, 1024, 4, 2, False)


@lazy_kernel("the GEMV")
def _kernel(triton):
    """The jitted GEMV kernel."""
    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, out_ptr, w_scale_ptr, bias_ptr, N, K, FP8: tl.constexpr,
                    HAS_BIAS: tl.constexpr, GLU: tl.constexpr, ROWSUM: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # N: output channels (with GLU, the gate rows; the up rows are N further down).
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output channels
        rk = tl.arange(0, BLOCK_K)
        n_mask = rn < N
        rows = rn.to(tl.int64)[:, None] * K  # [BN, 1] weight row starts
        up_rows = rows + N.to(tl.int64) * K  # GLU's up rows
        # ROWSUM: sum the products over K every step into [BN] (few registers, a cross-thread
        # sum a step); else keep them in a [BN, BK] tile summed once at the end
        if ROWSUM:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)  # GLU only
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # The epilogue's per-channel scales and bias before the PDL wait, as the first tile
        # below: no kernel writes them, and loaded after the K loop they cost a trip to memory.
        if FP8:
            scale = tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)
            if GLU:
                scale_up = tl.load(w_scale_ptr + N + rn, mask=n_mask, other=0.0)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rn, mask=n_mask, other=0.0)
        if FP8:  # the first weight tile(s) before the PDL wait (module docstring)
            first_mask = n_mask[:, None] & (rk < K)[None, :]
            w = tl.load(w_ptr + rows + rk[None, :], mask=first_mask, other=0.0)
            w_up = w
            if GLU:
                w_up = tl.load(w_ptr + up_rows + rk[None, :], mask=first_mask, other=0.0)
        if PDL:  # see kernels/_triton.py: the kernel before done, then let the next start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if FP8:  # the first tile's products start the sums
            xs = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            acc = w.to(tl.float32) * xs[None, :]
            if GLU:
                acc_up = w_up.to(tl.float32) * xs[None, :]
            if ROWSUM:
                # tl.reduce with the add combiner, not tl.sum (kernels/norm.py: the interpreter)
                acc = tl.reduce(acc, 1, tl.standard._sum_combine)
                if GLU:
                    acc_up = tl.reduce(acc_up, 1, tl.standard._sum_combine)
        for k0 in range(BLOCK_K if FP8 else 0, K, BLOCK_K):
            kk = k0 + rk
            k_mask = kk < K
            if ROWSUM:  # weight loads (gate and up) go out before x's, as timed (module docstring)
                w_mask = n_mask[:, None] & k_mask[None, :]
                w = tl.load(w_ptr + rows + rk[None, :] + k0, mask=w_mask, other=0.0)
                w_up = w
                if GLU:
                    w_up = tl.load(w_ptr + up_rows + rk[None, :] + k0, mask=w_mask, other=0.0)
                xs = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
                acc += tl.reduce(w.to(tl.float32) * xs[None, :], 1, tl.standard._sum_combine)
                if GLU:
                    acc_up += tl.reduce(w_up.to(tl.float32) * xs[None, :], 1,
                                        tl.standard._sum_combine)
            else:
                xs = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                            other=0.0)
                acc += w.to(tl.float32) * xs[None, :]
                if GLU:
                    w = tl.load(w_ptr + up_rows + kk[None, :],
                                mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                    acc_up += w.to(tl.float32) * xs[None, :]
        y = acc  # [BN]
        up = acc_up
        if not ROWSUM:
            y = tl.reduce(acc, 1, tl.standard._sum_combine)
            if GLU:
                up = tl.reduce(acc_up, 1, tl.standard._sum_combine)
        if FP8:
            y = y * scale
        y = y.to(out_ptr.dtype.element_ty)
        if GLU:  # silu(gate) * up as kernels/activation.py rounds it, from the rounded halves
            if FP8:
                up = up * scale_up
            up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
            gate = y.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
            y = (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty)
        if HAS_BIAS:
            y = (y + bias).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rn, y, mask=n_mask)

    return gemv_kernel


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
           bias: torch.Tensor | None, silu_and_mul: bool = False) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [1, K] float16/bfloat16/float32, got {x.dtype} "
                         f"{tuple(x.shape)}")
    k = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [N, {k}], got {tuple(weight.shape)}")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (weight_scale is not None):
        raise ValueError(f"a {weight.dtype} weight {'needs' if fp8 else 'takes no'} weight_scale")
    if not fp8 and weight.dtype != x.dtype:
        raise ValueError(f"weight is {weight.dtype}, x {x.dtype}")
    n = weight.shape[0]
    if silu_and_mul and (n % 2 or bias is not None):
        raise ValueError(f"silu_and_mul needs a [gate | up] weight of an even N and no bias, got "
                         f"N = {n}{' and a bias' if bias is not None else ''}")
    if weight_scale is not None and (weight_scale.dtype != torch.float32
                                     or tuple(weight_scale.shape) != (n,)):
        raise ValueError(f"weight_scale must be float32 [{n}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be {x.dtype} [{n}], got {bias.dtype} {tuple(bias.shape)}")
    for t in (weight, weight_scale, bias):
        if t is not None and t.device != x.device:
            raise ValueError(f"all tensors must be on {x.device}; one is on {t.device}")
