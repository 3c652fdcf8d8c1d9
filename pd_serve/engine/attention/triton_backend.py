"""Paged attention through this repo's Triton kernels (kernels/paged_attention.py).

plan() turns the batch into small index tensors on the pool's device (the rows' pages as
flashinfer lists them, kv_indptr [B + 1] and kv_indices [pages], seq_lens [B], and for prefill
qo_indptr [B + 1] and the kernel's (row, query block) list); run() stores the layer's new K/V with
kernels/kv_store and runs the decode kernel when every row has one new token, else the prefill
kernel for the whole batch (chunked prefill and decode rows mixed in), each layer with its
sliding window (0: full attention; the kernels mask keys outside it). FP8 pools: the store
quantises (k / k_scale, saturated) and the attention kernels dequantise in registers (FP8 tiles
cast to q's dtype, k_scale folded into the softmax scale, v_scale onto the output).

CUDA graphs: init_cuda_graph() allocates the output buffer [max_bs, Hq, D]; plan_cuda_graph(bs,
...) writes seq_lens [bs], kv_indptr [bs + 1] and the rows' pages into the runner's staging
buffer, which the runner copies to the device with the step's other inputs (as far as this
batch filled it: the pages its rows hold, not bs x max_pages_per_seq), and run() reads views of
the device copy, kv_indices a fixed [bs * max_pages_per_seq] one. The decode launch depends on
(bs, max_pages_per_seq) alone, so one graph per bucket replays for any lengths and pages.
"""

from __future__ import annotations

import torch

from kernels.paged_attention import (decode_num_splits, paged_decode_attention,
                                     paged_prefill_attention, prefill_blocks)
