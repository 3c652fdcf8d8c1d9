"""Build a CausalLM from a Hugging Face checkpoint folder (single or sharded safetensors).

MoE experts: per-expert tensors (`experts.E.gate_proj` / `up_proj` / `down_proj`, Mixtral's
`block_sparse_moe.experts.E.w1` / `w3` / `w2`) are stacked into the block's fused
`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (moe.py); checkpoints that
store them fused already load as they are.

Quantized checkpoints (GPTQ, FP8; see quant.py) get their decoder linear layers replaced by
quantized ones before any weight is allocated, and load those from the quantized tensors.
FP8 reaches the experts too (moe.py): `--quantization fp8` quantizes them at load, and an FP8
checkpoint's per-expert `weight` + `weight_scale` load into FP8 experts (their `input_scale`s
are not used: the experts run weight-only).
Block-wise FP8 checkpoints (weight_block_size, DeepSeek-V3 / Qwen3-FP8) load their decoder
and MLA projections as quant.Fp8BlockLinear (MLA's kv_b_proj then dequantized: attention
reads its weight) and dequantize their routed experts to the model dtype (_load_checkpoint).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pd_serve.model.checkpoint import checkpoint_files, kv_scale_target
from pd_serve.model.config import ModelConfig
from pd_serve.model.llama import CausalLM
from pd_serve.model.moe import Experts, SparseMoeBlock
from kernels import fp8_block_gemm as block_gemm
from pd_serve.model.quant import Fp8BlockLinear, QuantLinear, QuantMethod, quantization_method
from pd_serve.model.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

# Hugging Face name fragment -> (our fused parameter, index of the part inside it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
}
# One expert's tensor: (prefix, expert, its name); the name -> (our stacked parameter, part).
_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale|weight_scale_inv|input_scale)$")
_EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
                 "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
                 "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
# A decoder layer's linear layers (our names): what quantization replaces, where the layer
# has them (an MoE layer: attention and the shared expert; its router stays dense).
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
            "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj")
# MLA's projections (block-wise FP8 checkpoints); kv_b_proj is dequantized once loaded, as
# the attention backend reads its weight itself (absorption).
_MLA_LINEARS = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj",
                "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj")
# A checkpoint's FP8 expert scale: the layer it belongs to.
_FP8_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.\d+\.\w+\.weight_scale$")


def _split_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    if "qkv_proj" in fused:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    if "shared_expert" in fused:
        return [cfg.shared_expert_intermediate_size] * 2
    return [cfg.intermediate_size, cfg.intermediate_size]


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device,
               load_format: str = "auto", seed: int = 0,
               quantization: str | None = None) -> CausalLM:
    """Read config.json and the weights; every parameter must come from the checkpoint.

    load_format "dummy" reads config.json only and fills the weights with random values
    (see dummy_model): for speed benchmarks of a model's shape without its checkpoint.
    quantization: `--quantization` (None: as the checkpoint says; see quant.py). A model
    quantized at load (fp8 on a dense checkpoint, or dummy weights) is loaded dense first, so
    it needs the dense model's memory once; a quantized checkpoint never does.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"--model {model_dir}: no such directory")
    cfg = ModelConfig.from_dir(model_dir)
    method = quantization_method(model_dir, quantization)
    if method is not None and cfg.is_mla and not (method.block_wise and method.checkpoint_quantized):
        raise ValueError(f"{model_dir}: {cfg.architecture} (multi-head latent attention) runs "
                         f"unquantized or from a block-wise FP8 checkpoint only; quantization {method.name} "
                         "is not supported for it yet")
    if method is not None and method.name != "fp8" and cfg.num_experts:
        raise ValueError(f"{model_dir}: {cfg.architecture} is a mixture of experts; quantization "
                         f"{method.name} runs dense models only (fp8 runs both)")
    keep_dense = torch.device(device).type != "cuda"  # quantized layers run their reference
    if load_format == "dummy" or method is None or not method.checkpoint_quantized:
        model = (dummy_model(cfg, dtype, device, seed) if load_format == "dummy"
                 else _load_checkpoint(model_dir, cfg, _empty_model(cfg, dtype, device)))
        if method is not None:
            _replace_linears(model, lambda prefixes, linear, sizes:
                             method.quantize_linear(linear, sizes, keep_dense))
            for experts in [m for m in model.modules() if isinstance(m, Experts)]:
                experts.quantize_fp8()
        return model
    files = checkpoint_files(model_dir)
    keys = {_our_name(name) for path in files for name in _tensor_names(path)}

    def replace(m: CausalLM) -> None:
        _replace_linears(m, lambda prefixes, linear, sizes: _checkpoint_linear(
            method, keys, prefixes, linear, sizes, dtype), mla=cfg.is_mla)
        _fp8_experts(m, {int(x.group(1)) for x in map(_FP8_EXPERT.match, keys) if x})

    model = _empty_model(cfg, dtype, device, replace)
    model = _load_checkpoint(model_dir, cfg, model, files,
                             method.config.weight_block_size if method.block_wise else None)
    for name, layer in model.named_modules():
        if isinstance(layer, QuantLinear):
            try:
                layer.finish_loading(keep_dense)
            except ValueError as e:
                raise ValueError(f"{model_dir}: {name}: {e}") from None
    for attn in [layer.self_attn for layer in model.model.layers] if cfg.is_mla else []:
        if isinstance(attn.kv_b_proj, Fp8BlockLinear):
            attn.kv_b_proj = attn.kv_b_proj.to_dense()
    return model


