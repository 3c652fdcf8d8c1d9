"""Rotary position embedding (rotate-half layout, as Hugging Face Llama/Qwen), with linear,
llama3 and YaRN scaling (YaRN as DeepSeek-V2/V3 configure it, with its mscale)."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, after the checkpoint's rope scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
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


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float,
                   scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    slowed by `factor`, those above beta_fast kept, a linear ramp between (transformers' yarn)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: slow it by factor
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict) -> float:
    """What YaRN multiplies cos and sin by (1.0 for other kinds)."""
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = (scaling["factor"], scaling.get("mscale"),
                                      scaling.get("mscale_all_dim"))
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_positions, built once; the attention
    backends apply them (kernels/kv_store.py's rope_store_kv)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)