from pd_serve.cache.pool import KVPool, pages_for
from pd_serve.engine.attention.base import AttentionBackend, AttentionMetadata, QKNorm, Rope


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype | None = None, layer_windows: tuple[int, ...] = ()):
        super().__init__(pool, num_heads, head_dim, scale, dtype, layer_windows)
        self.device = pool.buffer.device
        self.page_size = pool.layout.page_size
        self.graph_out: torch.Tensor | None = None  # [max_bs, Hq, D], set by init_cuda_graph()

    # ---- planning -------------------------------------------------------------------------------
    def _pages(self, meta: AttentionMetadata,
               max_pages: int | None = None) -> tuple[list[int], list[int], int]:
        """(kv_indptr, kv_indices, widest): each row's pages, the first ceil(seq_len / S) of
        its table, and the most pages a row uses. A row needing more than `max_pages` is an
        error."""
        indptr, indices, widest = [0], [], 0
        for pages, n in zip(meta.page_tables, meta.seq_lens):
            used = pages_for(n, self.page_size)
            if max_pages is not None and used > max_pages:
                raise ValueError(f"a row needs {used} pages; a graph row holds {max_pages}")
            indices += pages[:used]
            indptr.append(len(indices))
            widest = max(widest, used)
        return indptr, indices, widest

    def _host(self, values: list[int]) -> torch.Tensor:
        """int32 values on the host, page-locked when they go to a GPU: copies from there queue
        without waiting for the step in flight (a blocking one would undo the overlap schedule)."""
        host = torch.tensor(values, dtype=torch.int32)
        return host.pin_memory() if self.device.type == "cuda" else host

    def _to_device(self, values: list[int]) -> torch.Tensor:
        return self._host(values).to(self.device, non_blocking=True)  # one H2D copy

    def plan(self, meta: AttentionMetadata) -> None:
        indptr, indices, widest = self._pages(meta)
        rows = len(meta.seq_lens)
        staged = self._to_device(meta.seq_lens + indptr + indices)  # one H2D copy
        self.seq_lens = staged[:rows]  # [B]
        self.kv_indptr = staged[rows:2 * rows + 1]  # [B + 1]
        self.kv_indices = staged[2 * rows + 1:]  # [pages]
        self.decode = all(n == 1 for n in meta.query_lens)
        self.num_splits = decode_num_splits(len(meta.query_lens), self.pool.layout.num_kv_heads,
                                            widest * self.page_size, self.device)
        if not self.decode:
            indptr = [0]
            for n in meta.query_lens:
                indptr.append(indptr[-1] + n)
            self.qo_indptr = self._to_device(indptr)  # [B + 1]
            blocks = prefill_blocks(meta.query_lens, meta.seq_lens, self.num_heads,
                                    self.pool.layout.num_kv_heads)
            self.q_blocks = self._to_device(blocks).view(-1, 2)  # [blocks, 2]: (row, block)
        self.slot_mapping = meta.slot_mapping
        self.out = None  # run() allocates its output

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def init_cuda_graph(self, max_bs: int, max_pages_per_seq: int) -> None:
        self.graph_max_bs, self.graph_pages = max_bs, max_pages_per_seq
        # The graph path's output, overwritten by each run(): the model consumes it (o_proj)
        # before the next layer's attention. In the activations' dtype (not an FP8 pool's).
        self.graph_out = torch.empty(max_bs, self.num_heads, self.head_dim,
                                     dtype=self.dtype, device=self.device)

    def graph_input_width(self, bs: int) -> int:
        # Per row: seq_len, a kv_indptr entry, its pages; one more for kv_indptr's last entry.
        return 3 + self.graph_pages

    def plan_cuda_graph(self, bs: int, meta: AttentionMetadata, host: torch.Tensor,
                        device: torch.Tensor) -> int:
        if self.graph_out is None:
            raise RuntimeError("plan_cuda_graph() before init_cuda_graph()")
        if (not 0 < bs <= self.graph_max_bs or len(meta.query_lens) != bs
                or any(n != 1 for n in meta.query_lens)):
            raise ValueError(f"a graph batch is {bs} <= {self.graph_max_bs} rows of one new token "
                             f"each, got query_lens {meta.query_lens}")
        if host.numel() != bs * self.graph_input_width(bs) or device.shape != host.shape:
            raise ValueError(f"the staging buffers hold {host.numel()} and {device.numel()} "
                             f"values; bucket {bs} needs {bs * self.graph_input_width(bs)}")
        indptr, indices, _ = self._pages(meta, self.graph_pages)
        staged = meta.seq_lens + indptr + indices
        host[:len(staged)] = torch.tensor(staged, dtype=torch.int32)
        self.seq_lens = device[:bs]
        self.kv_indptr = device[bs:2 * bs + 1]
        self.kv_indices = device[2 * bs + 1:2 * bs + 1 + bs * self.graph_pages]  # fixed size
        self.num_splits = decode_num_splits(bs, self.pool.layout.num_kv_heads,
                                            self.graph_pages * self.page_size, self.device)
        self.decode = True
        self.slot_mapping = meta.slot_mapping
        self.out = self.graph_out[:bs]
        return len(staged)

    # ---- per layer ------------------------------------------------------------------------------
    def run(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            rope: Rope | None = None, qk_norm: QKNorm | None = None) -> torch.Tensor:
        q = self.store(layer_id, q, k, v, rope, qk_norm=qk_norm)
        k_cache = self.pool.k_cache(layer_id)  # [P, S, Hkv, D]
        v_cache = self.pool.v_cache(layer_id)
        k_scale, v_scale = self.k_scales[layer_id], self.v_scales[layer_id]
        out = self.out if self.out is not None and self.out.dtype == q.dtype else None
        window = self.windows[layer_id]  # a kernel specialisation per window size
        if self.decode:
            return paged_decode_attention(q, k_cache, v_cache, self.kv_indptr, self.kv_indices,
                                          self.seq_lens, self.scale, out=out,
                                          num_splits=self.num_splits, k_scale=k_scale,
                                          v_scale=v_scale, window=window)  # [B, Hq, D]
        return paged_prefill_attention(q, k_cache, v_cache, self.qo_indptr, self.kv_indptr,
                                       self.kv_indices, self.seq_lens, self.scale, out=out,
                                       q_blocks=self.q_blocks, k_scale=k_scale,
                                       v_scale=v_scale, window=window)  # [T, Hq, D]
