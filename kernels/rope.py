"""Rotary position embedding of q and k: the arithmetic, its torch reference and the checks.

Rotate-half layout (Hugging Face Llama/Qwen): with the cos/sin tables [max_pos, D] built as
`cat(freqs, freqs).cos()` / `.sin()` and x1, x2 the halves of a head,

    x = x * cos[pos] + rotate_half(x) * sin[pos],   rotate_half(x) = cat(-x2, x1)
    i.e.  x1' = x1 * cos1 - x2 * sin1,   x2' = x2 * cos2 + x1 * sin2

computed in float32 and rounded once to x's dtype. q and k are usually views into the fused
qkv projection output, so token and head strides are arbitrary.

The rotation runs inside kernels/kv_store.py's `rope_store_kv` (the attention backends rotate q
and k as they store K and V); this module holds its torch reference and the argument checks.
"""

from __future__ import annotations

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- reference

def apply_rope_ref_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> None:
    """RoPE on q and k in place: float32 math, one rounding, copied back."""
    check(positions, q, k, cos, sin)
    rotate_ref_(q, k, *rope_rows(positions, cos, sin))


def rope_rows(positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' rows of the tokens' positions, [T, 1, D] each (float32): what
    `rotate_ref_` takes, so every layer of one forward can share them."""
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def rotate_ref_(q: torch.Tensor, k: torch.Tensor, cos_t: torch.Tensor,
                sin_t: torch.Tensor) -> None:
    """`apply_rope_ref_` given the position's rows of the tables (`rope_rows`)."""
    half = q.shape[-1] // 2
    for x in (q, k):
        xf = x.float()  # [T, H, D]
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        x.copy_(xf * cos_t + rotated * sin_t)


# ----------------------------------------------------------------------------- validation

def check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """ValueError unless the arguments are what `apply_rope_ref_` (and rope_store_kv) take."""
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
