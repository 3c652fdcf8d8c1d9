"""Paged attention over one layer's KV cache: decode (split-K) and prefill (causal, chunked).

A layer's cache is [P, S, Hkv, D]: the key at context position p of row b sits in page
`kv_indices[kv_indptr[b] + p // S]`, offset `p % S` (row b's pages are listed from
kv_indptr[b] on, as flashinfer lists them; entries past its first ceil(seq_lens[b] / S) are
never read). Row b's new tokens are the last q_len of its
seq_lens[b] context positions and are already stored in the cache; the query at position p
attends keys 0..p (causal), with query head h reading KV head h // (Hq // Hkv) (GQA). With a
sliding `window` > 0 it attends keys p - window < j <= p only (transformers' convention), and
a program skips the key tiles that lie wholly before its queries' windows.

One Triton kernel serves both entry points. A program takes one KV head of one row and
BLOCK_Q of that row's queries times all GROUP = Hq // Hkv query heads of the KV head: the
[BLOCK_Q * GROUP, D] query tile rides through the keys page by page (BLOCK_N keys a tile,
gathered through the page table) with a flash-attention online softmax in base 2, so each K/V
tile is read once for all the heads that share it. Decode is the case BLOCK_Q = 1. Prefill
launches one program per query block that holds queries (`prefill_blocks`, on the host from
the rows' lengths), longest first: a grid of (blocks of the longest row) x rows would be nearly
all empty programs when decode rows of one token sit beside a long chunk.

Decode is split-K (flash-decoding): NUM_SPLITS programs share a (row, KV head). A row uses as
many of them as give each split at least _MIN_TILES_PER_SPLIT key tiles of its own context (from
its seq_len, in the kernel; the others return at once), each taking an equal run of whole
tiles, and they write a partial output and its log-sum-exp to float32 buffers allocated per call
(inside a graph capture they come from the graph's memory pool, at fixed addresses). Each then
counts itself done on an int32 counter of its (row, KV head) (an acquire-release atomic at GPU
scope, after a barrier over the program's stores); the program that counts last merges the
splits' partials and resets the counter to zero. So decode is one launch whatever the splits
(a second merge kernel would cost about 2.7 us a layer at batch 1 on an H200, plus its launch
gap). The counters live in one zeroed buffer per device that every launch leaves zeroed:
launches that share a device must not run at the same time (one stream per device, as the
engine runs them). NUM_SPLITS comes from shapes only (rows, KV heads, a bound on the context,
the SM count), never from tensor values: no host sync, and a CUDA graph captured for one batch
replays for another of the same shape, whatever its lengths and pages. A row's own split count
matters because that bound is loose: a server's graphs are sized for its context length
(131,072 for Llama-3.1), and a short row would otherwise read and merge dozens of empty splits.
Before the PDL wait a program reads only what the host staged for the step (the query blocks,
seq_lens, the page lists): its bounds and its first tile's pages, so the first K/V load leaves
right after the wait. The K/V tile itself loads after it: loaded before, it was slower, at
batch 1 and at large batches alike.

The page lists are ragged, not a dense [B, max_pages] table: a CUDA graph's table would have to
be as wide as the longest context the engine allows, 8192 pages for a 131072-token Llama-3.1,
so a batch of 512 would fill and copy 4.2M entries a step for the ~50k its rows hold.

On an H200 (Llama-3-8B heads: Hq 32, Hkv 8, D 128, page 16, bf16) decode reads K/V at about
4.2-4.4 TB/s from batch 32 up, near the copy ceiling; small batches with short contexts are
launch-bound. Prefill runs at about 270-310 TFLOP/s (torch's dense flash SDPA: 400-550).

FP8 caches (and any cache holding K / k_scale, V / v_scale): K/V tiles are loaded in the cache's
dtype and cast to q's (exact from FP8 to fp16/bf16/fp32); k_scale is folded into the softmax
scale and v_scale multiplies the output, which equals attending over K * k_scale and
V * v_scale. The scales are host floats, fixed per layer, so a CUDA graph may keep them.
Under a bf16 query the tiles' products run in float16 instead (q and the probabilities rounded
to float16, which has 3 more mantissa bits than bf16 and is exact for FP8 values; a query
element beyond float16's +-65504 would overflow): a Llama-3.1-8B decode step at batch 256 and
1536 tokens of context takes 11.7 ms against 14.0 with bf16 products. An FP8 cache decodes
with tiles of its own (_DECODE_FP8_*): on an H100, 64-1024 rows of 1536 tokens read FP8 K/V
at 2.47-2.75 TB/s and bf16 K/V at 2.84-3.01 (copy rate 3.0), so FP8 K/V take 55-60 % of bf16's
time; with bf16's tiles they read at 1.6-2.3 TB/s.

The functions run the kernels on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1
(Triton's interpreter; how the tests exercise them); otherwise the torch references (`*_ref`,
float32 math). Triton is imported lazily, so importing this module never imports it.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from kernels._triton import device_counters, launch_options, lazy_kernel, pdl

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_LOG2E = 1.4426950408889634
_DECODE_BLOCK_N = 64  # keys per tile in decode (4 pages of 16)
_DECODE_WARPS = 4
_DECODE_STAGES = 2
# An FP8 cache in a decode launch of one split (batches of 64 rows and more): programs of 2
# warps, a stage deeper, more of them on an SM (bench/probes/decode_attention.py,
# decode-attention-fp8-tiles-h100/: within 3 % of the best tiles at 64-1024 rows, 18-50 %
# faster than 64 / 4 / 2)
_DECODE_FP8_BLOCK_N = 64
_DECODE_FP8_WARPS = 2
_DECODE_FP8_STAGES = 3
_PREFILL_BLOCK_M = 64  # query rows (tokens x heads of a group) per prefill program
_PREFILL_BLOCK_N = 64  # keys per tile in prefill
_PREFILL_WARPS = 4
_PREFILL_STAGES = 3
_PROGRAMS_PER_SM = 4  # decode splits fill one wave of this many programs per SM (H200-tuned)
_MAX_SPLITS = 64
_MIN_TILES_PER_SPLIT = 1  # a split reads at least this many key tiles (of the widest row
# when the host picks NUM_SPLITS, of its own row in the kernel); at batch 1 and 1k context more
# splits of one tile beat fewer of two or four on an H200
_CPU_SMS = 132  # split rule's SM count when there is no GPU (the interpreter): an H200's
_MERGE_ELEMENTS = 16384  # partial-output elements the merging program loads at a time (32
# splits at group 4, D 128; faster on an H200 than 4096 or 8192)
_COUNTERS = 1 << 16  # split counters per device: rows x KV heads of one decode launch
# device -> its int32 [_COUNTERS] split counters, zero between launches
_counters: dict[torch.device, torch.Tensor] = {}
tl = None  # triton.language, bound when _kernels is first built


# ----------------------------------------------------------------------------- references

def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                                kv_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                k_scale: float = 1.0, v_scale: float = 1.0,
                                window: int = 0) -> torch.Tensor:
    """Torch reference of `paged_prefill_attention`: gathers each row's context, dequantises it
    (times k_scale, v_scale) and runs a masked softmax in float32, row by row (host syncs).
    Returns [T, Hq, D] in q's dtype."""
    _check(q, k_cache, v_cache, kv_indptr, kv_indices, seq_lens, qo_indptr)
    num_heads, (_, page_size, num_kv_heads, head_dim) = q.shape[1], k_cache.shape
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim)  # [P * S, Hkv, D]
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim)
    out = torch.zeros_like(q)
    indptr, lens, first = qo_indptr.tolist(), seq_lens.tolist(), kv_indptr.tolist()
    for b, seq_len in enumerate(lens):
        start, end = indptr[b], indptr[b + 1]
        if end == start:
            continue
        pages = kv_indices[first[b]:first[b] + _cdiv(seq_len, page_size)].long()
        slots = (pages[:, None] * page_size + torch.arange(page_size, device=q.device))
        slots = slots.flatten()[:seq_len]  # [L]
        group = num_heads // num_kv_heads
        k = (flat_k[slots].float() * k_scale).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = (flat_v[slots].float() * v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale  # [Hq, n, L]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)  # [n, L]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
                               v_scale: float = 1.0, window: int = 0) -> torch.Tensor:
    """Torch reference of `paged_decode_attention`: prefill with one query per row."""
    qo_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_attention_ref(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                                       seq_lens, scale, k_scale, v_scale, window)


