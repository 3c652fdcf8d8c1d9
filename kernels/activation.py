"""SiLU-and-mul, the gated activation of the Llama MLP, on the fused gate/up projection output.

    x = [gate | up]  [T, 2I]   ->   out = silu(gate) * up  [T, I]

The rounding is Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)`: silu is computed in float32
from the dtype gate and rounded to the dtype, then the product is a multiply in the dtype.
Program (t, j) handles columns [j * BLOCK, (j + 1) * BLOCK) of row t, so a 14336-wide row
is 14 programs of 1024 columns and even one token fills several SMs.

`silu_and_mul` runs the kernel on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1
(Triton's interpreter; how the tests exercise the kernel); otherwise `silu_and_mul_ref`.
Triton is imported lazily, so importing this module never imports it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import lazy_kernel

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK = 1024  # columns per program: 8 per thread at 4 warps (16-byte loads in 16 bits)
tl = None  # triton.language, bound when _kernel is first built


# ----------------------------------------------------------------------------- reference

def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of `silu_and_mul`: Hugging Face's arithmetic, op for op."""
    _check(x)
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate.float()).to(x.dtype) * up


# ----------------------------------------------------------------------------- dispatch

def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up].

    Parameters
    ----------
    x : [T, 2I], float32 / float16 / bfloat16; last dim contiguous, any row stride.

    Returns
    -------
    New contiguous [T, I] tensor in x's dtype.
    """
    _check(x)
    if not _kernel.runs_on(x):
        return silu_and_mul_ref(x)
    num_tokens, inner = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inner, dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        _launch(x, out)
    return out


# ----------------------------------------------------------------------------- Triton kernel

@lazy_kernel("CUDA SiLU-and-mul")
def _kernel(triton):
    """The jitted SiLU-and-mul kernel."""
    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, x_stride, inner, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inner
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + inner + cols, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # torch's silu formula
        # A float32 product of two dtype values is exact, so this rounds as a dtype multiply.
        out = (act.to(tl.float32) * up.to(tl.float32)).to(dtype)
        tl.store(out_ptr + row * inner + cols, out, mask=mask)

    return silu_and_mul_kernel


def _launch(x: torch.Tensor, out: torch.Tensor) -> None:
    """x [T, 2I] (last dim contiguous) -> out [T, I] contiguous."""
    global triton_launches
    kernel = _kernel.load()
    num_tokens, inner = out.shape
    block = min(_MAX_BLOCK, 1 << (inner - 1).bit_length())
    grid = (num_tokens, -(-inner // block))
    kernel[grid](x, out, x.stride(0), inner, BLOCK=block, num_warps=4)
    triton_launches += 1


# ----------------------------------------------------------------------------- validation

def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [T, 2I] float32/float16/bfloat16, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if x.stride(1) != 1 and x.numel() > 0:
        raise ValueError(f"x's last dim must be contiguous, got strides {x.stride()}")
