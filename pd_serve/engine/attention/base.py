"""The attention backend interface: plan() once per batch, run() once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels.kv_store import QKNorm, rope_store_kv, store_kv  # noqa: F401 (QKNorm: backends')
from pd_serve.cache.pool import KVPool

# RoPE still to apply to q and k: (positions [T], cos [max_pos, D], sin [max_pos, D]), as
# kernels/rope.py's apply_rope_ref_ takes them.
Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class AttentionMetadata:
    """One batch, sequences in order; its new tokens are concatenated along T.

    query_lens[i] new tokens of sequence i sit at the end of its seq_lens[i] tokens, which live in
    pages page_tables[i]. slot_mapping[t] is the cache slot (page_id * page_size + offset) that
    new token t writes its K and V to.
    """

    query_lens: list[int]
    seq_lens: list[int]
    page_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [T] int64

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class AttentionBackend(ABC):
    """Paged attention over a KVPool.

    Invariant: run() first stores the new tokens' K and V into the pool at slot_mapping, then
    attends causally over each sequence's whole context (cached prefix + new tokens). Given
    `rope`, q and k are not yet rotated: run() rotates q in place and stores the rotated k, in
    the same kernel as the store on GPU (k itself is left as it was). Given `qk_norm` too (Qwen3's
    per-head norms), q and k are normalised before they are rotated, in that kernel as well. A pool
    whose layout has K/V scales (FP8) holds k / k_scale and v / v_scale; run() returns the
    attention over the dequantised values.

    `dtype` is the activations' (q, k, v and the output); default the pool's, which differs
    from it for FP8 caches.

    `layer_windows[i]` > 0 makes layer i sliding-window attention: the query at position p sees
    the keys at p - window < j <= p (transformers' convention); 0 or omitted: the whole context.
    The window is a mask only: pages of keys that fell out of it stay allocated and stored.
    """

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype | None = None, layer_windows: tuple[int, ...] = ()):
        self.pool = pool
        self.windows = tuple(layer_windows) or (0,) * pool.layout.num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.dtype = dtype or pool.buffer.dtype
        layout = pool.layout
        self.k_scales = [layout.k_scale(i) for i in range(layout.num_layers)]
        self.v_scales = [layout.v_scale(i) for i in range(layout.num_layers)]

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Build this batch's index tensors; called once before the forward pass."""

    @abstractmethod
    def run(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            rope: Rope | None = None, qk_norm: QKNorm | None = None) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> attention output [T, Hq, D]."""

    def store(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rope: Rope | None, q_out: torch.Tensor | None = None,
              qk_norm: QKNorm | None = None) -> torch.Tensor:
        """The new tokens' K and V into the pool at slot_mapping; with rope, k rotated on the
        way and q rotated in place or into q_out (kernels/kv_store.py's rope_store_kv), both
        normalised first with qk_norm (which needs rope). Returns q as attention reads it: q,
        or q_out."""
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)
        k_scale, v_scale = self.k_scales[layer_id], self.v_scales[layer_id]
        if rope is None:
            if qk_norm is not None:
                raise ValueError("qk_norm is applied with RoPE: pass rope too")
            store_kv(k, v, k_cache, v_cache, self.slot_mapping, k_scale, v_scale)
            return q if q_out is None else q_out.copy_(q)
        positions, cos, sin = rope
        return rope_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, self.slot_mapping,
                             k_scale, v_scale, q_out, qk_norm)

    # CUDA graphs (decode batches only). A backend that supports them keeps every tensor run()
    # reads in buffers allocated once by init_cuda_graph() or in the runner's fixed input buffer;
    # plan_cuda_graph() refills them, so a graph captured after one plan_cuda_graph(bs, ...)
    # replays correctly after another.
    supports_cuda_graph = False

    def init_cuda_graph(self, max_bs: int, max_pages_per_seq: int) -> None:
        """Allocate the fixed buffers for decode batches of up to max_bs sequences."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def graph_input_width(self, bs: int) -> int:
        """int32 values per row that plan_cuda_graph(bs, ...) may stage for the runner to copy
        to the device (the rows' pages, say; the most a batch of bs can need); 0 when the
        backend copies its own inputs."""
        return 0

    def plan_cuda_graph(self, bs: int, meta: AttentionMetadata, host: torch.Tensor,
                        device: torch.Tensor) -> int:
        """Plan a decode batch of exactly bs rows (query_lens all 1) for the bucket-bs graph.

        meta.slot_mapping is a view of the runner's fixed input buffer; padded rows have slot -1
        (their K/V must not be stored) and a one-token context in page 0 (read, never written).
        host: pinned int32 [bs * graph_input_width(bs)] to fill with this batch's inputs; the
        runner copies it into `device` (same shape, the same address for every plan of bucket
        bs) in the step's one host->device copy, before the graph runs; run() may read views of
        `device`. After this call run() executes the bucket-bs graph path until the next plan*().
        Returns how many values it staged, from host's start: the runner copies only those.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
