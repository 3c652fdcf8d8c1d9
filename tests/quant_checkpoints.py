"""Quantized checkpoints written by the tests from a full-precision one, in the layouts that
GPTQModel / AutoGPTQ (GPTQ) and llm-compressor / vLLM (FP8) write.

Every decoder linear layer (q/k/v/o, gate/up/down) is quantized; embeddings, norms, the LM
head and biases are copied as they are. Tokenizer files are copied along.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pd_serve.model import fp8
from pd_serve.model.gptq import quantize_rtn

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "special_tokens_map.json")


def _quantized_layers(src: Path):
    """(all tensors of the source checkpoint, names of the linear weights to quantize)."""
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(path))
    names = [n for n in tensors if n.startswith("model.layers.")
             and n.endswith(".weight") and n.split(".")[-2] in LINEARS]
    return tensors, names


def _write(src: Path, dst: Path, tensors: dict, quantization_config: dict | None) -> Path:
    """dst: the tensors, src's config.json with `quantization_config` (None: without one),
    src's tokenizer files."""
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def act_order_g_idx(in_features: int, group_size: int, seed: int) -> torch.Tensor:
    """A g_idx as GPTQ's act-order (desc_act) writes it: rows are quantized in a permuted
    order (by the Hessian's diagonal, here at random) and the i-th row so visited is in
    group i // group_size. int32 [in_features]."""
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32) // group_size
    return g_idx


def write_gptq_checkpoint(src: Path, dst: Path, *, group_size: int = 128, sym: bool = True,
                          desc_act: bool = False, checkpoint_format: str = "gptq") -> Path:
    """Round-to-nearest GPTQ 4-bit checkpoint: `<layer>.qweight/.qzeros/.scales/.g_idx` in
    place of `<layer>.weight`. desc_act: every layer gets a permuted (act-order) g_idx;
    the fused q/k/v and gate/up share theirs, as they share an input."""
    tensors, names = _quantized_layers(src)
    for name in names:
        prefix = name.removesuffix(".weight")
        w = tensors.pop(name)
        g_idx = None
        if desc_act:  # one permutation per input: q/k/v alike, gate/up alike
            kind = prefix.split(".")[-1]
            shared = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 1, "up_proj": 1}
            seed = int(prefix.split(".")[2]) * 10 + shared.get(kind, 2 + LINEARS.index(kind))
            g_idx = act_order_g_idx(w.shape[1], group_size, seed)
        qweight, qzeros, scales, g_idx = quantize_rtn(w, group_size, sym, g_idx=g_idx,
                                                      checkpoint_format=checkpoint_format)
        tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros,
                        f"{prefix}.scales": scales, f"{prefix}.g_idx": g_idx})
    return _write(src, dst, tensors, {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
        "sym": sym, "checkpoint_format": checkpoint_format})


def write_fp8_checkpoint(src: Path, dst: Path, *, layout: str = "compressed-tensors",
                         input_amax: float | None = None, experts_only: bool = False) -> Path:
    """FP8 checkpoint: `<layer>.weight` in float8_e4m3fn plus `<layer>.weight_scale`.
    experts_only: an MoE model's experts only (each expert's gate/up/down), the rest dense.

    layout "compressed-tensors": llm-compressor's FP8_DYNAMIC scheme, per-channel scales
    [out, 1]. layout "fp8": vLLM's quant_method fp8, one per-tensor scale per layer.
    input_amax: static activation scales, `input_scale` = input_amax / 448 for every layer
    (a stand-in for calibration); None: dynamic per-token scales.
    """
    static_activation = input_amax is not None
    tensors, names = _quantized_layers(src)
    for name in [n for n in names if ".experts." in n or not experts_only]:
        prefix = name.removesuffix(".weight")
        w = tensors.pop(name).float()
        if layout == "compressed-tensors":
            weight, scale = fp8.quantize_weight(w)
            scale = scale[:, None]  # [out, 1]
        else:
            scale = (w.abs().max() / fp8.FP8_MAX).reshape(())
            weight = (w / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
        tensors[name], tensors[f"{prefix}.weight_scale"] = weight, scale
        if static_activation:
            tensors[f"{prefix}.input_scale"] = torch.tensor([input_amax / fp8.FP8_MAX])
    if layout == "compressed-tensors":
        activations = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                        "symmetric": True} if static_activation else
                       {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                        "symmetric": True})
        config = {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "quantization_status": "compressed", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {
                      "targets": ["Linear"], "input_activations": activations,
                      "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                  "dynamic": False, "symmetric": True}}}}
    else:
        config = {"quant_method": "fp8",
                  "activation_scheme": "static" if static_activation else "dynamic"}
    return _write(src, dst, tensors, config)


def write_dequantized_checkpoint(quantized_dir: Path, dst: Path) -> Path:
    """The dense float32 checkpoint a GPTQ or FP8 checkpoint stands for: each layer's weight
    dequantized from its tensors as stored (GPTQ through `gptq.dequantize`, act-order g_idx
    and all; FP8 as weight * weight_scale), nothing else changed. FP8 input scales are
    dropped. The reference a loaded quantized model must reproduce."""
    from pd_serve.model.gptq import GPTQConfig, dequantize

    tensors = {}
    for path in sorted(quantized_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    for name in [n for n in tensors if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        parts = [tensors.pop(f"{prefix}.{t}") for t in ("qweight", "qzeros", "scales", "g_idx")]
        fmt = GPTQConfig.from_dir(quantized_dir).checkpoint_format
        tensors[f"{prefix}.weight"] = dequantize(*parts, dtype=torch.float32, checkpoint_format=fmt)
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        prefix = name.removesuffix(".weight_scale")
        scale = tensors.pop(name).float().reshape(-1, 1)  # [out, 1] or [1, 1]
        tensors[f"{prefix}.weight"] = tensors[f"{prefix}.weight"].float() * scale
        tensors.pop(f"{prefix}.input_scale", None)
    return _write(quantized_dir, dst, tensors, None)
