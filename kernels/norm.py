"""RMSNorm over the last dimension, optionally fused with the residual add before it.

    s   = x + residual                                     (in x's dtype; skipped without residual)
    out = weight * (s * rsqrt(mean(s ** 2) + eps))         (normalised in float32)

The rounding is Hugging Face's `LlamaRMSNorm` (after `hidden = residual + hidden`): the add is
rounded to x's dtype, the normalised row is rounded to x's dtype, and the product with the
weight is a multiply in x's dtype. One kernel serves the hidden states [T, hidden] and Qwen3's
per-head q/k norm on [T, heads, head_dim] views of the fused qkv output: a program normalises
whole rows held in registers (one 4096-wide row, or sixteen 128-wide ones), so x (and the
residual) are read once.

`rms_norm` runs the kernel on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1 (Triton's
interpreter; how the tests exercise the kernel); otherwise `rms_norm_ref`. Triton is imported
lazily, so importing this module never imports it.
"""

from __future__ import annotations

import torch

from kernels._triton import launch_options, lazy_kernel, pdl

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HIDDEN = 16384  # the whole row lives in registers: past this it would spill
_TILE = 2048  # elements per program when rows are shorter than this
tl = None  # triton.language, bound when _kernel is first built


# ----------------------------------------------------------------------------- reference

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """Torch reference of `rms_norm`: Hugging Face's arithmetic, op for op."""
    _check(x, weight, residual)
    if residual is not None:
        x = x + residual  # [..., H], rounded to x's dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight.to(x.dtype) * normed.to(x.dtype)
    return out if residual is None else (out, x)


# ----------------------------------------------------------------------------- dispatch

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm of the last dimension, with the residual add fused in front when given.

    Parameters
    ----------
    x : [..., H], float32 / float16 / bfloat16, H <= 16384. Any strides; rows are read in
        place when the leading dims fold into at most two strides (a [T, heads, head_dim] view
        of a fused qkv output does), else x is copied to a contiguous tensor first.
    weight : [H], any float dtype (rounded to x's dtype, as a weight stored in the model dtype
        already is), on x's device.
    eps : added to the mean square.
    residual : optional, x's shape, dtype and device.

    Returns
    -------
    out : new contiguous [..., H] tensor in x's dtype, without residual; with it, the pair
    (out, s) where s = x + residual is a new contiguous tensor (the next residual stream).
    """
    _check(x, weight, residual)
    if not _kernel.runs_on(x):
        return rms_norm_ref(x, weight, eps, residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(out) if residual is not None else None
    if out.numel() > 0:
        x, x_layout = _with_row_layout(x)
        if residual is not None:
            residual, res_layout = _with_row_layout(residual)
        else:
            residual, res_layout = x, x_layout  # not read
        _launch(x, x_layout, residual, res_layout, weight.contiguous(), out, s, eps)
    return out if s is None else (out, s)


def _with_row_layout(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`t` [..., H] and where its rows start: (inner, stride_a, stride_b) such that row r is at
    element (r // inner) * stride_a + (r % inner) * stride_b. The leading dims are folded into
    at most two strides (a [T, heads, head_dim] view of a fused qkv output folds into two);
    when they do not fold, or the last dim is strided, `t` is copied to a contiguous tensor."""
    groups = []  # [size, stride] of the folded leading dims, innermost first
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if groups and stride == groups[-1][0] * groups[-1][1]:
            groups[-1][0] *= size  # contiguous with the dims inside it
        else:
            groups.append([size, stride])
    if t.stride(-1) != 1 or len(groups) > 2:
        t = t.contiguous()
        return t, (1, t.shape[-1], 0)
    if len(groups) == 2:
        (inner, stride_b), (_, stride_a) = groups
        return t, (inner, stride_a, stride_b)
    return t, (1, groups[0][1] if groups else 0, 0)


# ----------------------------------------------------------------------------- Triton kernel

