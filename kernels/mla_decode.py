"""Multi-head latent attention (MLA, DeepSeek-V2/V3) decode over one layer's paged latent cache.

With the up-projections absorbed, MLA decode is multi-query attention with a single KV head:
each cached token holds one entry [latent (R) | k_pe (Dr)] (R = kv_lora_rank, 512 in
DeepSeek; Dr = 64 rope dims), in a cache of [P, S, 1, R + Dr]. Query head h, [q_lat | q_pe],
scores a token by q_lat . latent + q_pe . k_pe; the value is the latent itself, so the output
is [B, H, R]. Pages follow paged_attention's convention: position p of row b sits in page
`kv_indices[kv_indptr[b] + p // S]`, offset `p % S`, and the new token is already cached.

A program takes one row, BLOCK_H of its heads and one split of its context. All heads share
the one KV head, so the [BLOCK_H, R] query tile times each [BLOCK_N, R] latent tile is a real
matmul, and the latent tile, loaded once, serves both Q.K and P.V: a row's cache is read once
per head block (H / BLOCK_H times, mostly from L2 after the first), where a key tile and a value
tile would read each latent twice. The softmax is online, in base 2, accumulated in float32.

Decode is split-K (flash-decoding): NUM_SPLITS programs share a (row, head block), each taking
an equal run of whole key tiles of its row (a short row uses fewer splits; the rest return at
once). They write partial outputs and their log2-sum-exp2 to float32 buffers allocated per call,
and a second small kernel merges them. NUM_SPLITS comes from shapes only, so a launch holds no
host sync and a CUDA graph captured for one batch replays for any lengths and pages.

The functions run the kernels on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1
(Triton's interpreter; how the tests exercise them); otherwise the torch reference.
"""

from __future__ import annotations

import contextlib
import math

import torch

from kernels._triton import lazy_kernel
from kernels.paged_attention import decode_num_splits

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_LOG2E = math.log2(math.e)
_BLOCK_H = 16  # query heads per program (tl.dot wants 16 rows or more)
# Keys per tile, warps, stages: of five tilings swept on an H200 (bench/mla_decode.py --configs;
# 16 and 128 heads, pages of 16 and 64, batch 1-64, 1k-4k context), the fastest or within 10 %
# of it in 22 of 24 cases, 25 % slower at worst (16 heads, batch 8, 1k context):
# bench/results/mla-decode-tiling-sweep-h200.json.
_BLOCK_N = 32
_WARPS = 4
_STAGES = 2
tl = None  # triton.language, bound when _kernels is first built