# ----------------------------------------------------------------------------- dispatch

def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           num_splits: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, window: int = 0) -> torch.Tensor:
    """Attention of one new token per row over its whole paged context.

    Parameters
    ----------
    q : [B, Hq, D]; last dim contiguous, other strides arbitrary. Hq a multiple of Hkv.
    k_cache, v_cache : [P, S, Hkv, D], one shape and dtype (may differ from q's, FP8 included:
        tiles are cast to q's dtype); strides arbitrary.
    kv_indptr : [B + 1] int32 (or int64): row b's pages are listed from kv_indices[kv_indptr[b]].
    kv_indices : [N] int32 (or int64) page ids; row b's are its first ceil(seq_lens[b] / S)
        from kv_indptr[b] on (anything after them is never read).
    seq_lens : [B] int32 (or int64), each >= 1: context length including the new token.
    scale : softmax scale (usually D ** -0.5).
    out : optional [B, Hq, D] tensor to write (last dim contiguous); else a new one, q's dtype.
    num_splits : key splits per (row, KV head); default `decode_num_splits(...)` with the
        context bounded by N pages (shapes only, so the launch is CUDA-graph capturable). A
        caller that knows a tighter bound on the longest context passes its own.
    k_scale, v_scale : the caches hold K / k_scale and V / v_scale (FP8 caches); default 1.0.
    window : sliding window: the query at position p sees keys p - window < j <= p; 0: all.

    Returns
    -------
    out, [B, Hq, D].
    """
    _check(q, k_cache, v_cache, kv_indptr, kv_indices, seq_lens, None, out)
    out = q.new_empty(q.shape) if out is None else out
    if not _kernels.runs_on(q):
        out.copy_(paged_decode_attention_ref(q, k_cache, v_cache, kv_indptr, kv_indices, seq_lens,
                                             scale, k_scale, v_scale, window))
        return out
    if num_splits is None:
        num_splits = decode_num_splits(q.shape[0], k_cache.shape[2],
                                       kv_indices.shape[0] * k_cache.shape[1], q.device)
    _launch(q, k_cache, v_cache, None, kv_indptr, kv_indices, seq_lens, scale * k_scale, v_scale,
            out, q_blocks=None, num_splits=num_splits, window=window)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                            kv_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, q_blocks: torch.Tensor | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            window: int = 0) -> torch.Tensor:
    """Causal attention of each row's new tokens over its paged context (cached prefix + new).

    Parameters
    ----------
    q : [T, Hq, D], the B rows' new tokens concatenated; row b owns
        q[qo_indptr[b]:qo_indptr[b + 1]], the last q_len of its seq_lens[b] positions.
        Last dim contiguous, other strides arbitrary.
    k_cache, v_cache, kv_indptr, kv_indices, seq_lens, scale, k_scale, v_scale, window : as in
        `paged_decode_attention` (q_len <= seq_len; rows of one token mix freely with long ones).
    qo_indptr : [B + 1] int32 (or int64), qo_indptr[0] = 0 and qo_indptr[B] = T.
    out : optional [T, Hq, D] tensor to write (last dim contiguous); else a new one, q's dtype.
    q_blocks : int32 [num_blocks, 2] on q's device, the (row, query block) of each program:
        `prefill_blocks` of the rows' q_len and seq_len, which the caller has on the host; made
        from qo_indptr and seq_lens when omitted, at the cost of a host sync.

    Returns
    -------
    out, [T, Hq, D].
    """
    _check(q, k_cache, v_cache, kv_indptr, kv_indices, seq_lens, qo_indptr, out)
    out = q.new_empty(q.shape) if out is None else out
    if not _kernels.runs_on(q):
        out.copy_(paged_prefill_attention_ref(q, k_cache, v_cache, qo_indptr, kv_indptr,
                                              kv_indices, seq_lens, scale, k_scale, v_scale,
                                              window))
        return out
    if q_blocks is None:
        blocks = prefill_blocks(qo_indptr.diff().tolist(), seq_lens.tolist(), q.shape[1],
                                k_cache.shape[2])
        q_blocks = torch.tensor(blocks, dtype=torch.int32, device=q.device).view(-1, 2)
    _launch(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, seq_lens, scale * k_scale,
            v_scale, out, q_blocks, num_splits=1, window=window)
    return out