@lazy_kernel("CUDA RMSNorm")
def _kernel(triton):
    """The jitted norm kernel."""
    @triton.jit
    def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, num_rows, hidden, eps,
                        x_inner, x_stride_a, x_stride_b, res_inner, res_stride_a, res_stride_b,
                        BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        col_mask = cols < hidden
        dtype = out_ptr.dtype.element_ty
        # The weight before the PDL wait (kernels/_triton.py): no kernel writes it, and after
        # the wait it would be a load from memory behind the store of s and the row's sum.
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(dtype)
        if PDL:  # see kernels/_triton.py: the kernel before done, then let the next start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # A [BLOCK_ROWS, BLOCK] tile: whole rows. Inputs are found through their row layouts,
        # the outputs are contiguous.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [R]
        mask = (rows < num_rows)[:, None] & col_mask[None, :]
        x_starts = (rows // x_inner) * x_stride_a + (rows % x_inner) * x_stride_b
        x = tl.load(x_ptr + x_starts[:, None] + cols[None, :], mask=mask, other=0.0)
        out_offsets = rows[:, None] * hidden + cols[None, :]
        if HAS_RESIDUAL:
            res_starts = (rows // res_inner) * res_stride_a + (rows % res_inner) * res_stride_b
            res = tl.load(res_ptr + res_starts[:, None] + cols[None, :], mask=mask, other=0.0)
            # An exact float32 sum rounded once: the add rounded in x's dtype.
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
            tl.store(sum_ptr + out_offsets, x, mask=mask)
        xf = x.to(tl.float32)
        # tl.reduce with Triton's add combiner, not tl.sum: tl.sum is itself a @jit function,
        # which the interpreter cannot call when Triton was imported before TRITON_INTERPRET=1
        # and otherwise calls in a way that leaves triton.language patched for the rest of the
        # process (so a later GPU compile in that process fails).
        mean_square = tl.reduce(xf * xf, 1, tl.standard._sum_combine) / hidden  # [R]
        normed = (xf * tl.math.rsqrt(mean_square + eps)[:, None]).to(dtype)
        # A float32 product of two dtype values is exact, so this rounds as a dtype multiply.
        out = (normed.to(tl.float32) * w.to(tl.float32)[None, :]).to(dtype)
        tl.store(out_ptr + out_offsets, out, mask=mask)

    return rms_norm_kernel


def _launch(x: torch.Tensor, x_layout: tuple[int, int, int], residual: torch.Tensor,
            res_layout: tuple[int, int, int], weight: torch.Tensor, out: torch.Tensor,
            s: torch.Tensor | None, eps: float) -> None:
    """out, s contiguous; x, residual found through their row layouts (`_with_row_layout`)."""
    global triton_launches
    kernel = _kernel.load()
    hidden = out.shape[-1]
    num_rows = out.numel() // hidden
    block = 1 << (hidden - 1).bit_length()
    # Short rows (per-head norms) go several to a program, up to _TILE elements.
    block_rows = min(max(1, _TILE // block), 1 << (num_rows - 1).bit_length())
    num_warps = min(max(block_rows * block // 256, 1), 8)  # 8+ elements (16+ bytes) per thread
    kernel[(-(-num_rows // block_rows),)](
        x, residual, weight, out, s if s is not None else out, num_rows, hidden, eps, *x_layout,
        *res_layout, BLOCK_ROWS=block_rows, BLOCK=block, HAS_RESIDUAL=s is not None,
        num_warps=num_warps, **launch_options(pdl(out)))
    triton_launches += 1


# ----------------------------------------------------------------------------- validation

def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() == 0 or x.shape[-1] == 0 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [..., H] float32/float16/bfloat16, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if weight.shape != x.shape[-1:] or not weight.is_floating_point():
        raise ValueError(f"weight must be float [{x.shape[-1]}], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] > _MAX_HIDDEN:
        raise ValueError(f"rows of {x.shape[-1]} elements exceed the kernel's {_MAX_HIDDEN}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"residual is {residual.dtype} {tuple(residual.shape)} on "
                         f"{residual.device}; x is {x.dtype} {tuple(x.shape)} on {x.device}")
