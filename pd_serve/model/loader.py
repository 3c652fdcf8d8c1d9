"""Build a CausalLM from a Hugging Face checkpoint folder (single or sharded safetensors)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pd_serve.model.config import ModelConfig
from pd_serve.model.llama import CausalLM

logger = logging.getLogger(__name__)

# Hugging Face name fragment -> (our fused parameter, index of the part inside it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
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


def _split_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    if "qkv_proj" in fused:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [cfg.intermediate_size, cfg.intermediate_size]


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device,
               load_format: str = "auto", seed: int = 0) -> CausalLM:
    """Read config.json and the weights; every parameter must come from the checkpoint.

    load_format "dummy" reads config.json only and fills the weights with random values
    (see dummy_model): for speed benchmarks of a model's shape without its checkpoint.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"--model {model_dir}: no such directory")
    cfg = ModelConfig.from_dir(model_dir)
    if load_format == "dummy":
        return dummy_model(cfg, dtype, device, seed)
    model = _empty_model(cfg, dtype, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        for name, tensor in _read_tensors(path):
            _load_tensor(cfg, params, loaded, name, tensor, path)
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, "
                         f"e.g. {', '.join(missing[:3])}")
    return model.eval()


def dummy_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                seed: int = 0) -> CausalLM:
    """A model of cfg's shape with random weights: N(0, 0.02) matrices and embeddings (as
    Hugging Face initialises them), norm weights 1, biases 0. Deterministic for a seed."""
    model = _empty_model(cfg, dtype, device)
    generator = torch.Generator(device=torch.device(device)).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """Parameters allocated in `dtype` on `device` (values unset). The RoPE tables are built
    in float32 explicitly, so they stay float32."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model


def _read_tensors(path: Path):
    """Yield (name, tensor) from one safetensors file; a corrupt file is a ValueError naming it."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except Exception as e:  # safetensors raises its own SafetensorError, OSError, ...
        raise ValueError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from None


@torch.no_grad()
def _load_tensor(cfg, params, loaded, name, tensor, path) -> None:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return  # some tied checkpoints store the head anyway
    if "rotary_emb" in name:
        return
    target, part = name, None
    for hf, (ours, index) in _FUSED.items():
        if f".{hf}." in name:
            target, part = name.replace(hf, ours), index
    if target not in params:
        raise ValueError(f"{path}: unexpected tensor {name!r} for {cfg.architecture}")
    param = params[target]
    if part is not None:
        sizes = _split_sizes(cfg, target)
        param = param.narrow(0, sum(sizes[:part]), sizes[part])
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"config.json implies {tuple(param.shape)}")
    param.copy_(tensor)
    loaded.add(target if part is None else f"{target}#{part}")
    if part is not None and all(f"{target}#{i}" in loaded for i in range(len(_split_sizes(cfg, target)))):
        loaded.add(target)
