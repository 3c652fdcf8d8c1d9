"""GEMV: `x @ W.T (+ bias)` for one row of x, the shape of every linear layer at decode batch 1.

One row reads each weight once and does two FLOPs per weight element, so the layer is a read
of W at the memory rate or it is slow. cuBLAS picks GEMM tiles for it (with a split-K reduce
kernel after the narrow layers) that read Llama-3.1-8B's q/k/v and o weights at only 2.5-3.1
TB/s on an H200. Here a program owns BLOCK_N output channels and walks the whole K range in
BLOCK_K steps: no split-K, no second kernel, and BLOCK_N small enough that every SM has
programs in flight. From two rows up cuBLAS wins (its tiles share the weight read between
rows; this kernel's do not), so `linear` takes this path for one row only.

FP8 weights (float8_e4m3fn [N, K] with a float32 per-channel weight_scale [N]) run weight-only
(W8A16): the weight tile is widened to float32 in registers and multiplied by x as it is, and

    y[n] = acc[n] * weight_scale[n]      (rounded to x's dtype, then + bias)

x is not rounded to FP8 (which `pd_serve.model.fp8.fp8_linear` does on tensor cores for two
rows and more): at one row the layer is a read of the weight, and an activation scale would
cost a pass over x and a division per x element in every program.

Two ways to sum over K (ROWSUM, chosen with the block sizes by `_block_config`, a fixed choice
by shape and weight dtype from timings under CUDA graphs on an H200, no autotuning). The tile
form keeps the float32 products in a [BLOCK_N, BLOCK_K] tile, summed once at the end; the
row-sum form sums each step's products into [BLOCK_N] (a cross-thread sum a step, but fewer
registers, so more programs an SM) and issues a step's weight loads (gate and up with
silu_and_mul) before x's. FP8 layers take the row-sum form, faster on every Llama-3.1-8B layer;
bf16 layers the tile, as row-summing them gained nothing. The row-sum adds the same terms in
another order, so it may differ from the tile form in the last bit.

Before the PDL wait (kernels/_triton.py) a program loads its bias and FP8 scales and, with FP8
weights, its first weight tile (the up half's too with silu_and_mul): the kernel before writes
x, never these, so the reads overlap its tail instead of costing a trip to memory. bf16 weights
load after the wait: in their tile form an early tile costs registers and runs slower.

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
    (timed on an H200's Llama-3.1-8B and Qwen3-30B-A3B layers; see the module docstring). n
    counts the output rows a call reads: both halves with silu_and_mul."""
    if fp8:  # q/k/v; o, gate/up (its two halves) and down
        return (8, 1024, 4, 1, True) if k < n < 4 * k else (4, 2048, 4, 1, True)
    if k >= 8192:
        return (16, 1024, 8, 4, False)
    # A row a program below 4096 rows: Qwen3-30B-A3B's o (2048 x 4096) reads at 2.8 TB/s so
    # against 2.4 with two rows (half the programs; Llama-3.1-8B's layers are faster with two)
    return (2 if n >= 4096 else 1, 1024, 4, 2, False)


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
        # GLU's up rows (N + rn, in int64 from a tensor: N may come as the constant 1)
        up_rows = (rn.to(tl.int64) + N)[:, None] * K
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
