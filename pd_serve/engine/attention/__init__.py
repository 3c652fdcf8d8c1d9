"""Attention backends behind one plan()/run() interface, and the --attention-backend choice."""

from __future__ import annotations

import importlib.util
import os

import torch

from pd_serve.cache.pool import KVPool
from pd_serve.engine.attention.base import AttentionBackend


FLASHINFER_HEAD_DIMS = (64, 128, 256)  # what flashinfer's kernels (its state merge) are built for


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype,
                         head_dim: int = 128, layer_windows: tuple[int, ...] = ()) -> str:
    """The backend `--attention-backend name` means on this device; a clear ValueError if it
    cannot run here. auto: flashinfer on CUDA (bf16/fp16, head_dim 64/128/256, one attention
    window for every layer) when installed, else triton; torch on CPU."""
    on_cuda = device.type == "cuda"
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    has_triton = importlib.util.find_spec("triton") is not None
    mixed_windows = len(set(layer_windows)) > 1  # flashinfer plans one window per batch
    if name == "auto":
        if not on_cuda:
            return "torch"
        if (has_flashinfer and dtype in (torch.bfloat16, torch.float16)
                and head_dim in FLASHINFER_HEAD_DIMS and not mixed_windows):
            return "flashinfer"
        return "triton" if has_triton else "torch"
    if name == "flashinfer":
        if not on_cuda:
            raise ValueError("--attention-backend flashinfer needs a CUDA device; use torch on CPU")
        if not has_flashinfer:
            raise ValueError("--attention-backend flashinfer: the flashinfer package is not "
                             "installed (pip install flashinfer-python); or use triton or torch")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"--attention-backend flashinfer runs bfloat16/float16, not {dtype}; "
                             "use --dtype bfloat16, or --attention-backend triton or torch")
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(f"--attention-backend flashinfer supports head_dim "
                             f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}, not this model's "
                             f"{head_dim}; use --attention-backend triton or torch")
        if mixed_windows:
            raise ValueError("--attention-backend flashinfer: this model mixes sliding-window "
                             "and full-attention layers (or windows of several sizes), which "
                             "this backend does not run; use --attention-backend triton or torch")
    if name == "triton":
        if not has_triton:
            raise ValueError("--attention-backend triton: the triton package is not installed")
        if not on_cuda and os.environ.get("PD_SERVE_TRITON_CPU") != "1":
            raise ValueError("--attention-backend triton needs a CUDA device (or "
                             "PD_SERVE_TRITON_CPU=1 with TRITON_INTERPRET=1 to run it in Triton's "
                             "interpreter); use torch on CPU")
    return name


def create_backend(name: str, pool: KVPool, num_heads: int, head_dim: int, scale: float,
                   dtype: torch.dtype | None = None, batch1_kernels: bool = False,
                   layer_windows: tuple[int, ...] = ()) -> AttentionBackend:
    """Instantiate a resolved backend name (see resolve_backend_name); dtype: the activations'
    (default the pool's; pass it when the KV cache is FP8); batch1_kernels: flashinfer hands
    one-row decode to the Triton kernel (--enable-batch1-kernels); layer_windows: each layer's
    sliding window, 0 for full attention (ModelConfig.layer_windows; AttentionBackend)."""
    if name == "flashinfer":
        from pd_serve.engine.attention.flashinfer_backend import FlashInferAttentionBackend
        return FlashInferAttentionBackend(pool, num_heads, head_dim, scale, dtype, batch1_kernels,
                                          layer_windows)
    if name == "triton":
        from pd_serve.engine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(pool, num_heads, head_dim, scale, dtype, layer_windows)
    from pd_serve.engine.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend(pool, num_heads, head_dim, scale, dtype, layer_windows)
