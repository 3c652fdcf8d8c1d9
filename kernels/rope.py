"""Rotary position embedding applied in place to q and k, in one launch for both.

Rotate-half layout (Hugging Face Llama/Qwen): with the cos/sin tables [max_pos, D] built as
`cat(freqs, freqs).cos()` / `.sin()` and x1, x2 the halves of a head,

    x = x * cos[pos] + rotate_half(x) * sin[pos],   rotate_half(x) = cat(-x2, x1)
    i.e.  x1' = x1 * cos1 - x2 * sin1,   x2' = x2 * cos2 + x1 * sin2

computed in float32 and rounded once to x's dtype. q and k are usually views into the fused
qkv projection output, so token and head strides are arbitrary. The grid is tokens x head
blocks: blocks [0, q_blocks) take q's heads, the rest k's, each BLOCK_H heads at a time, so
a block loads its token's cos/sin row once for several heads.

`apply_rope_` runs the kernel on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1
(Triton's interpreter; how the tests exercise the kernel); otherwise `apply_rope_ref_`. Triton
is imported lazily, so importing this module never imports it.
"""

from __future__ import annotations

import torch

from kernels._triton import lazy_kernel

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_ELEMENTS = 1024  # elements of q or k per program (heads x head_dim)
tl = None  # triton.language, bound when _kernel is first built


# ----------------------------------------------------------------------------- reference

def apply_rope_ref_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> None:
    """Torch reference of `apply_rope_`: float32 math, one rounding, copied back in place."""
    _check(positions, q, k, cos, sin)
    cos_t = cos[positions].unsqueeze(1)  # [T, 1, D] float32
    sin_t = sin[positions].unsqueeze(1)
    half = q.shape[-1] // 2
    for x in (q, k):
        xf = x.float()  # [T, H, D]
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        x.copy_(xf * cos_t + rotated * sin_t)


# ----------------------------------------------------------------------------- dispatch

def apply_rope_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
    """Rotate q and k in place by the angles of their tokens' positions.

    Parameters
    ----------
    positions : [T] int64 or int32, on q's device; each in [0, max_pos) (checked on CPU only).
    q : [T, Hq, D] float32 / float16 / bfloat16, D even; last dim contiguous, token and head
        strides arbitrary (views into a fused qkv output are fine).
    k : [T, Hk, D], q's dtype and device; strides as q's.
    cos, sin : [max_pos, D] float32 tables in the rotate-half layout, last dim contiguous.
    """
    _check(positions, q, k, cos, sin)
    if not _kernel.runs_on(q):
        apply_rope_ref_(positions, q, k, cos, sin)
        return
    if q.shape[0] > 0:
        _launch(positions, q, k, cos, sin)


# ----------------------------------------------------------------------------- Triton kernel

@lazy_kernel("CUDA RoPE")
def _kernel(triton):
    """The jitted RoPE kernel."""
    @triton.jit
    def rope_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_token_stride, q_head_stride,
                    k_token_stride, k_head_stride, table_stride, num_q_heads, num_k_heads,
                    q_blocks, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        is_q = block < q_blocks
        # Select q or k without branching (one code path, one set of types).
        base = tl.where(is_q, q_ptr + token * q_token_stride, k_ptr + token * k_token_stride)
        head_stride = tl.where(is_q, q_head_stride, k_head_stride)
        num_heads = tl.where(is_q, num_q_heads, num_k_heads)
        heads = tl.where(is_q, block, block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)  # within one half
        dim_mask = dims < HALF
        mask = (heads < num_heads)[:, None] & dim_mask[None, :]  # [BLOCK_H, BLOCK_D]

        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos1 = tl.load(cos_ptr + pos * table_stride + dims, mask=dim_mask, other=0.0)[None, :]
        cos2 = tl.load(cos_ptr + pos * table_stride + HALF + dims, mask=dim_mask,
                       other=0.0)[None, :]
        sin1 = tl.load(sin_ptr + pos * table_stride + dims, mask=dim_mask, other=0.0)[None, :]
        sin2 = tl.load(sin_ptr + pos * table_stride + HALF + dims, mask=dim_mask,
                       other=0.0)[None, :]

        first = base + heads[:, None].to(tl.int64) * head_stride + dims[None, :]
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + HALF, mask=mask, other=0.0)
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        tl.store(first, (x1 * cos1 - x2 * sin1).to(dtype), mask=mask)
        tl.store(first + HALF, (x2 * cos2 + x1 * sin2).to(dtype), mask=mask)

    return rope_kernel


def _launch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    global triton_launches
    kernel = _kernel.load()
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half = head_dim // 2
    block_d = 1 << (half - 1).bit_length()
    most_heads = max(num_q_heads, num_k_heads)
    block_h = min(1 << (most_heads - 1).bit_length(), max(1, _BLOCK_ELEMENTS // (2 * block_d)))
    q_blocks = -(-num_q_heads // block_h)
    grid = (num_tokens, q_blocks + -(-num_k_heads // block_h))
    kernel[grid](positions, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                 cos.stride(0), num_q_heads, num_k_heads, q_blocks, HALF=half, BLOCK_H=block_h,
                 BLOCK_D=block_d, num_warps=4)
    triton_launches += 1


# ----------------------------------------------------------------------------- validation

def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.dtype not in _DTYPES:
        raise ValueError(f"q, k must be [T, H, D] float32/float16/bfloat16, got {q.dtype} "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2 or head_dim == 0:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} need the same T and an "
                         f"even D")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"q is {q.dtype} on {q.device}, k is {k.dtype} on {k.device}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q's and k's last dims must be contiguous, got strides {q.stride()} "
                         f"and {k.stride()}")
    for name, table in (("cos", cos), ("sin", sin)):
        if (table.dim() != 2 or table.shape[1] != head_dim or table.dtype != torch.float32
                or table.stride(1) != 1 or table.device != q.device):
            raise ValueError(f"{name} must be float32 [max_pos, {head_dim}] on {q.device}, "
                             f"got {table.dtype} {tuple(table.shape)} on {table.device}")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError("cos and sin must have the same shape and strides")
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be [{num_tokens}] int64/int32, got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if positions.device != q.device:
        raise ValueError(f"positions are on {positions.device}, q on {q.device}")
    if not positions.is_cuda and positions.numel() > 0 and (
            positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]})")
