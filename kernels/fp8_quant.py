"""Per-token FP8 quantization of activations, in one kernel: what an FP8 linear layer feeds
`torch._scaled_mm` (pd_serve/model/fp8.py).

    dynamic:  s_t = max(max|x_t| / 448, 1e-12)       one scale per row (token)
    static:   s_t = input_scale                      the checkpoint's, for every row
    q_t      = float8_e4m3fn(clamp(x_t / s_t, -448, 448))

computed in float32 with an IEEE division (tl.math.div_rn), so the result is bit for bit the
torch reference's (`quantize_per_token_ref`). The reference takes about seven kernels a linear
layer (a float32 copy of x, the max, the scale, the divide, the clamp, the cast; counted from
the code, not timed); on Llama-3.1-8B's 128 linear layers that is ~900 launches per decode
step and, in prefill, several passes over float32 copies of the activations. Here a program owns one row: a first pass over it finds the max, a second
writes q (the row is read twice, the second time mostly from L2). It launches with
programmatic dependent launch (kernels/_triton.py) where the GPU has it.

`quantize_per_token` runs the kernel on CUDA tensors, or on CPU tensors when
PD_SERVE_TRITON_CPU=1 (Triton's interpreter; how the tests exercise it); otherwise the
reference. Triton is imported lazily, so importing this module never imports it.
"""

from __future__ import annotations

import torch

from kernels._triton import launch_options, lazy_kernel, pdl

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024  # columns per step of a program's loop over its row
tl = None  # triton.language, bound when _kernel is first built


def quantize_per_token_ref(x: torch.Tensor, input_scale: torch.Tensor | None = None):
    """Torch reference of `quantize_per_token` (float32 math)."""
    _check(x, input_scale)
    xf = x.float()
    if input_scale is None:
        amax = torch.linalg.vector_norm(xf, float("inf"), dim=-1, keepdim=True)  # [T, 1]
        # A tensor divisor: torch on CUDA divides by a Python scalar as a multiplication by
        # its reciprocal, which rounds differently from the kernel's (and CPU torch's) division.
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(xf.shape[0], 1).contiguous()
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None):
    """FP8 activations with per-token (or static) scales. No host syncs (CUDA-graph safe).

    Parameters
    ----------
    x : [T, K] float16/bfloat16/float32; last dim contiguous, any row stride.
    input_scale : float32 [1], a static scale for every row; None: each row's own (dynamic).

    Returns
    -------
    q float8_e4m3fn [T, K], contiguous; scale float32 [T, 1], contiguous (as _scaled_mm's
    row-wise scales must be).
    """
    _check(x, input_scale)
    if not _kernel.runs_on(x):
        return quantize_per_token_ref(x, input_scale)
    global triton_launches
    num_rows, k = x.shape
    q = torch.empty(num_rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows > 0:
        _kernel.load()[(num_rows,)](
            x, q, scale, input_scale if input_scale is not None else scale, k, x.stride(0),
            STATIC=input_scale is not None, BLOCK=min(_BLOCK, 1 << max(k - 1, 0).bit_length()),
            num_warps=4, **launch_options(pdl(x)))
        triton_launches += 1
    return q, scale


@lazy_kernel("FP8 activation quantization")
def _kernel(triton):
    """The jitted quantization kernel."""
    @triton.jit
    def fp8_quant_kernel(x_ptr, q_ptr, scale_ptr, in_scale_ptr, K, x_row_stride,
                         STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # (kernels/_triton.py) x is the kernel before's output: nothing to read early
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x_row = x_ptr + row * x_row_stride
        if STATIC:
            s = tl.load(in_scale_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                xs = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(xs))
            s = tl.reduce(amax, 0, tl.standard._elementwise_max)  # (see kernels/norm.py: tl.reduce)
            s = tl.maximum(tl.math.div_rn(s, tl.full((), 448.0, tl.float32)), 1e-12)
        tl.store(scale_ptr + row, s)
        for k0 in range(0, K, BLOCK):
            mask = k0 + cols < K
            xs = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            qs = tl.minimum(tl.maximum(tl.math.div_rn(xs, s + tl.zeros_like(xs)), -448.0), 448.0)
            tl.store(q_ptr + row * K + k0 + cols, qs.to(tl.float8e4nv), mask=mask)

    return fp8_quant_kernel


def _check(x: torch.Tensor, input_scale: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [T, K] float16/bfloat16/float32 with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    if input_scale is not None and (input_scale.dtype != torch.float32
                                    or input_scale.numel() != 1 or input_scale.device != x.device):
        raise ValueError(f"input_scale must be one float32 on {x.device}, got {input_scale.dtype} "
                         f"{tuple(input_scale.shape)} on {input_scale.device}")
