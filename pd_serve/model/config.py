"""The model's shape, read from a Hugging Face config.json (transformers 4.x and 5.x spellings)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

# architecture name -> the family flags the one decoder implementation needs
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
    "MixtralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2MoeForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3MoeForCausalLM": dict(qkv_bias=False, qk_norm=True),
    "DeepseekV2ForCausalLM": dict(qkv_bias=False, qk_norm=False),  # MLA + DeepSeekMoE: mla.py
    "DeepseekV3ForCausalLM": dict(qkv_bias=False, qk_norm=False),
}
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2, or Llama's attention_bias)
    o_bias: bool  # bias on o_proj (Llama's attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    checkpoint_dtype: str = "float32"
    rope_scaling: dict = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 experts: a dense model); model/moe.py
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # Sliding-window attention: a query at position i sees keys j with i - sliding_window < j
    # <= i in the layers listed (transformers' mask); 0: full attention everywhere.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # DeepSeekMoE routing (moe_routing.py); shared experts are ungated, n_shared * moe wide
    scoring_func: str = "softmax"  # or "sigmoid" (V3)
    topk_method: str = "greedy"  # or "group_limited_greedy" (V2), "noaux_tc" (V3)
    n_group: int = 1  # expert groups; a token picks its experts from topk_group of them
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts_gated: bool = True  # Qwen2-MoE's sigmoid gate; DeepSeek's shared experts have none
    # Multi-head latent attention (DeepSeek-V2/V3; model/mla.py), where kv_lora_rank > 0. The KV
    # pool then holds one "head" per token: num_kv_heads is 1 and head_dim kv_lora_rank +
    # qk_rope_head_dim (the latent and the shared rope key).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q_proj straight from the hidden state
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # DeepSeek's rope rotates (even, odd) pairs

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer `layer_id` has a sparse MoE block (else a dense MLP)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    def layer_window(self, layer_id: int) -> int:
        """The keys a query of layer `layer_id` sees at most (itself included); 0: all."""
        return self.sliding_window if layer_id in self.sliding_layers else 0

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """layer_window(i) of every layer: what the attention backends are built with."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates: a head's (MLA: the rope part only)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{path}: missing; a model directory needs a Hugging Face config.json")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(raw.get("model_type"), "")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: architecture {arch or raw.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        try:
            hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope_theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", "llama3", "linear", "yarn"):
                raise ValueError(f"{source}: rope type {rope_type!r} is not supported "
                                 "(default, linear, llama3, yarn)")
            rope = {**rope, "rope_type": rope_type}
            eos = raw.get("eos_token_id")
            attention_bias = bool(raw.get("attention_bias", False))
            family = SUPPORTED_ARCHITECTURES[arch]
            moe = _moe_fields(arch, raw)
            mla = _mla_fields(arch, raw)
            return cls(
                architecture=arch,
                hidden_size=hidden,
                num_layers=raw["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=mla.pop("num_kv_heads", None) or raw.get("num_key_value_heads") or heads,
                head_dim=mla.pop("head_dim", None) or raw.get("head_dim") or hidden // heads,
                intermediate_size=raw["intermediate_size"],
                vocab_size=raw["vocab_size"],
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                max_position_embeddings=raw.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=bool(raw.get("qkv_bias", family["qkv_bias"])) or attention_bias,
                o_bias=attention_bias,
                qk_norm=family["qk_norm"],
                checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
                rope_scaling=rope,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                **{**moe, **mla},
                **_sliding_fields(arch, raw),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from None


def _moe_fields(arch: str, raw: dict) -> dict:
    """The MoE fields of config.json for the MoE architectures ({} for dense ones). Mixtral
    routes every layer, renormalising its top-k weights; its experts are intermediate_size wide."""
    if arch == "MixtralForCausalLM":
        return dict(num_experts=raw["num_local_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
                    moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True)
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    num_experts = raw.get("num_experts") or raw["num_local_experts"]  # transformers 5 writes the latter
    return dict(num_experts=num_experts, num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0)
                if arch == "Qwen2MoeForCausalLM" else 0,
                decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))


def _sliding_fields(arch: str, raw: dict) -> dict:
    """sliding_window and sliding_layers as transformers reads them. Mistral and Mixtral: every
    layer when sliding_window is set (their layer_types are ignored); Qwen3-MoE: every layer
    under use_sliding_window; Qwen2 and Qwen3 under use_sliding_window: the layers config.json's
    layer_types calls sliding_attention, else layers max_window_layers and up; Qwen2-MoE: the
    even-indexed layers below max_window_layers. Llama has no window."""
    window = raw.get("sliding_window") or 0
    num_layers = raw["num_hidden_layers"]
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        layers = range(num_layers)
    elif not raw.get("use_sliding_window") or arch == "LlamaForCausalLM":
        window, layers = 0, range(0)
    elif arch == "Qwen3MoeForCausalLM":
        layers = range(num_layers)
    elif raw.get("layer_types"):
        layers = [i for i, kind in enumerate(raw["layer_types"]) if kind == "sliding_attention"]
    elif arch == "Qwen2MoeForCausalLM":
        layers = [i for i in range(num_layers) if (i + 1) % 2 and i < raw.get("max_window_layers", 28)]
    else:
        layers = range(raw.get("max_window_layers", 28), num_layers)
    layers = tuple(layers) if window else ()
    return dict(sliding_window=window if layers else 0, sliding_layers=layers)


def _deepseek_moe_fields(arch: str, raw: dict) -> dict:
    """DeepSeek-V2/V3's DeepSeekMoE: layer i is sparse when i >= first_k_dense_replace and
    i % moe_layer_freq == 0; V3 scores with a sigmoid and picks by noaux_tc whatever its config
    says (as transformers does)."""
    num_experts = raw.get("n_routed_experts") or 0
    if not num_experts:
        return {}
    v3 = arch == "DeepseekV3ForCausalLM"
    first_dense, freq = raw.get("first_k_dense_replace") or 0, raw.get("moe_layer_freq") or 1
    return dict(num_experts=num_experts, num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
                shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("n_shared_experts") or 0),
                shared_experts_gated=False,
                mlp_only_layers=tuple(i for i in range(raw["num_hidden_layers"])
                                      if i < first_dense or i % freq),
                scoring_func="sigmoid" if v3 else raw.get("scoring_func", "softmax"),
                topk_method="noaux_tc" if v3 else raw.get("topk_method") or "greedy",
                n_group=raw.get("n_group") or 1, topk_group=raw.get("topk_group") or 1,
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))


def _mla_fields(arch: str, raw: dict) -> dict:
    """DeepSeek-V2/V3's multi-head latent attention and MoE fields ({} for other models)."""
    if arch not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return {}
    kv_lora_rank, rope_dim = raw["kv_lora_rank"], raw["qk_rope_head_dim"]
    return dict(num_kv_heads=1, head_dim=kv_lora_rank + rope_dim, kv_lora_rank=kv_lora_rank,
                q_lora_rank=raw.get("q_lora_rank") or 0, qk_nope_head_dim=raw["qk_nope_head_dim"],
                qk_rope_head_dim=rope_dim, v_head_dim=raw["v_head_dim"],
                # V2 rotates pairs always (complex numbers); V3 where rope_interleave says
                rope_interleave=arch == "DeepseekV2ForCausalLM" or raw.get("rope_interleave", True),
                **_deepseek_moe_fields(arch, raw))


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """'auto' is float32 on CPU and bfloat16 on GPU."""
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not supported; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]
