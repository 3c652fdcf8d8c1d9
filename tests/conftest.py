"""Shared fixtures: the embedded default model, and tiny random checkpoints written by transformers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter (where a test asks, PD_SERVE_TRITON_CPU=1);
# the interpreter works only if TRITON_INTERPRET=1 is set before triton is first imported,
# and transformers imports it, so set it for the whole process here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Our kernels/ package shadows the hub's `kernels` that transformers 5 may use: keep them off.
os.environ.setdefault("USE_HUB_KERNELS", "NO")
# One torch thread in every test process and in the workers the tests start (they inherit the
# environment). The tests and their clusters share a few cores; with a thread per core each,
# OpenMP's barriers wait on descheduled threads, and on a loaded 2-core box a small matmul took
# 11x longer with 2 threads than with 1.
if not torch.cuda.is_available():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2; PD_SERVE_TEST_MODEL names another folder where it cannot be had
    (the GPU machine cannot carry the GGUF file)."""
    if os.environ.get("PD_SERVE_TEST_MODEL"):
        return Path(os.environ["PD_SERVE_TEST_MODEL"])
    from pd_serve.model.gguf_default import default_model_dir
    return default_model_dir()


def write_tiny_checkpoint(kind: str, out_dir: Path, tokenizer_dir: Path, *, seed: int = 0,
                          max_shard_size: str | None = None, shape: dict | None = None) -> Path:
    """A random model of `kind` saved with transformers' save_pretrained, with a real tokenizer.

    Weights are drawn wide (std 0.3, not 0.02) so logits are peaked and greedy decoding is not
    a string of near-ties.
    """
    import transformers

    vocab = len(_tokenizer_vocab(tokenizer_dir))
    common = dict(TINY_SHAPE, **(shape or {}), vocab_size=vocab, initializer_range=0.3, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    if kind == "llama":  # plain RoPE (a GGUF file can carry it)
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "llama3":
        config = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**{**common, "tie_word_embeddings": True}, head_dim=32)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": None, **common})  # shape may set one
        cls = transformers.MistralForCausalLM
    elif kind == "mixtral":  # 8 experts, top 2, renormalised
        config = transformers.MixtralConfig(**{**common, "intermediate_size": 48},
                                            num_local_experts=8, num_experts_per_tok=2,
                                            sliding_window=None)
        cls = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":  # a shared expert; layer 2 of 3 dense (mlp_only_layers)
        config = transformers.Qwen2MoeConfig(
            **{**common, "num_hidden_layers": 3}, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
            mlp_only_layers=[2])
        cls = transformers.Qwen2MoeForCausalLM
    elif kind == "qwen3_moe":  # q/k norm, renormalised top 4 of 8; every 2nd layer sparse
        config = transformers.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=32, num_experts=8,
            num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=2)
        cls = transformers.Qwen3MoeForCausalLM
    elif kind in ("deepseek_v2", "deepseek_v3"):
        config, cls = _deepseek_config(kind, common)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # biases default to zero; make Qwen2's QKV bias matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
        for name, b in model.named_buffers():  # and DeepSeek-V3's routing bias
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_dir / name).exists() and not (out_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def _deepseek_config(kind: str, common: dict):
    """DeepSeek-V2 (q_proj, softmax, group-limited greedy routing, plain rope) or V3 (q LoRA,
    sigmoid noaux_tc routing with its bias, renormalised and scaled, YaRN with mscale): 3
    layers, the first dense, 8 routed experts in 4 groups and a shared one; MLA of rank 32."""
    import transformers

    shape = dict({**common, "num_hidden_layers": 3, "num_key_value_heads": 4},
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                 first_k_dense_replace=1, n_group=4, topk_group=2)
    if kind == "deepseek_v2":
        config = transformers.DeepseekV2Config(**shape, q_lora_rank=None, num_experts_per_tok=3,
                                               topk_method="group_limited_greedy",
                                               routed_scaling_factor=1.0)
        return config, transformers.DeepseekV2ForCausalLM
    config = transformers.DeepseekV3Config(
        **{**shape, "max_position_embeddings": 256}, q_lora_rank=24, num_experts_per_tok=3, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
            "beta_fast": 32, "beta_slow": 1})
    return config, transformers.DeepseekV3ForCausalLM


def _tokenizer_vocab(tokenizer_dir: Path) -> dict:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab()


@pytest.fixture(scope="session")
def tiny_checkpoint_writer():
    """write_tiny_checkpoint, for a test that needs a checkpoint of its own seed or shape (a
    module named conftest may be another folder's, so tests take it from here)."""
    return write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama3": write_tiny_checkpoint("llama3", root / "llama3", default_model_dir, seed=1),
        "qwen2": write_tiny_checkpoint("qwen2", root / "qwen2", default_model_dir, seed=2,
                                       max_shard_size="2MB"),
        "qwen3": write_tiny_checkpoint("qwen3", root / "qwen3", default_model_dir, seed=3),
        "mistral": write_tiny_checkpoint("mistral", root / "mistral", default_model_dir, seed=4),
    }


@pytest.fixture(scope="session")
def tiny_moe_checkpoints(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    """Tiny random Mixtral, Qwen2-MoE and Qwen3-MoE, written by transformers (per-expert
    tensor names, as save_pretrained writes them)."""
    root = tmp_path_factory.mktemp("tiny_moe")
    return {kind: write_tiny_checkpoint(kind, root / kind, default_model_dir, seed=seed)
            for kind, seed in (("mixtral", 5), ("qwen2_moe", 6), ("qwen3_moe", 7))}


@pytest.fixture(scope="session")
def gptq_smollm2_dir(tmp_path_factory, default_model_dir) -> Path:
    """The embedded SmolLM2 as a GPTQ checkpoint the tests write: round-to-nearest 4-bit,
    group size 128, symmetric, AutoGPTQ's layout (tests/quant_checkpoints.py)."""
    from quant_checkpoints import write_gptq_checkpoint
    return write_gptq_checkpoint(default_model_dir, tmp_path_factory.mktemp("gptq") / "smollm2")


import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py
