"""Our model's weights under Hugging Face names, for transformers to run the very same weights.

The inverse of the loader (loader.py): the fused `self_attn.qkv_proj` splits back into
q/k/v_proj and `mlp.gate_up_proj` into gate_proj and up_proj, weights and biases alike;
DeepSeek's shared experts take their name back. With
tied embeddings there is no `lm_head.weight` (as save_pretrained writes a tied checkpoint).
Benchmarks and tests use it to compare pd-serve with transformers on random (dummy) weights.
"""

from __future__ import annotations

import torch

from pd_serve.model.llama import CausalLM
from pd_serve.model.loader import _FUSED, _split_sizes


def to_hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Hugging Face parameter name -> tensor, for `hf_model.load_state_dict(...)`.

    The tensors are detached views of the model's parameters (no copy: an 8B model does not
    need its memory twice); clone them to keep them past changes to the model.
    """
    cfg = model.config
    parts: dict[str, list[str]] = {}  # our fused fragment -> its HF fragments, in order
    for hf, (ours, _) in sorted(_FUSED.items(), key=lambda item: item[1][1]):
        parts.setdefault(ours, []).append(hf)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        fused = next((f for f in parts if f".{f}." in name), None)
        if fused is None:
            out[name] = tensor
            continue
        pieces = tensor.split(_split_sizes(cfg, fused), dim=0)
        for hf, piece in zip(parts[fused], pieces, strict=True):
            out[name.replace(fused, hf)] = piece
    if not cfg.shared_experts_gated:  # DeepSeek's ungated shared experts (loader's _our_name)
        out = {name.replace(".mlp.shared_expert.", ".mlp.shared_experts."): tensor
               for name, tensor in out.items()}
    return out



def to_hf_model(model: CausalLM, hf_config: dict):
    """transformers' model for `hf_config` (the config.json dict our model was built from), on
    our model's device and in its dtype, holding a copy of our weights. Needs transformers.

    Built as from_pretrained builds it: parameters in the dtype, RoPE frequencies in float32.
    """
    import transformers

    param = next(model.parameters())
    config = transformers.AutoConfig.for_model(**hf_config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(param.dtype)
    try:
        with torch.device(param.device):
            hf = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in hf.parameters():  # in case this transformers version ignores the default dtype
            p.data = p.data.to(param.dtype)
    result = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    allowed_missing = ["lm_head.weight"] if model.config.tie_word_embeddings else []
    if result.unexpected_keys or sorted(result.missing_keys) != allowed_missing:
        raise ValueError(f"transformers' {type(hf).__name__} does not take our weights: missing "
                         f"{result.missing_keys}, unexpected {result.unexpected_keys}")
    return hf.eval()
