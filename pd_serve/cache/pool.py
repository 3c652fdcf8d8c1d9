"""KV-cache pool tensors: K and V pages for every layer in one buffer (or, for multi-head
latent attention, one latent plane: each token's compressed KV and its rope key)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold num_tokens tokens."""
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class KVLayout:
    """Everything two workers must agree on before one writes KV pages into the other's pool."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32", "bfloat16", "float8_e4m3fn"
    # FP8 caches: per-layer K and V scales (a page holds k / k_scale); () means 1.0 everywhere.
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()
    # Planes a layer's pages have: 2 (K and V), or 1 for multi-head latent attention (model/
    # mla.py), whose one "head" per token is the latent and the rope key, K and V at once.
    num_planes: int = 2

    def __post_init__(self) -> None:  # lists (from JSON or msgpack) -> tuples of floats
        for name in ("k_scales", "v_scales"):
            scales = tuple(float(s) for s in getattr(self, name))
            if scales and len(scales) != self.num_layers:
                raise ValueError(f"{name} has {len(scales)} entries for {self.num_layers} layers")
            object.__setattr__(self, name, scales)

    def k_scale(self, layer_id: int) -> float:
        return self.k_scales[layer_id] if self.k_scales else 1.0

    def v_scale(self, layer_id: int) -> float:
        return self.v_scales[layer_id] if self.v_scales else 1.0

    @property
    def bytes_per_token(self) -> int:
        # dtype.itemsize, not a tensor's element_size(): this runs once a transfer (KVSender.send)
        itemsize = getattr(torch, self.dtype).itemsize
        return self.num_layers * self.num_planes * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size


class KVPool:
    """`buffer` is [num_layers, num_planes (K, V; or the latent), num_pages, page_size,
    num_kv_heads, head_dim].

    One page of one layer's K (or V) is contiguous, so a page is addressed as
    buffer[layer, kv, page_id] and a token slot as page_id * page_size + offset.
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str):
        self.layout = layout
        self.num_pages = num_pages
        self.buffer = torch.zeros(
            layout.num_layers, layout.num_planes, num_pages, layout.page_size,
            layout.num_kv_heads, layout.head_dim, dtype=getattr(torch, layout.dtype),
            device=device)  # [L, 2 (or 1), P, S, H, D]

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[layer_id, 0]  # [P, S, H, D]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[layer_id, 1]  # [P, S, H, D]

    def latent_cache(self, layer_id: int) -> torch.Tensor:
        """A latent pool's one plane (num_planes 1)."""
        return self.buffer[layer_id, 0]  # [P, S, 1, D]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