def mla_decode_attention_ref(q: torch.Tensor, cache: torch.Tensor, kv_indptr: torch.Tensor,
                             kv_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                             kv_lora_rank: int) -> torch.Tensor:
    """Torch reference of `mla_decode_attention`: gathers each row's context and runs a
    softmax in float32, row by row (host syncs). Returns [B, H, R] in q's dtype."""
    _check(q, cache, kv_indptr, kv_indices, seq_lens, kv_lora_rank)
    page_size, entry = cache.shape[1], cache.shape[3]
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    first = kv_indptr.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        pages = kv_indices[first[b]:first[b] + -(-seq_len // page_size)].long()
        c = cache[pages, :, 0].reshape(-1, entry)[:seq_len].float()  # [L, R + Dr]
        probs = (q[b].float() @ c.T * scale).softmax(-1)  # [H, L]
        out[b] = (probs @ c[:, :kv_lora_rank]).to(q.dtype)
    return out


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, kv_indptr: torch.Tensor,
                         kv_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         kv_lora_rank: int, out: torch.Tensor | None = None,
                         num_splits: int | None = None) -> torch.Tensor:
    """Absorbed MLA attention of one new token per row over its whole paged latent context.

    Parameters
    ----------
    q : [B, H, R + Dr], [q_lat | q_pe] per head; last dim contiguous, other strides arbitrary.
    cache : [P, S, 1, R + Dr], each entry [latent | k_pe]; last dim contiguous, other strides
        arbitrary; tiles are cast to q's dtype.
    kv_indptr, kv_indices, seq_lens : the rows' pages and context lengths (each >= 1),
        int32 or int64, as in `paged_attention.paged_decode_attention`.
    scale : softmax scale.
    kv_lora_rank : R, the latent width (the values are each entry's first R elements).
    out : optional [B, H, R] float tensor to write (last dim contiguous); else a new one in
        q's dtype.
    num_splits : key splits per (row, head block); default `decode_num_splits` with the
        context bounded by N pages (shapes only, so the launch is CUDA-graph capturable).

    Returns
    -------
    out, [B, H, R].
    """
    _check(q, cache, kv_indptr, kv_indices, seq_lens, kv_lora_rank, out)
    num_rows, num_heads, _ = q.shape
    out = q.new_empty(num_rows, num_heads, kv_lora_rank) if out is None else out
    if not _kernels.runs_on(q):
        out.copy_(mla_decode_attention_ref(q, cache, kv_indptr, kv_indices, seq_lens, scale,
                                           kv_lora_rank))
        return out
    head_blocks = -(-num_heads // _BLOCK_H)
    if num_splits is None:  # a row's head blocks stand where paged attention has KV heads
        num_splits = decode_num_splits(num_rows, head_blocks,
                                       kv_indices.shape[0] * cache.shape[1], q.device)
    if num_rows > 0:
        _launch(q, cache, kv_indptr, kv_indices, seq_lens, scale, kv_lora_rank, out,
                head_blocks, num_splits)
    return out


def _launch(q: torch.Tensor, cache: torch.Tensor, kv_indptr: torch.Tensor,
            kv_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
            out: torch.Tensor, head_blocks: int, num_splits: int) -> None:
    """The split kernel, then (with more than one split) the merge kernel, on q's device."""
    global triton_launches
    split_kernel, merge_kernel = _kernels.load()
    num_rows, num_heads, entry = q.shape
    rank, rope = kv_lora_rank, entry - kv_lora_rank
    block_r = max(16, _pow2(rank))
    if num_splits > 1:
        mid_o = torch.empty(num_rows, num_heads, num_splits, rank, dtype=torch.float32,
                            device=q.device)  # [B, H, splits, R] partial outputs
        mid_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32,
                              device=q.device)  # [B, H, splits] their log2-sum-exp2
    else:
        mid_o = mid_lse = out  # unused
    elsewhere = q.is_cuda and q.device.index != torch.cuda.current_device()
    with torch.cuda.device(q.device) if elsewhere else contextlib.nullcontext():
        split_kernel[(num_rows, head_blocks, num_splits)](
            q, cache, out, mid_o, mid_lse, kv_indptr, kv_indices, seq_lens, scale * _LOG2E,
            num_heads, q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
            out.stride(0), out.stride(1), R=rank, DR=rope, BLOCK_R=block_r,
            BLOCK_DR=max(16, _pow2(rope)), PAGE_SIZE=cache.shape[1], BLOCK_H=_BLOCK_H,
            BLOCK_N=_BLOCK_N, NUM_SPLITS=num_splits,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=_WARPS, num_stages=_STAGES)
        triton_launches += 1
        if num_splits > 1:
            merge_kernel[(num_rows, num_heads)](
                mid_o, mid_lse, out, seq_lens, num_heads, out.stride(0), out.stride(1),
                R=rank, BLOCK_R=block_r, BLOCK_N=_BLOCK_N, NUM_SPLITS=num_splits,
                SPLITS_PAD=_pow2(num_splits))
            triton_launches += 1


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@lazy_kernel("CUDA MLA decode attention")
def _kernels(triton):
    """The jitted split kernel and the kernel that merges its splits."""
    @triton.jit
    def mla_split_kernel(
            q_ptr, cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, kv_indptr_ptr, kv_indices_ptr,
            seq_lens_ptr, qk_scale, num_heads, q_stride_b, q_stride_h, c_stride_p, c_stride_s,
            o_stride_b, o_stride_h, R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_DR: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
        # Grid (rows, head blocks, splits). Split `split` takes keys [lo, hi): its share of
        # whole tiles; a split past the row's last tile has nothing to do.
        row = tl.program_id(0)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + row)
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
        lo = split * tiles_per_split * BLOCK_N
        if lo >= seq_len:
            return
        hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H] query heads
        h_ok = h < num_heads
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R
        e = tl.arange(0, BLOCK_DR)
        e_ok = e < DR
        q_head = q_ptr + row.to(tl.int64) * q_stride_b + h * q_stride_h  # [H]
        q_lat = tl.load(q_head[:, None] + r[None, :], mask=h_ok[:, None] & r_ok[None, :],
                        other=0.0)  # [H, BLOCK_R]
        q_pe = tl.load(q_head[:, None] + R + e[None, :], mask=h_ok[:, None] & e_ok[None, :],
                       other=0.0)  # [H, BLOCK_DR]

        m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (base-2 logits)
        den = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(logit - m)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        table = kv_indices_ptr + tl.load(kv_indptr_ptr + row).to(tl.int64)  # the row's pages
        for start in range(lo, hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)  # [N] key positions
            t_ok = t < hi
            page = tl.load(table + t // PAGE_SIZE, mask=t_ok, other=0).to(tl.int64)
            entry = cache_ptr + page * c_stride_p + (t % PAGE_SIZE) * c_stride_s  # [N]
            lat = tl.load(entry[:, None] + r[None, :], mask=t_ok[:, None] & r_ok[None, :],
                          other=0.0).to(q_lat.dtype)  # [N, BLOCK_R]: keys and values
            pe = tl.load(entry[:, None] + R + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                         other=0.0).to(q_lat.dtype)  # [N, BLOCK_DR]
            s = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
            s += tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)  # [H, N]
            s = tl.where(t_ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: a tile holds a key below hi
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            den = den * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PRECISION)
            m = m_new

        o = acc / den[:, None]
        o_mask = h_ok[:, None] & r_ok[None, :]
        if NUM_SPLITS == 1:
            o_off = row.to(tl.int64) * o_stride_b + h * o_stride_h
            tl.store(out_ptr + o_off[:, None] + r[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=o_mask)
        else:  # partial output and its log2-sum-exp2
            mid = (row.to(tl.int64) * num_heads + h) * NUM_SPLITS + split  # [H]
            tl.store(mid_o_ptr + mid[:, None] * R + r[None, :], o, mask=o_mask)
            tl.store(mid_lse_ptr + mid, m + tl.log2(den), mask=h_ok)

    @triton.jit
    def mla_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, seq_lens_ptr, num_heads, o_stride_b,
                         o_stride_h, R: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
        # Grid (rows, heads): out = sum_i w_i o_i / sum_i w_i, w_i = exp2(lse_i - max lse),
        # over the splits the row used (as the split kernel counts them).
        row = tl.program_id(0)
        head = tl.program_id(1)
        num_tiles = tl.cdiv(tl.load(seq_lens_ptr + row), BLOCK_N)
        used = tl.cdiv(num_tiles, tl.cdiv(num_tiles, NUM_SPLITS))
        base = (row.to(tl.int64) * num_heads + head) * NUM_SPLITS
        sp = tl.arange(0, SPLITS_PAD)
        lse = tl.load(mid_lse_ptr + base + sp, mask=sp < used, other=float("-inf"))
        m = tl.max(lse, 0)
        den = tl.sum(tl.exp2(lse - m), 0)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R
        acc = tl.zeros([BLOCK_R], tl.float32)
        for s in range(0, used):
            w = tl.exp2(tl.load(mid_lse_ptr + base + s) - m)
            acc += w * tl.load(mid_o_ptr + (base + s) * R + r, mask=r_ok, other=0.0)
        o_off = row.to(tl.int64) * o_stride_b + head * o_stride_h
        tl.store(out_ptr + o_off + r, (acc / den).to(out_ptr.dtype.element_ty), mask=r_ok)

    return mla_split_kernel, mla_merge_kernel


def _check(q: torch.Tensor, cache: torch.Tensor, kv_indptr: torch.Tensor,
           kv_indices: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int,
           out: torch.Tensor | None = None) -> None:
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.stride(3) != 1:
        raise ValueError(f"cache must be [P, S, 1, R + Dr] with a contiguous last dim, got "
                         f"{tuple(cache.shape)} strides {cache.stride()}")
    entry = cache.shape[3]
    if not 0 < kv_lora_rank < entry:
        raise ValueError(f"kv_lora_rank must lie in (0, {entry}), got {kv_lora_rank}")
    if (q.dim() != 3 or q.shape[2] != entry or not q.is_floating_point()
            or q.stride(2) != 1):
        raise ValueError(f"q must be a float [B, H, {entry}] tensor with a contiguous last dim, "
                         f"got {q.dtype} {tuple(q.shape)} strides {q.stride()}")
    out_shape = (q.shape[0], q.shape[1], kv_lora_rank)
    if out is not None and (tuple(out.shape) != out_shape or out.stride(2) != 1
                            or not out.is_floating_point()):
        raise ValueError(f"out must be a float {out_shape} tensor with a contiguous last dim, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    num_rows = q.shape[0]
    if (tuple(seq_lens.shape) != (num_rows,) or tuple(kv_indptr.shape) != (num_rows + 1,)
            or kv_indices.dim() != 1):
        raise ValueError(f"seq_lens must be [B], kv_indptr [B + 1] and kv_indices [N] with B = "
                         f"{num_rows}, got {tuple(seq_lens.shape)}, {tuple(kv_indptr.shape)} "
                         f"and {tuple(kv_indices.shape)}")
    ints = [kv_indptr, kv_indices, seq_lens]
    if any(t.dtype not in (torch.int32, torch.int64) or t.stride(-1) != 1 for t in ints):
        raise ValueError("kv_indptr, kv_indices and seq_lens must be contiguous int32 or int64")
    tensors = [q, cache, *ints] + ([out] if out is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must share a device, got {[t.device for t in tensors]}")