def _load_checkpoint(model_dir: Path, cfg: ModelConfig, model: CausalLM,
                     files: list[Path] | None = None,
                     block: tuple[int, int] | None = None) -> CausalLM:
    """Fill every parameter (and every quantized layer) of `model` from the checkpoint.

    block: a block-wise FP8 checkpoint's weight_block_size. Its experts are dequantized to
    the model dtype as each expert's weight and weight_scale_inv are both read: the fused MoE
    kernel takes per-channel FP8 scales only, and requantizing per channel would add a second
    rounding (at DeepSeek-V3's size the dense experts do not fit; block scales in the fused MoE
    are the way there)."""
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    params = {n: p for n, p in model.named_parameters() if n.rpartition(".")[0] not in quant}
    loaded: set[str] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}  # block-wise experts: prefix -> tensors
    if block is not None and cfg.num_experts:
        logger.info("block-wise FP8 experts are dequantized to the model dtype at load (the "
                    "fused MoE takes per-channel FP8 scales only)")
    for path in files or checkpoint_files(model_dir):
        for name, tensor in _read_tensors(path):
            if block is not None and (expert := _EXPERT.match(_our_name(name))) is not None:
                if expert.group(4) == "input_scale":
                    continue
                if expert.group(4) == "weight_scale":
                    raise ValueError(f"{path}: tensor {name!r}: a per-channel scale in a "
                                     "block-wise FP8 checkpoint (weight_scale_inv expected)")
                prefix, what = name.rsplit(".", 1)
                pending.setdefault(prefix, {})[what] = tensor
                if len(pending[prefix]) < 2:
                    continue
                tensors = pending.pop(prefix)
                name, tensor = f"{prefix}.weight", block_gemm.dequantize_blocks(
                    tensors["weight"], tensors["weight_scale_inv"], block)
            _load_tensor(cfg, params, loaded, name, tensor, path, quant)
    if pending:
        raise ValueError(f"{model_dir}: block-wise FP8 experts lack a weight or its "
                         f"weight_scale_inv, e.g. {next(iter(pending))}")
    missing = [n for n in params if n not in loaded]
    missing += [f"{n}.{t}" for n, layer in quant.items() for t in layer.missing()]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, "
                         f"e.g. {', '.join(missing[:3])}")
    return model.eval()


def _replace_linears(model: CausalLM, make, mla: bool = False) -> None:
    """Swap each decoder linear layer for `make(hf_prefixes, linear, out_sizes)` unless that
    returns None. hf_prefixes: the checkpoint's layers fused into it, in order. mla: MLA's
    projections too."""
    cfg = model.config
    for i, layer in enumerate(model.model.layers):
        for ours in _LINEARS + (_MLA_LINEARS if mla else ()):
            parent_name, _, attr = ours.rpartition(".")
            parent = layer
            for part in parent_name.split("."):
                parent = getattr(parent, part, None)
            linear = getattr(parent, attr, None)
            if not isinstance(linear, nn.Linear):  # not in this layer (MoE or dense)
                continue
            hf = sorted((index, name) for name, (fused, index) in _FUSED.items() if fused == ours)
            prefixes = [f"model.layers.{i}.{name}" for _, name in hf] or [f"model.layers.{i}.{ours}"]
            sizes = _split_sizes(cfg, ours) if hf else [linear.out_features]
            new = make(prefixes, linear, sizes)
            if new is not None:
                setattr(parent, attr, new)


def _fp8_experts(model: CausalLM, layer_ids: set[int]) -> None:
    """FP8 experts (empty) in the MoE layers `layer_ids`: those whose checkpoint stores them
    with weight scales."""
    cfg = model.config
    for i in sorted(layer_ids):
        block = model.model.layers[i].mlp if i < cfg.num_layers else None
        if not isinstance(block, SparseMoeBlock):
            raise ValueError(f"layer {i}: FP8 expert scales in the checkpoint, but config.json "
                             "gives that layer no experts")
        block.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                fp8=True)


