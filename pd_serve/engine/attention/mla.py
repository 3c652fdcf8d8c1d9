"""Multi-head latent attention over a latent pool: in plain torch (the reference, and the CPU
backend), and on GPUs through the Triton MLA decode kernel.

The pool (num_planes 1, one KV head) holds per token c = [latent (R) | k_pe (Dr)], R =
kv_lora_rank. With kv_b_proj's rows split per head h into W_k[h] [Dn, R] (keys) and W_v[h]
[Dv, R] (values), head h's attention over a context c_1..c_L is

    score_j = q_nope . (W_k[h] latent_j) + q_pe . k_pe_j       (times the softmax scale)
    out     = W_v[h] sum_j softmax(score)_j latent_j

Decode rows (one new token) absorb W_k into the query, q_lat = W_k[h]^T q_nope [R], and attend
as MQA over the cached c with the query [q_lat | q_pe] and values latent_j, then apply W_v:
nothing per context token is expanded. Prefill rows expand their context into per-head keys
and values (kv_b_proj on the cached latents) and attend as multi-head attention, as
transformers computes it. Page tables and masks are the torch backend's (plan()).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kv_store import store_kv
from kernels.mla_decode import mla_decode_attention
from pd_serve.cache.pool import KVPool
from pd_serve.engine.attention.base import AttentionMetadata
from pd_serve.engine.attention.torch_backend import TorchAttentionBackend, rows_of_pages
from pd_serve.engine.attention.triton_backend import TritonAttentionBackend


class TorchMLABackend(TorchAttentionBackend):
    """plan() as TorchAttentionBackend; run_mla() per layer (run() is not used)."""

    def __init__(self, pool: KVPool, num_heads: int, kv_lora_rank: int, scale: float,
                 dtype: torch.dtype | None = None):
        if pool.layout.num_planes != 1 or pool.layout.num_kv_heads != 1:
            raise ValueError("MLA needs a latent pool (one plane, one KV head)")
        super().__init__(pool, num_heads, pool.layout.head_dim, scale, dtype)
        self.kv_lora_rank = kv_lora_rank

    def run(self, layer_id, q, k, v, rope=None):
        raise NotImplementedError("an MLA model calls run_mla()")

    def run_mla(self, layer_id: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                latent: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor) -> torch.Tensor:
        """Store the new tokens' [latent | k_pe], then attend.

        Parameters
        ----------
        q_nope : [T, H, Dn]; q_pe : [T, H, Dr], rotated.
        latent : [T, R], normed; k_pe : [T, Dr], rotated.
        kv_b_weight : [H * (Dn + Dv), R], kv_b_proj's weight.

        Returns
        -------
        [T, H, Dv]
        """
        R, (T, H, Dn) = self.kv_lora_rank, q_nope.shape
        pages = self.pool.latent_cache(layer_id)  # [P, S, 1, R + Dr]
        cache = pages.view(-1, self.head_dim)  # [slots, R + Dr]
        cache[self.slot_mapping] = torch.cat([latent, k_pe], dim=-1).to(cache.dtype)
        w = kv_b_weight.view(H, -1, R)  # [H, Dn + Dv, R]
        w_k, w_v = w[:, :Dn], w[:, Dn:]  # [H, Dn, R], [H, Dv, R]
        Dv = w_v.shape[1]
        out = q_nope.new_empty(T, H, Dv)
        if self.decode_token_ids:
            idx = self.decode_index
            q_lat = torch.einsum("bhd,hdr->bhr", q_nope[idx], w_k)  # [B, H, R]
            q = torch.cat([q_lat, q_pe[idx]], dim=-1).unsqueeze(2)  # [B, H, 1, R + Dr]
            kv = (rows_of_pages(pages, self.decode_pages.flatten())
                  .view(len(idx), 1, -1, self.head_dim).to(q.dtype))  # [B, 1, Lmax, R + Dr]
            o = F.scaled_dot_product_attention(q, kv, kv[..., :R], attn_mask=self.decode_masks[0],
                                               scale=self.scale, enable_gqa=True)  # [B, H, 1, R]
            out[idx] = torch.einsum("bhr,hvr->bhv", o.squeeze(2), w_v)
        for row in self.prefill_rows:
            end = row.start + row.num_new
            kv = rows_of_pages(pages, row.pages)[:row.seq_len, 0].to(q_nope.dtype)  # [L, R + Dr]
            kv_b = F.linear(kv[:, :R], kv_b_weight).view(len(kv), H, -1)  # [L, H, Dn + Dv]
            k_nope, v = kv_b.split([Dn, w_v.shape[1]], dim=-1)
            k = torch.cat([k_nope, kv[:, None, R:].expand(-1, H, -1)], dim=-1)  # [L, H, Dn + Dr]
            q = torch.cat([q_nope[row.start:end], q_pe[row.start:end]], dim=-1)  # [n, H, Dn + Dr]
            if q.is_cuda:  # V padded to the query's width: flash attention takes one head size
                v = F.pad(v, (0, q.shape[-1] - Dv))
            causal = row.num_new == len(kv)  # no cached prefix: SDPA's own causal kernels
            o = F.scaled_dot_product_attention(  # [1, H, n, Dv (or padded)], 4-D for the kernels
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=causal, attn_mask=None if causal else row.masks[0], scale=self.scale)
            out[row.start:end] = o[0, ..., :Dv].transpose(0, 1)
        return out


class TritonMLABackend(TritonAttentionBackend):
    """MLA on GPUs: a batch of decode rows (one new token each) attends through the Triton MLA
    decode kernel (kernels/mla_decode.py: MQA over the latent pages, each latent tile read once
    for keys and values), under CUDA graphs as the Triton backend plans them. A batch with a
    prefill chunk runs TorchMLABackend's path (the context expanded per head: dense attention
    with Dn + Dr dims, where absorption would attend with R + Dr per head)."""

    def __init__(self, pool: KVPool, num_heads: int, kv_lora_rank: int, scale: float,
                 dtype: torch.dtype | None = None):
        self.prefill = TorchMLABackend(pool, num_heads, kv_lora_rank, scale, dtype)  # checks pool
        super().__init__(pool, num_heads, pool.layout.head_dim, scale, dtype)
        self.kv_lora_rank = kv_lora_rank
        self.mixed = False  # this batch runs the prefill path

    def plan(self, meta: AttentionMetadata) -> None:
        self.mixed = any(n != 1 for n in meta.query_lens)
        if self.mixed:
            self.prefill.plan(meta)
        else:
            super().plan(meta)

    def init_cuda_graph(self, max_bs: int, max_pages_per_seq: int) -> None:
        super().init_cuda_graph(max_bs, max_pages_per_seq)
        # The kernel's output (attention over the latent, before W_v) is [B, H, R].
        self.graph_out = torch.empty(max_bs, self.num_heads, self.kv_lora_rank,
                                     dtype=self.dtype, device=self.device)

    def plan_cuda_graph(self, bs: int, meta: AttentionMetadata, host: torch.Tensor,
                        device: torch.Tensor) -> int:
        self.mixed = False
        return super().plan_cuda_graph(bs, meta, host, device)

    def run(self, layer_id, q, k, v, rope=None):
        raise NotImplementedError("an MLA model calls run_mla()")

    def run_mla(self, layer_id: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                latent: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor) -> torch.Tensor:
        """As TorchMLABackend.run_mla."""
        if self.mixed:
            return self.prefill.run_mla(layer_id, q_nope, q_pe, latent, k_pe, kv_b_weight)
        R, (B, H, Dn) = self.kv_lora_rank, q_nope.shape
        cache = self.pool.latent_cache(layer_id)  # [P, S, 1, R + Dr]
        entry = torch.cat([latent, k_pe], dim=-1).to(cache.dtype).unsqueeze(1)  # [B, 1, R + Dr]
        # keys and values are the one entry; store_kv skips padded graph rows (slot -1)
        store_kv(entry, entry, cache, cache, self.slot_mapping)
        w = kv_b_weight.view(H, -1, R)  # [H, Dn + Dv, R]
        w_k, w_v = w[:, :Dn], w[:, Dn:]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_k).transpose(0, 1)  # [B, H, R]: W_k absorbed
        q = torch.cat([q_lat, q_pe], dim=-1)  # [B, H, R + Dr]
        out = self.out if self.out is not None and self.out.dtype == q.dtype else None
        o = mla_decode_attention(q, cache, self.kv_indptr, self.kv_indices, self.seq_lens,
                                 self.scale, R, out=out)  # [B, H, R]
        return torch.bmm(o.transpose(0, 1), w_v.transpose(1, 2)).transpose(0, 1)  # [B, H, Dv]
