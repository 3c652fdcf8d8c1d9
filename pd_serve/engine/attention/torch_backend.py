"""Paged attention in plain torch: the CPU backend and the reference for the GPU backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kv_store import slotted_rows, store_rows_ref
from kernels.norm import rms_norm
from kernels.rope import check as check_rope
from kernels.rope import rope_rows, rotate_ref_
from pd_serve.cache.pool import pages_for
from pd_serve.engine.attention.base import AttentionBackend, AttentionMetadata, QKNorm, Rope


@dataclass
class _PrefillRow:
    start: int  # first of this row's tokens in the batch
    num_new: int
    seq_len: int  # L: cached prefix + new tokens
    pages: torch.Tensor  # [ceil(L / page_size)] pages of the row's whole context
    masks: dict[int, torch.Tensor]  # window -> [num_new, L] True where a query may attend


def rows_of_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [P, S, H, D], pages [N] -> their rows [N * S, H, D], one index_select (a page is
    S contiguous slots, so this copies whole blocks; indexing slot by slot is several times
    slower on CPU). 1-byte (FP8) caches go through uint8, which index_select has a kernel for."""
    flat = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    rows = flat.index_select(0, pages).flatten(0, 1)
    return rows.view(cache.dtype) if cache.element_size() == 1 else rows


class TorchAttentionBackend(AttentionBackend):
    """Gathers each sequence's K/V pages and calls scaled_dot_product_attention.

    Single-token (decode) rows run as one padded batch; rows with several new tokens (prefill
    chunks) run one by one with a causal mask offset by their cached prefix. Sliding-window
    layers use masks that also hide keys at or before position - window. New K/V are stored
    by kernels/kv_store's torch reference (FP8: k / k_scale, saturated); gathered K/V are cast
    to q's dtype, with k_scale folded into the softmax scale and v_scale applied to the output.
    """

    def plan(self, meta: AttentionMetadata) -> None:
        device = self.pool.buffer.device
        page_size = self.pool.layout.page_size
        self.slot_mapping = meta.slot_mapping
        self.slotted = slotted_rows(meta.slot_mapping)  # the step's, for every layer
        self.rope_rows = None  # (positions, cos rows, sin rows) of the step's forward
        self.decode_token_ids: list[int] = []
        decode_pages: list[torch.Tensor] = []
        decode_lens: list[int] = []
        self.prefill_rows: list[_PrefillRow] = []
        windows = set(self.windows)
        start = 0
        for num_new, seq_len, pages in zip(meta.query_lens, meta.seq_lens, meta.page_tables):
            num_pages = pages_for(seq_len, page_size)
            page_ids = torch.tensor(pages[:num_pages], dtype=torch.int64, device=device)
            if num_new == 1:
                self.decode_token_ids.append(start)
                decode_pages.append(page_ids)
                decode_lens.append(seq_len)
            else:
                q_pos = torch.arange(seq_len - num_new, seq_len, device=device)[:, None]
                k_pos = torch.arange(seq_len, device=device)[None, :]
                masks = {w: (k_pos <= q_pos) & ((k_pos > q_pos - w) if w else True)
                         for w in windows}  # [num_new, L] each
                self.prefill_rows.append(_PrefillRow(start, num_new, seq_len, page_ids, masks))
            start += num_new
        if decode_pages:
            # Padding points at page 0: finite data, masked out below.
            self.decode_pages = torch.nn.utils.rnn.pad_sequence(decode_pages, batch_first=True)
            k_pos = torch.arange(self.decode_pages.shape[1] * page_size, device=device)[None, :]
            lens = torch.tensor(decode_lens, device=device)[:, None]
            self.decode_masks = {w: ((k_pos < lens) & ((k_pos >= lens - w) if w else True))
                                 [:, None, None, :] for w in windows}  # [B, 1, 1, Lmax] each
            self.decode_index = torch.tensor(self.decode_token_ids, device=device)

    def run(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            rope: Rope | None = None, qk_norm: QKNorm | None = None) -> torch.Tensor:
        num_kv_heads = k.shape[1]
        k_scale, v_scale = self.k_scales[layer_id], self.v_scales[layer_id]
        if qk_norm is not None:  # new tensors, rotated below
            if rope is None:
                raise ValueError("qk_norm is applied with RoPE: pass rope too")
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        if rope is not None:  # q in place, k on a copy (as rope_store_kv leaves k)
            k = k.clone()
            if self.rope_rows is None or self.rope_rows[0] is not rope[0]:  # first layer
                check_rope(rope[0], q, k, rope[1], rope[2])
                self.rope_rows = (rope[0], *rope_rows(*rope))  # one gather for every layer
            rotate_ref_(q, k, *self.rope_rows[1:])
        store_rows_ref(k, v, self.pool.k_cache(layer_id), self.pool.v_cache(layer_id),
                       *self.slotted, k_scale, v_scale)
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)  # [P, S, H, D]
        scale = self.scale * k_scale  # softmax(q . (k_stored * k_scale) * scale)
        out = torch.empty_like(q)
        window = self.windows[layer_id]
        if self.decode_token_ids:
            batch = self.decode_pages.shape[0]
            direct = not self.prefill_rows and q.shape[0] == batch  # q's rows: the batch's
            # A KV head's query heads as its queries: [B, Hkv, Hq / Hkv, D] (GQA without
            # SDPA repeating K and V per query head).
            qd = (q if direct else q[self.decode_index]).reshape(
                batch, num_kv_heads, -1, self.head_dim)
            pages = self.decode_pages.flatten()
            kd, vd = (rows_of_pages(cache, pages).view(batch, -1, num_kv_heads, self.head_dim)
                      .transpose(1, 2).to(q.dtype)
                      for cache in (k_cache, v_cache))  # [B, Hkv, Lmax, D]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_masks[window],
                                                scale=scale).reshape(batch, -1, self.head_dim)
            od = od if v_scale == 1.0 else od * v_scale
            if direct:
                return od
            out[self.decode_index] = od
        for row in self.prefill_rows:
            end = row.start + row.num_new
            # 4-D [1, H, n, D]: SDPA takes its math fallback for 3-D inputs, at twice the time.
            qp = q[row.start:end].transpose(0, 1)[None]  # [1, Hq, n, D]
            kp, vp = (rows_of_pages(cache, row.pages)[:row.seq_len].transpose(0, 1)[None]
                      .to(q.dtype) for cache in (k_cache, v_cache))  # [1, Hkv, L, D]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=row.masks[window],
                                                scale=scale, enable_gqa=True)[0]  # [Hq, n, D]
            out[row.start:end] = op.transpose(0, 1) if v_scale == 1.0 else op.transpose(0, 1) * v_scale
        return out