def _checkpoint_linear(method: QuantMethod, keys: set[str], prefixes: list[str],
                       linear: nn.Linear, sizes: list[int], dtype: torch.dtype):
    """An empty quantized layer where the checkpoint stores the layer quantized, else None."""
    stored = [method.in_checkpoint(p, keys) for p in prefixes]
    if not any(stored):
        return None
    if not all(stored):
        raise ValueError(f"{', '.join(prefixes)} are fused into one layer, but only some are "
                         f"quantized ({method.name}) in the checkpoint")
    return method.empty_linear(linear.in_features, sizes, linear.bias is not None, dtype)


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


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                 replace_linears=None) -> CausalLM:
    """Parameters allocated in `dtype` on `device` (values unset). The RoPE tables are built
    in float32 explicitly, so they stay float32.

    replace_linears(model), if given, swaps layers before anything is allocated: the model is
    built on the meta device, then materialised, and the computed (non-persistent) buffers,
    the RoPE tables, are built again on `device`.
    """
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if replace_linears is None:
            with torch.device(device):
                model = CausalLM(cfg)
        else:
            with torch.device("meta"):
                model = CausalLM(cfg)
                replace_linears(model)
            model.to_empty(device=device)
            with torch.device(device):
                model.rope = RotaryEmbedding(cfg.rope_dim, cfg.max_position_embeddings,
                                             cfg.rope_theta, cfg.rope_scaling)
            computed = [f"{n}.{b}" for n, m in model.named_modules() if n != "rope"
                        for b in m._non_persistent_buffers_set if getattr(m, b) is not None]
            if computed:  # a new computed buffer needs rebuilding here too
                raise RuntimeError(f"buffers {computed} were not rebuilt after a meta build")
    finally:
        torch.set_default_dtype(default)
    return model


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as e:
        raise ValueError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from None


def _read_tensors(path: Path):
    """Yield (name, tensor) from one safetensors file; a corrupt file is a ValueError naming it."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except Exception as e:  # safetensors raises its own SafetensorError, OSError, ...
        raise ValueError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from None


@torch.no_grad()
def _load_tensor(cfg, params, loaded, name, tensor, path, quant=None) -> None:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return  # some tied checkpoints store the head anyway
    if "rotary_emb" in name or kv_scale_target(name) is not None:
        return  # KV-cache scales are the cache's settings (cache/kv_quant.py reads them)
    name = _our_name(name)
    if cfg.is_mla and _layer_of(name) >= cfg.num_layers:
        return  # DeepSeek-V3's multi-token prediction layer (model.layers.61): not served
    if (expert := _EXPERT.match(name)) is not None:
        return _load_expert(cfg, params, loaded, name, tensor, path, expert)
    target, part = name, None
    for hf, (ours, index) in _FUSED.items():
        if f".{hf}." in name and not (cfg.is_mla and hf.startswith("self_attn.")):  # MLA: unfused
            target, part = name.replace(hf, ours), index
    module_name, _, attr = target.rpartition(".")
    if quant and module_name in quant:
        try:
            quant[module_name].load(attr, tensor, part)
        except ValueError as e:
            raise ValueError(f"{path}: tensor {name!r}: {e}") from None
        return
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


def _our_name(name: str) -> str:
    """A checkpoint name with Mixtral's MoE block and DeepSeek's shared experts renamed ours."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MoE block
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")  # DeepSeek's shared one


def _layer_of(name: str) -> int:
    """The decoder layer a tensor name belongs to (-1: none)."""
    match = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


def _load_expert(cfg, params, loaded, name, tensor, path, match) -> None:
    """One expert's gate, up or down weight (or an FP8 expert's weight scale) into its row of
    the stacked parameter."""
    prefix, expert, kind, what = match.group(1), int(match.group(2)), match.group(3), match.group(4)
    if kind not in _EXPERT_PARTS or f"{prefix}.gate_up_proj" not in params:
        raise ValueError(f"{path}: unexpected tensor {name!r} for {cfg.architecture}")
    attr, part = _EXPERT_PARTS[kind]
    fp8 = f"{prefix}.{attr}_scale" in params
    if what != "weight" and not fp8:
        raise ValueError(f"{path}: tensor {name!r}: the layer's other experts are not FP8")
    if what == "input_scale":
        return  # FP8 experts run weight-only (moe.py)
    target = f"{prefix}.{attr}" + ("_scale" if what == "weight_scale" else "")
    param = params[target]
    if expert >= param.shape[0]:
        raise ValueError(f"{path}: tensor {name!r}: expert {expert} of {param.shape[0]} "
                         "(config.json's number of experts)")
    param = param[expert]
    if part is not None:
        size = cfg.moe_intermediate_size
        param = param.narrow(0, part * size, size)
    if what == "weight_scale":  # per channel [N] or [N, 1], or one per tensor
        if tensor.numel() not in (1, param.numel()):
            raise ValueError(f"{path}: tensor {name!r} has {tensor.numel()} scales for "
                             f"{param.numel()} channels; per-channel and per-tensor are supported")
        tensor = tensor.float().reshape(-1).expand(param.shape)
    elif fp8 and tensor.dtype != param.dtype:
        raise ValueError(f"{path}: tensor {name!r} is {tensor.dtype}; the layer's experts are "
                         f"FP8 ({param.dtype})")
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"config.json implies {tuple(param.shape)}")
    param.copy_(tensor)
    num_parts = 2 if part is not None else 1
    loaded.add(f"{target}#{expert * num_parts + (part or 0)}")
    if all(f"{target}#{i}" in loaded for i in range(cfg.num_experts * num_parts)):
        loaded.add(target)
