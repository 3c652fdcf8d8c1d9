"""Pending token ids: the overlap schedule plans step N+1 before step N's tokens reach the host,
so a planned id may still be pending. It is written as -1 - row, row being the token's index
in the sampled tokens of the step in flight, and resolved on the device:

    ids[t] = ids[t] if ids[t] >= 0 else prev_tokens[-1 - ids[t]]

`fill_pending_` does it in place in one Triton launch on CUDA (inside the decode CUDA graph,
which reads prev_tokens from a fixed buffer), or on CPU tensors when PD_SERVE_TRITON_CPU=1;
otherwise `fill_pending_ref_`.
"""

from __future__ import annotations

import torch

from kernels._triton import lazy_kernel

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_BLOCK = 256  # ids per program
tl = None  # triton.language, bound when _kernel is first built


def fill_pending_ref_(ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Torch reference of `fill_pending_`."""
    _check(ids, prev_tokens)
    rows = (-1 - ids).clamp_min(0).long()
    return ids.copy_(torch.where(ids >= 0, ids, prev_tokens[rows].to(ids.dtype)))


def fill_pending_(ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Resolve the pending ids of `ids` from `prev_tokens`, in place; returns ids.

    Parameters
    ----------
    ids : [T] int32 or int64, contiguous; -1 - row for a pending id, row < len(prev_tokens).
    prev_tokens : [R] int32 or int64, contiguous, on ids' device.
    """
    _check(ids, prev_tokens)
    if not _kernel.runs_on(ids):
        return fill_pending_ref_(ids, prev_tokens)
    global triton_launches
    if ids.numel():
        _kernel.load()[(-(-ids.numel() // _BLOCK),)](ids, prev_tokens, ids.numel(), BLOCK=_BLOCK)
        triton_launches += 1
    return ids


@lazy_kernel("resolving pending token ids on CUDA")
def _kernel(triton):
    @triton.jit
    def fill_pending_kernel(ids_ptr, prev_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        ids = tl.load(ids_ptr + offs, mask=mask, other=0)
        pending = mask & (ids < 0)
        prev = tl.load(prev_ptr + (-1 - ids), mask=pending, other=0)
        tl.store(ids_ptr + offs, prev.to(ids.dtype), mask=pending)

    return fill_pending_kernel


def _check(ids: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    for name, t in (("ids", ids), ("prev_tokens", prev_tokens)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [N] int32/int64 tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if ids.device != prev_tokens.device:
        raise ValueError(f"ids on {ids.device} but prev_tokens on {prev_tokens.device}")
