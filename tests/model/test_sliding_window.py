"""Sliding-window attention (Mistral v0.1, Qwen2's use_sliding_window): which layers take the
window, as transformers decides, and greedy tokens equal to transformers' (fp32, CPU) on tiny
random checkpoints whose prompts and outputs run several windows long."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import assert_greedy_matches, assert_pages_settled, hf_greedy
from pd_serve import Engine, SamplingParams
from pd_serve.model.config import ModelConfig

WINDOW = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)
MISTRAL_FULL = dict(sliding_window=None)


@pytest.mark.parametrize("cls,kwargs", [
    (transformers.MistralConfig, dict(sliding_window=WINDOW)),
    (transformers.MistralConfig, dict(sliding_window=None)),
    (transformers.MixtralConfig, dict(sliding_window=WINDOW)),
    (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    (transformers.Qwen2Config, dict(use_sliding_window=False, sliding_window=WINDOW)),
    (transformers.Qwen3Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    (transformers.Qwen2MoeConfig, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=3)),
    (transformers.Qwen3MoeConfig, dict(use_sliding_window=True, sliding_window=WINDOW)),
    (transformers.LlamaConfig, dict()),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_layer_windows_follow_transformers(cls, kwargs):
    """The layers transformers runs with a sliding mask (its layer_types, or every layer for
    the families that ignore them), from config.json with and without layer_types."""
    hf = cls(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, **kwargs)
    if cls in (transformers.MistralConfig, transformers.MixtralConfig, transformers.Qwen3MoeConfig):
        expected = (hf.sliding_window or 0,) * 4
    elif cls is transformers.LlamaConfig:
        expected = (0,) * 4
    else:
        expected = tuple(WINDOW if t == "sliding_attention" else 0 for t in hf.layer_types)
    raw = hf.to_dict()
    assert ModelConfig.from_dict(raw).layer_windows == expected
    raw.pop("layer_types", None)  # config.json of older transformers
    assert ModelConfig.from_dict(raw).layer_windows == expected


def _check(model_dir, prompts, num_tokens, full_attention: dict, **engine_kwargs) -> list[int]:
    """Our greedy tokens against transformers' on each prompt; returns how many tokens matched
    (the near-tie rule). Checks that the window changed transformers' own tokens somewhere
    (full_attention: the config overrides that turn it off)."""
    engine = Engine(model_dir, device="cpu", max_total_tokens=2048, page_size=4,
                    chunked_prefill_size=32, **engine_kwargs)
    outs = engine.generate(prompts, SamplingParams(max_tokens=num_tokens, **GREEDY))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    matched, refs = [], []
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, prompt, num_tokens)
        refs.append(ref)
        matched.append(assert_greedy_matches(out.token_ids, ref, ref_logits))
    assert_pages_settled(engine)
    hf = transformers.AutoModelForCausalLM.from_pretrained(  # full attention, same weights
        model_dir, dtype=torch.float32, **full_attention).eval()
    full = [hf_greedy(hf, p, num_tokens)[0] for p in prompts]
    assert full != refs, "the window changed no token: this test would not catch its absence"
    longest = max(len(p) + m for p, m in zip(prompts, matched))
    assert longest >= 4 * WINDOW, f"no sequence matched past 4 windows: {matched}"
    return matched


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 37, 90)]


@pytest.fixture(scope="module")
def mistral_window_dir(tmp_path_factory, tiny_checkpoint_writer, default_model_dir):
    return tiny_checkpoint_writer("mistral", tmp_path_factory.mktemp("swa") / "mistral",
                                  default_model_dir, seed=11, shape=dict(sliding_window=WINDOW))


def test_mistral_window_matches_transformers(mistral_window_dir):
    assert ModelConfig.from_dir(mistral_window_dir).layer_windows == (WINDOW, WINDOW)
    _check(mistral_window_dir, _prompts(21), 48, MISTRAL_FULL)


def test_qwen2_window_layers_match_transformers(tmp_path, tiny_checkpoint_writer, default_model_dir):
    """Layer 0 full, layer 1 sliding (max_window_layers 1); Qwen2's q/k/v biases included."""
    model_dir = tiny_checkpoint_writer(
        "qwen2", tmp_path / "qwen2", default_model_dir, seed=12,
        shape=dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))
    assert ModelConfig.from_dir(model_dir).layer_windows == (0, WINDOW)
    _check(model_dir, _prompts(22), 48,
           dict(use_sliding_window=False, layer_types=["full_attention"] * 2))


def test_triton_backend_window_matches_transformers(mistral_window_dir, monkeypatch):
    """The Triton kernels (in Triton's interpreter on CPU) through the engine."""
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")
    from kernels import paged_attention
    before = paged_attention.triton_launches
    _check(mistral_window_dir, _prompts(21)[1:], 32, MISTRAL_FULL, attention_backend="triton")
    assert paged_attention.triton_launches > before


def test_flashinfer_takes_one_window_for_every_layer(monkeypatch):
    """flashinfer plans one window per batch: auto picks it for Mistral's (every layer the
    same), triton for a model that mixes sliding and full layers; asking for it there is a
    clear error (checked without a GPU: only the names)."""
    import importlib.util

    from pd_serve.engine.attention import resolve_backend_name

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("flashinfer", "triton") else real(name, *a))
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert resolve_backend_name("auto", cuda, bf16, 128, (WINDOW, WINDOW)) == "flashinfer"
    assert resolve_backend_name("auto", cuda, bf16, 128, (0, WINDOW)) == "triton"
    with pytest.raises(ValueError, match="mixes sliding-window and full-attention layers"):
        resolve_backend_name("flashinfer", cuda, bf16, 128, (0, WINDOW))
