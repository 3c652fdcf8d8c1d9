"""Paged attention through flashinfer (GPU, bf16/fp16): its prefill and decode wrappers over our pool.

flashinfer reads the pool in place: one layer's K and V are [P, S, Hkv, D] tensors, its "NHD"
paged layout, addressed through a CSR page table (indptr over rows, page indices, the number
of tokens used in each row's last page). New tokens' K/V are stored first by kernels/kv_store.

Batches where every row has one new token run the decode wrapper; any other batch runs a
prefill wrapper (causal, with the cached prefix: chunked prefill, and decode rows mixed in):
flashinfer's default (FA3 on Hopper) when every row is a prompt chunk, its FA2 kernels when
decode rows are mixed in. FA3's paged kernels read the cache one token at a time (page ids are
turned into token offsets on every call), which makes a decode row's long context slow: on an
H200, a 1920-token chunk with 128 decode rows of 2048 tokens (Llama-3.1-8B shape) takes 94 ms
a step on FA3, 41 ms of it in attention, and 64 ms on FA2. For prompts alone FA3 is as fast or
faster.
CUDA graphs use one decode wrapper per captured batch size, each in flashinfer's CUDA-graph
mode over fixed page-table buffers shared by all sizes; plan_cuda_graph() refills them.

With batch1_kernels (--enable-batch1-kernels), decode of a single row runs our Triton kernel
instead (kernels/paged_attention.py, through a TritonAttentionBackend over the same pool),
which rounds differently from flashinfer's batched decode. On an H200 with Llama-3.1-8B's
heads, per layer under a CUDA graph: 8.5 / 12.1 / 15.7 us at 1k / 4k / 8k context against
10.4 / 14.4 / 18.4 us for flashinfer's tensor-core decode and its state merge, both
latency-bound at batch 1.

A sliding window (Mistral v0.1; one window for every layer, resolve_backend_name sends models
that mix windows to triton) is flashinfer's window_left, the window less the query itself.

FP8 pools: plan() passes the pool's dtype as kv_data_type (q stays bf16/fp16) and run() passes
the layer's k_scale / v_scale, which flashinfer folds into sm_scale and multiplies onto the
output (v_scale only when it is not 1). The prefill wrapper is pinned to the FA2 kernels then:
they read FP8 K/V with a 16-bit query, which FA3 kernels of this flashinfer version may not.
(Written against flashinfer 0.5.3.)
"""

from __future__ import annotations

import os

import torch

from pd_serve.cache.pool import KVPool, pages_for
from pd_serve.engine.attention.base import AttentionBackend, AttentionMetadata, QKNorm, Rope
from pd_serve.engine.attention.triton_backend import TritonAttentionBackend

WORKSPACE_BYTES = 256 * 2**20  # split-k partial results; flashinfer recommends 128 MiB or more
TENSOR_CORES_ENV = "PD_SERVE_FLASHINFER_TENSOR_CORES"


