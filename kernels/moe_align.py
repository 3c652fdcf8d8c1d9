"""The (token, expert) pairs of a routing sorted by expert, each expert's run padded to the
block size: the fused MoE's row order (SGLang's and vLLM's moe_align_block_size).

    topk_ids [T, K] -> sorted_ids int32 [S]   pair ids p = t * K + k in expert order (stable, so
                                              an expert's pairs keep token order); padding
                                              rows hold T*K
                       block_experts int32 [S / block_m]  each block's expert (blocks past the
                                              used rows hold the last expert)
                       num_padded int32 [1]   rows used
S = T*K + min(E, T*K) * (block_m - 1), rounded up to block_m: the most any routing can use.
Ids are taken less `expert_offset` (an expert-parallel rank's first expert; subtracted in
the kernel, not by a launch of its own); ids then outside [0, E) (another rank's experts) are
left out.

`moe_align_ref` does it in about fifteen torch ops; at decode sizes their launches cost more
than the experts' GEMMs (~56 us a layer on an H200 in a CUDA graph), so up to MAX_PAIRS pairs
one Triton program does all of it: counts and each pair's rank among its expert's by
comparing pair ids in tiles (P^2 / tile work, cheap while P is small), the padded offsets by a
cumulative sum. Neither syncs with the host, so CUDA graphs capture both.
"""

from __future__ import annotations

import torch

from kernels._triton import lazy_kernel

MAX_PAIRS = 1024  # larger routings (prefill) take the torch ops: there they cost little
tl = None  # triton.language, bound when _kernel is first built


def output_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """S: rows for the worst routing of num_pairs pairs over num_experts experts."""
    return -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_experts, num_padded) as the module docstring says."""
    num_pairs = topk_ids.numel()
    if num_pairs > MAX_PAIRS or not _kernel.runs_on(topk_ids):
        return moe_align_ref(topk_ids, num_experts, block_m, expert_offset)
    kernel = _kernel.load()
    device = topk_ids.device
    size = output_size(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=device)
    block_experts = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)  # scratch
    kernel[(1,)](topk_ids.reshape(-1).contiguous(), sorted_ids, block_experts, num_padded, starts,
                 num_pairs, num_experts, expert_offset, size, BLOCK_M=block_m, PAIRS=_pow2(num_pairs),
                 EXPERTS=_pow2(num_experts), BLOCKS=_pow2(size // block_m), TILE=32, num_warps=8)
    return sorted_ids, block_experts, num_padded


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch ops (any size): a stable argsort by expert, padded offsets, searchsorted."""
    flat = topk_ids.reshape(-1).long() - expert_offset  # [T*K]
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # E: elsewhere
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E + 1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # (an in-place kernel: capturable in a CUDA graph)
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)  # pairs by expert, those elsewhere last
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    size = output_size(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((size + 1,), num_pairs, dtype=torch.int32, device=device)
    dest = torch.where(expert_of < num_experts, (padded_end - padded)[expert_of] + rank, size)
    sorted_ids[dest] = order.to(torch.int32)
    sorted_ids = sorted_ids[:size]  # slot `size` took the pairs elsewhere
    padded_end = padded_end[:num_experts]
    block_starts = torch.arange(0, size, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = block_experts.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_experts, padded_end[-1:].to(torch.int32)


@lazy_kernel("the MoE row alignment")
def _kernel(triton):
    @triton.jit
    def align_kernel(ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, starts_ptr,
                     num_pairs, num_experts, expert_offset, size, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr,
                     EXPERTS: tl.constexpr, BLOCKS: tl.constexpr, TILE: tl.constexpr):
        pairs = tl.arange(0, PAIRS)
        pair_ok = pairs < num_pairs
        ids = tl.load(ids_ptr + pairs, mask=pair_ok, other=-1).to(tl.int32) - expert_offset
        ids = tl.where(pair_ok & (ids >= 0) & (ids < num_experts), ids, -1)  # -1: elsewhere (or padding)
        experts = tl.arange(0, EXPERTS)
        # counts[e] and rank[p] (pairs before p with p's expert), a tile of pairs at a time
        counts = tl.zeros((EXPERTS,), dtype=tl.int32)
        rank = tl.zeros((PAIRS,), dtype=tl.int32)
        for q0 in range(0, PAIRS, TILE):
            qs = q0 + tl.arange(0, TILE)
            q_ok = qs < num_pairs
            q_ids = tl.load(ids_ptr + qs, mask=q_ok, other=-1).to(tl.int32) - expert_offset
            q_ids = tl.where(q_ok & (q_ids >= 0) & (q_ids < num_experts), q_ids, -1)
            counts += tl.sum((experts[:, None] == q_ids[None, :]).to(tl.int32), axis=1)
            before = (ids[:, None] == q_ids[None, :]) & (qs[None, :] < pairs[:, None])
            rank += tl.sum(before.to(tl.int32), axis=1)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [EXPERTS], 0 past num_experts
        padded_end = tl.cumsum(padded, axis=0)
        tl.store(starts_ptr + experts, padded_end - padded, mask=experts < num_experts)
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        blocks = tl.arange(0, BLOCKS)
        block_expert = tl.sum(((padded_end[None, :] <= (blocks * BLOCK_M)[:, None])
                               & (experts[None, :] < num_experts)).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.minimum(block_expert, num_experts - 1),
                 mask=blocks * BLOCK_M < size)
        for r0 in range(0, size, PAIRS):  # every row padding first ...
            rows = r0 + pairs
            tl.store(sorted_ptr + rows, tl.zeros((PAIRS,), dtype=tl.int32) + num_pairs, mask=rows < size)
        tl.debug_barrier()  # ... then the pairs over it, at their expert's start plus their rank
        start = tl.load(starts_ptr + ids, mask=ids >= 0, other=0)
        tl.store(sorted_ptr + start + rank, pairs, mask=ids >= 0)

    return align_kernel