def prefill_blocks(q_lens: list[int], seq_lens: list[int], num_heads: int,
                   num_kv_heads: int) -> list[int]:
    """The prefill kernel's programs (per KV head): each row's query blocks, as flat (row,
    block) pairs, the blocks that see the most keys first. One program per block that holds
    queries, so rows of one token (decode rows in a mixed batch) cost one program each, not
    one per block of the longest row."""
    block_q = _prefill_block_q(num_heads // num_kv_heads)
    blocks = [(row, b) for row, n in enumerate(q_lens) for b in range(_cdiv(n, block_q))]
    blocks.sort(key=lambda rb: min(seq_lens[rb[0]],  # the keys block b of row r reads
                                   seq_lens[rb[0]] - q_lens[rb[0]] + (rb[1] + 1) * block_q),
                reverse=True)
    return [v for pair in blocks for v in pair]


def _prefill_block_q(group: int) -> int:
    """Query tokens per prefill program: BLOCK_M rows of tokens x the group's heads."""
    return max(1, _PREFILL_BLOCK_M // _pow2(group))


def decode_num_splits(num_rows: int, num_kv_heads: int, max_context: int,
                      device: torch.device) -> int:
    """Key splits per (row, KV head) for decode, from shapes only.

    As many as fit the (row, KV head) programs into one wave of _PROGRAMS_PER_SM programs per
    SM (rounded down: a sliver of a second wave costs more than it gives), no more than leave
    each split _MIN_TILES_PER_SPLIT key tiles of a max_context-long row, at most _MAX_SPLITS.
    """
    wave = _PROGRAMS_PER_SM * _num_sms(device)
    wanted = wave // max(num_rows * num_kv_heads, 1)
    tiles = _cdiv(max_context, _DECODE_BLOCK_N)
    return max(1, min(wanted, _cdiv(tiles, _MIN_TILES_PER_SPLIT), _MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- Triton kernels

@lazy_kernel("CUDA paged attention")
def _kernels(triton):
    """The jitted attention kernel."""
    @triton.jit
    def attention_kernel(
            q_ptr, k_ptr, v_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr, qo_indptr_ptr,
            q_blocks_ptr, kv_indptr_ptr, kv_indices_ptr, seq_lens_ptr, qk_scale, v_scale,
            q_stride_t, q_stride_h, o_stride_t, o_stride_h, k_stride_p, k_stride_s, k_stride_h,
            v_stride_p, v_stride_s, v_stride_h, HEAD_DIM: tl.constexpr,
            PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr,
            SPLIT_BLOCK: tl.constexpr, DECODE: tl.constexpr, PRECISION: tl.constexpr,
            F16: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr):
        # Grid: decode (1, rows, KV heads x splits); prefill (query blocks, 1, KV heads), the
        # (row, block) of program i at q_blocks[i] (prefill_blocks: most keys first).
        kv_head = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        num_q_heads = tl.num_programs(2) // NUM_SPLITS * GROUP
        if DECODE:
            q_block = 0
            row = tl.program_id(1)
            q_start = row
            q_len = 1
        else:
            row = tl.load(q_blocks_ptr + 2 * tl.program_id(0))
            q_block = tl.load(q_blocks_ptr + 2 * tl.program_id(0) + 1)
            q_start = tl.load(qo_indptr_ptr + row)
            q_len = tl.load(qo_indptr_ptr + row + 1) - q_start
        if q_block * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + row)
        # This block needs keys [kv_start, kv_end), kv_start 0 or its first query's window's
        # first key, rounded down to a tile. The row uses as many of the NUM_SPLITS splits as
        # leave each MIN_TILES key tiles (the rest return now: neither counted nor merged), and
        # split `split` takes its share of whole tiles.
        kv_end = tl.minimum(seq_len, seq_len - q_len + (q_block + 1) * BLOCK_Q)
        kv_start = 0
        if WINDOW > 0:
            first_pos = seq_len - q_len + q_block * BLOCK_Q
            kv_start = tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        num_tiles = tl.cdiv(kv_end - kv_start, BLOCK_N)
        row_splits = tl.minimum(tl.cdiv(num_tiles, MIN_TILES), NUM_SPLITS)
        if split >= row_splits:
            return
        tiles_per_split = tl.cdiv(num_tiles, row_splits)
        lo = kv_start + split * tiles_per_split * BLOCK_N
        hi = tl.minimum(lo + tiles_per_split * BLOCK_N, kv_end)

        # The row's pages and the first tile's, ahead of the wait like all of the above: the
        # host stages them (module docstring); then the loop loads each next tile's pages.
        table = kv_indices_ptr + tl.load(kv_indptr_ptr + row).to(tl.int64)
        t = lo + tl.arange(0, BLOCK_N)
        page = tl.load(table + t // PAGE_SIZE, mask=t < hi, other=0).to(tl.int64)
        if PDL:  # see kernels/_triton.py: the kernel before done, then let the next start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

        # Query rows r = token * GROUP_PAD + head; rows past BLOCK_Q * GROUP_PAD pad tl.dot to 16.
        r = tl.arange(0, BLOCK_M)
        tok = q_block * BLOCK_Q + r // GROUP_PAD  # [M] query index within the row
        head = kv_head * GROUP + r % GROUP_PAD  # [M] query head
        row_ok = (tok < q_len) & (r % GROUP_PAD < GROUP) & (r < BLOCK_Q * GROUP_PAD)
        pos = seq_len - q_len + tok  # [M] context position of each query
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        t_idx = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + (t_idx * q_stride_t + head * q_stride_h)[:, None] + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, BLOCK_D]
        if F16:  # FP8 K/V under a bf16 query: the tiles' products in float16 (see the docstring)
            q = q.to(tl.float16)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 logits)
        l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(logit - m)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)  # [N] key positions
            t_ok = t < hi
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k_off = page * k_stride_p + (t % PAGE_SIZE) * k_stride_s + kv_head * k_stride_h
            k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
            visible = t_ok[None, :] & (t[None, :] <= pos[:, None])
            if WINDOW > 0:
                visible = visible & (t[None, :] > pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            alpha = tl.exp2(m - m_ref)
            p = tl.exp2(s - m_ref[:, None])  # [M, N]
            l = l * alpha + tl.sum(p, 1)
            v_off = page * v_stride_p + (t % PAGE_SIZE) * v_stride_s + kv_head * v_stride_h
            v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                                input_precision=PRECISION)
            m = m_new
            t = t + BLOCK_N  # the next tile's pages
            page = tl.load(table + t // PAGE_SIZE, mask=t < hi, other=0).to(tl.int64)

        out_mask = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:  # (padding rows may see no key inside a window: l = 0)
            o = acc * (v_scale / tl.where(l > 0, l, 1.0))[:, None]
            o_off = t_idx * o_stride_t + head * o_stride_h
            tl.store(out_ptr + o_off[:, None] + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:  # partial output and log2-sum-exp2 of split `split`; empty splits give -inf
            o = acc * (v_scale / tl.where(l > 0, l, 1.0))[:, None]
            lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
            mid = (t_idx * num_q_heads + head) * NUM_SPLITS + split  # [M]
            tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask)
            tl.store(mid_lse_ptr + mid, lse, mask=row_ok)
            # Decode only (BLOCK_Q = 1): the last split of this (row, KV head) to finish merges.
            tl.debug_barrier()  # every thread's stores before the release below
            token = row.to(tl.int64)  # decode: row b's token is token b
            counter = counter_ptr + token * (num_q_heads // GROUP) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == row_splits - 1:
                tl.store(counter, 0)  # zero again for the next launch
                g = tl.arange(0, GROUP_PAD)
                g_ok = g < GROUP
                base = (token * num_q_heads + kv_head * GROUP + g) * NUM_SPLITS  # [G]
                m_all = tl.full([GROUP_PAD], float("-inf"), tl.float32)
                den = tl.zeros([GROUP_PAD], tl.float32)
                num = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
                for s0 in range(0, row_splits, SPLIT_BLOCK):  # out = sum w_i o_i / sum w_i
                    sp = s0 + tl.arange(0, SPLIT_BLOCK)
                    gs_ok = g_ok[:, None] & (sp < row_splits)[None, :]  # [G, S]
                    idx = base[:, None] + sp[None, :]
                    part_lse = tl.load(mid_lse_ptr + idx, mask=gs_ok, other=float("-inf"),
                                       cache_modifier=".cg")
                    part_o = tl.load(mid_o_ptr + (idx * HEAD_DIM)[:, :, None] + d[None, None, :],
                                     mask=gs_ok[:, :, None] & d_ok[None, None, :], other=0.0,
                                     cache_modifier=".cg")  # [G, S, BLOCK_D]
                    m_new = tl.maximum(m_all, tl.max(part_lse, 1))
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m_all - m_ref)
                    w = tl.exp2(part_lse - m_ref[:, None])  # [G, S]
                    den = den * alpha + tl.sum(w, 1)
                    num = num * alpha[:, None] + tl.sum(part_o * w[:, :, None], 1)
                    m_all = m_new
                o_off = token * o_stride_t + (kv_head * GROUP + g) * o_stride_h
                tl.store(out_ptr + o_off[:, None] + d[None, :],
                         (num / den[:, None]).to(out_ptr.dtype.element_ty),
                         mask=g_ok[:, None] & d_ok[None, :])

    return attention_kernel


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            qo_indptr: torch.Tensor | None, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, v_scale: float, out: torch.Tensor,
            q_blocks: torch.Tensor | None, num_splits: int, window: int = 0) -> None:
    """Decode when qo_indptr is None (one query per row), else prefill over q_blocks; on q's
    device. `scale` is the softmax scale with k_scale folded in; window 0: full attention."""
    global triton_launches
    num_tokens, num_heads, head_dim = q.shape
    num_rows = seq_lens.shape[0]
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or num_rows == 0 or (q_blocks is not None and q_blocks.shape[0] == 0):
        return
    attention_kernel = _kernels.load()
    decode = qo_indptr is None
    group = num_heads // num_kv_heads
    group_pad = _pow2(group)
    if decode and num_splits == 1 and k_cache.dtype.itemsize == 1:
        block_q, block_n = 1, _DECODE_FP8_BLOCK_N
        num_warps, num_stages = _DECODE_FP8_WARPS, _DECODE_FP8_STAGES
    elif decode:
        block_q, block_n = 1, _DECODE_BLOCK_N
        num_warps, num_stages = _DECODE_WARPS, _DECODE_STAGES
    else:
        block_q = _prefill_block_q(group)
        block_n, num_warps, num_stages = _PREFILL_BLOCK_N, _PREFILL_WARPS, _PREFILL_STAGES
    block_m = max(16, block_q * group_pad)  # tl.dot wants 16 rows or more
    block_d = max(16, _pow2(head_dim))
    if num_splits > 1:  # decode only
        mid_o = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                            device=q.device)  # [T, Hq, splits, D] partial outputs
        mid_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                              device=q.device)  # [T, Hq, splits] their log2-sum-exp2
        counters = _split_counters(q.device, num_rows * num_kv_heads)
    else:
        mid_o = mid_lse = counters = out  # unused
    split_block = min(_pow2(num_splits), max(1, _MERGE_ELEMENTS // (group_pad * block_d)))
    grid = ((1, num_rows, num_kv_heads * num_splits) if decode
            else (q_blocks.shape[0], 1, num_kv_heads))
    elsewhere = q.is_cuda and q.device.index != torch.cuda.current_device()
    with torch.cuda.device(q.device) if elsewhere else contextlib.nullcontext():
        attention_kernel[grid](
            q, k_cache, v_cache, out, mid_o, mid_lse, counters,
            qo_indptr if qo_indptr is not None else seq_lens,
            q_blocks if q_blocks is not None else seq_lens, kv_indptr, kv_indices, seq_lens,
            scale * _LOG2E, v_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            HEAD_DIM=head_dim, PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=group_pad,
            BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, MIN_TILES=_MIN_TILES_PER_SPLIT, SPLIT_BLOCK=split_block,
            DECODE=decode,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            F16=k_cache.dtype.itemsize == 1 and q.dtype == torch.bfloat16, WINDOW=window,
            num_warps=num_warps,
            num_stages=num_stages, **launch_options(pdl(q)))
        triton_launches += 1


def _split_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed split counters (made on first use, outside any graph capture)."""
    if needed > _COUNTERS:
        raise ValueError(f"a decode launch of {needed} (row, KV head) pairs exceeds the "
                         f"{_COUNTERS} split counters")
    return device_counters(_counters, device, _COUNTERS, "the split counters")


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# ----------------------------------------------------------------------------- validation

def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           kv_indptr: torch.Tensor, kv_indices: torch.Tensor, seq_lens: torch.Tensor,
           qo_indptr: torch.Tensor | None, out: torch.Tensor | None = None) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"caches must be [P, S, Hkv, D] of one shape and dtype, got "
                         f"{k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} "
                         f"{tuple(v_cache.shape)}")
    num_kv_heads, head_dim = k_cache.shape[2:]
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"q must be [T, Hq, {head_dim}] with Hq a multiple of {num_kv_heads}, "
                         f"got {tuple(q.shape)}")
    if not q.is_floating_point() or q.stride(2) != 1:
        raise ValueError(f"q must be floating point with a contiguous last dim, got {q.dtype} "
                         f"strides {q.stride()}")
    if out is not None and (out.shape != q.shape or out.stride(2) != 1
                            or not out.is_floating_point()):
        raise ValueError(f"out must be a float {tuple(q.shape)} tensor with a contiguous last "
                         f"dim, got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    num_rows = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    expected_rows = q.shape[0] if qo_indptr is None else qo_indptr.shape[0] - 1
    if (num_rows != expected_rows or tuple(kv_indptr.shape) != (num_rows + 1,)
            or kv_indices.dim() != 1):
        raise ValueError(f"seq_lens must be [B], kv_indptr [B + 1] and kv_indices [N] with B = "
                         f"{expected_rows}, got {tuple(seq_lens.shape)}, {tuple(kv_indptr.shape)} "
                         f"and {tuple(kv_indices.shape)}")
    ints = [kv_indptr, kv_indices, seq_lens] + ([qo_indptr] if qo_indptr is not None else [])
    if any(t.dtype not in (torch.int32, torch.int64) or t.stride(-1) != 1 for t in ints):
        raise ValueError("kv_indptr, kv_indices, seq_lens and qo_indptr must be contiguous "
                         "int32 or int64")
    tensors = [q, k_cache, v_cache] + ints + ([out] if out is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must share a device, got {[t.device for t in tensors]}")
