"""What a checkpoint folder holds: its safetensors files, and which of its tensors are KV-cache
scales (by the names vLLM, NVIDIA ModelOpt and compressed-tensors give them). The loader skips
those tensors (they are cache settings, not weights); the FP8 KV cache reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors import safe_open

# model.layers.N.self_attn.<suffix>: which of K and V the scalar scales.
_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$")
_SCALE_SUFFIXES = {
    "k_scale": "k", "v_scale": "v",  # vLLM's current names
    "kv_scale": "kv",  # vLLM's older name: one scale for both
    "attn.k_scale": "k", "attn.v_scale": "v",  # vLLM's module path
    "k_proj.k_scale": "k", "v_proj.v_scale": "v",  # NVIDIA ModelOpt
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",  # compressed-tensors
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, or model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no model.safetensors (or index) found; "
                             "pd-serve loads Hugging Face safetensors checkpoints")
    for f in files:
        if not f.is_file():
            raise ValueError(f"{f}: missing (named by {index.name})")
    return files


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when a checkpoint tensor name is a KV-cache scale, else None.
    (A checkpoint loader skips these names: they are cache settings, not weights.)"""
    match = _SCALE_NAME.match(name)
    if match is None or match.group(2) not in _SCALE_SUFFIXES:
        return None
    return int(match.group(1)), _SCALE_SUFFIXES[match.group(2)]


def read_checkpoint_kv_scales(files: list[Path]) -> dict[tuple[int, str], float]:
    """{(layer, "k" | "v"): scale} for every KV scale the safetensors files hold (headers are
    read for the names; only the scale tensors themselves are loaded)."""
    found: dict[tuple[int, str], float] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = kv_scale_target(name)
                if target is None:
                    continue
                values = f.get_tensor(name).float().flatten()  # [1], or [Hkv] per head
                scale = float(values.max()) if values.numel() else float("nan")
                if not (scale > 0 and scale != float("inf")):
                    raise ValueError(f"{path}: KV scale {name!r} is {scale}; it must be finite "
                                     "and > 0")
                layer, which = target
                for kv in ("k", "v") if which == "kv" else (which,):
                    found[(layer, kv)] = scale
    return found
