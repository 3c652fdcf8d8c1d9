"""Rotary position embedding (rotate-half layout, as Hugging Face Llama/Qwen), with linear and llama3 scaling."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, after the checkpoint's rope scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_positions, built once; the attention
    backends apply them (kernels/kv_store.py's rope_store_kv)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
