"""FP8 KV cache: what `--kv-cache-dtype` means, and the per-layer K/V scales.

An FP8 page holds k / k_scale (and v / v_scale), saturated to the format's largest finite value
(e4m3: +-448, 3 mantissa bits; e5m2: +-57344, 2 mantissa bits), never inf or NaN. Attention
multiplies the scales back: every backend folds k_scale into the softmax scale and multiplies
its output by v_scale, which equals dequantising K and V first, without touching every element.

Scales are per tensor: one k_scale and one v_scale per layer. They come from the checkpoint
when it has them (the names vLLM reads: model/checkpoint.py; a per-head tensor is reduced to its max, which
covers every head), else they are 1.0 with a warning, as in vLLM for a bf16 checkpoint. They
travel in the KVLayout, so a prefill and a decode worker that disagree on them (or on the KV
dtype) fail their handshake instead of reading each other's pages wrongly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pd_serve.model.checkpoint import checkpoint_files, read_checkpoint_kv_scales

logger = logging.getLogger(__name__)

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for `--kv-cache-dtype name` (auto: the model's)."""
    if name == "auto":
        return model_dtype
    if name not in FP8_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} must be one of auto, {', '.join(FP8_DTYPES)}")
    return FP8_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def load_kv_scales(model_dir: Path, num_layers: int, dtype: torch.dtype,
                   flag: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(k_scales, v_scales) for a cache of `dtype`: () and () unless it is FP8; else one per
    layer, from the checkpoint in model_dir where it has them, 1.0 (with a warning) where not.
    `flag` names the setting in messages (e.g. "--kv-cache-dtype fp8_e4m3")."""
    if not is_fp8(dtype):
        return (), ()
    try:
        files = checkpoint_files(model_dir)
    except ValueError:  # no safetensors (--load-format dummy with a bare config.json)
        files = []
    found = read_checkpoint_kv_scales(files)
    if any(layer >= num_layers for layer, _ in found):
        raise ValueError(f"{model_dir}: KV scales name layer {max(l for l, _ in found)}; the model "
                         f"has {num_layers} layers")
    k_scales = tuple(found.get((i, "k"), 1.0) for i in range(num_layers))
    v_scales = tuple(found.get((i, "v"), 1.0) for i in range(num_layers))
    fmax = torch.finfo(dtype).max
    if not found:
        logger.warning("%s: the checkpoint has no k_scale/v_scale tensors; using scale 1.0 for "
                       "every layer (K/V values beyond +-%g saturate)", flag, fmax)
    elif len(found) < 2 * num_layers:
        logger.warning("%s: the checkpoint has KV scales for %d of %d K/V tensors; the rest use "
                       "1.0", flag, len(found), 2 * num_layers)
    else:
        logger.info("%s: per-layer K/V scales from the checkpoint (k %.3g-%.3g, v %.3g-%.3g)",
                    flag, min(k_scales), max(k_scales), min(v_scales), max(v_scales))
    return k_scales, v_scales
