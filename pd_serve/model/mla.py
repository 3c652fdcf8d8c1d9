"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention.

A token's keys and values come from one compressed latent: kv_a_proj_with_mqa maps the hidden
state to [latent (kv_lora_rank) | k_pe (qk_rope_head_dim)], the latent is RMS-normed, and
kv_b_proj expands it into every head's k_nope (qk_nope_head_dim) and v (v_head_dim); k_pe is
one rope key all heads share. Queries come from q_proj, or through the low-rank q_a_proj ->
q_a_layernorm -> q_b_proj when q_lora_rank is set; each head's query is [q_nope | q_pe].

The KV pool holds the latent and the rotated k_pe only (kv_lora_rank + qk_rope_head_dim values
per token and layer, 576 for V3's shape): the attention backend (engine/attention/mla.py)
expands or absorbs kv_b_proj itself. Parameter names are transformers'.

Rope: DeepSeek rotates (even, odd) pairs of the rope dims (V2 always; V3 where rope_interleave
says, else halves as Llama). We write the pairs' results de-interleaved, [even' | odd'], as
transformers' V3 does: q_pe and k_pe are permuted alike, so their products are unchanged.
YaRN's mscale multiplies cos and sin (model/rope.py) and, squared, the softmax scale.
"""

from __future__ import annotations

import torch
from torch import nn

from pd_serve.engine.attention.base import AttentionBackend
from pd_serve.model.config import ModelConfig
from pd_serve.model.layers import Linear, RMSNorm
from pd_serve.model.rope import RotaryEmbedding, yarn_mscale


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """(qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """x [T, H, D] rotated at positions [T]; cos/sin [max_pos, D] (cat(freqs, freqs))."""
    half = x.shape[-1] // 2
    c = cos[positions, :half].unsqueeze(1).to(x.dtype)  # [T, 1, D/2]
    s = sin[positions, :half].unsqueeze(1).to(x.dtype)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' default eps
            self.q_b_proj = Linear(cfg.q_lora_rank, cfg.num_heads * qk_head_dim, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                         bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(cfg.kv_lora_rank,
                                cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        cfg = self.cfg
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank
             else self.q_proj(x))
        q = q.view(-1, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)  # [T, H, Dn+Dr]
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim],
                                                        dim=-1)  # [T, R], [T, Dr]
        latent = self.kv_a_layernorm(latent)
        q_pe = apply_rope(q_pe, positions, rope.cos, rope.sin, cfg.rope_interleave)
        k_pe = apply_rope(k_pe.unsqueeze(1), positions, rope.cos, rope.sin, cfg.rope_interleave)
        out = attn.run_mla(self.layer_id, q_nope, q_pe, latent, k_pe.squeeze(1),
                           self.kv_b_proj.weight)  # [T, H, Dv]
        return self.o_proj(out.reshape(-1, cfg.num_heads * cfg.v_head_dim))