def decode_uses_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """Whether the decode kernels run on tensor cores: $PD_SERVE_FLASHINFER_TENSOR_CORES
    (1/true/on or 0/false/off) when set, else from a GQA group of 4 query heads per KV head
    up, where they pay off (SGLang's env override is SGLANG_FLASHINFER_USE_TENSOR_CORE)."""
    value = os.environ.get(TENSOR_CORES_ENV)
    if value is None or value == "":
        return num_heads // num_kv_heads >= 4
    if value.lower() in ("1", "true", "on", "yes"):
        return True
    if value.lower() in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{TENSOR_CORES_ENV}={value!r}: use 1/true/on or 0/false/off (unset: by "
                     "GQA group size)")


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype | None = None, batch1_kernels: bool = False,
                 layer_windows: tuple[int, ...] = ()):
        super().__init__(pool, num_heads, head_dim, scale, dtype, layer_windows)  # self.dtype: q's
        if len(set(self.windows)) > 1:
            raise ValueError("flashinfer plans one attention window per batch; this model's "
                             "layers differ (sliding and full): use the triton backend")
        # flashinfer's window_left counts the keys before the query: window - 1; -1: all.
        self.window_left = self.windows[0] - 1 if self.windows[0] else -1
        import flashinfer

        self._flashinfer = flashinfer
        device = pool.buffer.device
        self.num_kv_heads = pool.layout.num_kv_heads
        self.page_size = pool.layout.page_size
        self.kv_dtype = pool.buffer.dtype
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.use_tensor_cores = decode_uses_tensor_cores(num_heads, self.num_kv_heads)
        prefill_backend = "fa2" if self.kv_dtype.itemsize == 1 else "auto"
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_backend)
        self.mixed_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(  # decode rows mixed in
            self.workspace, "NHD", backend="fa2")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
        self.graph_wrappers: dict[int, object] = {}
        self.one_row = (TritonAttentionBackend(pool, num_heads, head_dim, scale, dtype,
                                               layer_windows) if batch1_kernels else None)
        self.wrapper = None  # the one run() uses, chosen by the last plan*()
        self.delegate: TritonAttentionBackend | None = None  # one_row, when it runs this batch
        self.is_prefill = False

    # ---- planning ---------------------------------------------------------------------------
    def _page_table(self, meta: AttentionMetadata):
        """int32 CSR page table: indptr [B+1], indices [sum pages], last_page_len [B].

        indptr and last_page_len stay on the host (page-locked: flashinfer plans from them and
        its copies queue without a wait). indices go to the device here: a CUDA-graph wrapper
        copies host indices into its buffer with a blocking copy, which would wait for the step
        in flight and undo the overlap schedule."""
        page_size = self.page_size
        num_pages = [pages_for(n, page_size) for n in meta.seq_lens]
        indices: list[int] = []
        for pages, n in zip(meta.page_tables, num_pages):
            indices += pages[:n]
        indptr = [0]
        for n in num_pages:
            indptr.append(indptr[-1] + n)
        last = [n - (p - 1) * page_size for n, p in zip(meta.seq_lens, num_pages)]
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32).pin_memory()  # noqa: E731
        device = self.pool.buffer.device
        return as_i32(indptr), as_i32(indices).to(device, non_blocking=True), as_i32(last)

    def _plan_decode(self, wrapper, meta: AttentionMetadata) -> None:
        indptr, indices, last = self._page_table(meta)
        wrapper.plan(indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.page_size, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                     sm_scale=self.scale, window_left=self.window_left)

    def plan(self, meta: AttentionMetadata) -> None:
        self.slot_mapping = meta.slot_mapping
        self.is_prefill = any(n != 1 for n in meta.query_lens)
        self.delegate = None
        if self.one_row is not None and meta.query_lens == [1]:
            self.one_row.plan(meta)
            self.delegate = self.one_row
            return
        if not self.is_prefill:
            self._plan_decode(self.decode_wrapper, meta)
            self.wrapper = self.decode_wrapper
            return
        indptr, indices, last = self._page_table(meta)
        qo_indptr = [0]
        for n in meta.query_lens:
            qo_indptr.append(qo_indptr[-1] + n)
        wrapper = self.mixed_wrapper if 1 in meta.query_lens else self.prefill_wrapper
        wrapper.plan(
            torch.tensor(qo_indptr, dtype=torch.int32).pin_memory(), indptr, indices, last, self.num_heads,
            self.num_kv_heads, self.head_dim, self.page_size, causal=True, sm_scale=self.scale,
            q_data_type=self.dtype, kv_data_type=self.kv_dtype, window_left=self.window_left)
        self.wrapper = wrapper

    # ---- CUDA graphs ------------------------------------------------------------------------
    def init_cuda_graph(self, max_bs: int, max_pages_per_seq: int) -> None:
        device = self.pool.buffer.device
        self.graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.graph_indices = torch.zeros(max_bs * max_pages_per_seq, dtype=torch.int32, device=device)
        self.graph_last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=device)
        if self.one_row is not None:
            self.one_row.init_cuda_graph(1, max_pages_per_seq)

    def graph_input_width(self, bs: int) -> int:
        return self.one_row.graph_input_width(1) if self.one_row is not None and bs == 1 else 0

    def plan_cuda_graph(self, bs: int, meta: AttentionMetadata, host: torch.Tensor,
                        device: torch.Tensor) -> int:
        if self.one_row is not None and bs == 1:
            self.delegate = self.one_row
            self.is_prefill = False
            return self.one_row.plan_cuda_graph(1, meta, host, device)
        self.delegate = None
        wrapper = self.graph_wrappers.get(bs)
        if wrapper is None:
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self.graph_indptr[:bs + 1],
                paged_kv_indices_buffer=self.graph_indices,
                paged_kv_last_page_len_buffer=self.graph_last_page_len[:bs])
            self.graph_wrappers[bs] = wrapper
        self._plan_decode(wrapper, meta)
        self.slot_mapping = meta.slot_mapping
        self.is_prefill = False
        self.wrapper = wrapper
        return 0  # the wrapper copied its own inputs

    # ---- per layer --------------------------------------------------------------------------
    def run(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            rope: Rope | None = None, qk_norm: QKNorm | None = None) -> torch.Tensor:
        if self.delegate is not None:
            return self.delegate.run(layer_id, q, k, v, rope, qk_norm)
        # flashinfer reads q contiguous (q is a view into qkv): the rotation writes it so.
        q = self.store(layer_id, q, k, v, rope, torch.empty(q.shape, dtype=q.dtype, device=q.device),
                       qk_norm)
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)  # [P, S, Hkv, D]
        k_scale, v_scale = self.k_scales[layer_id], self.v_scales[layer_id]
        return self.wrapper.run(q, (k_cache, v_cache), k_scale=k_scale,
                                v_scale=None if v_scale == 1.0 else v_scale)  # [T, Hq, D]
