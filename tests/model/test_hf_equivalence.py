"""Greedy tokens of the engine == transformers' greedy tokens on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import assert_greedy_matches, assert_pages_settled, hf_greedy
from pd_serve import Engine, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _check_model(model_dir, prompts: list[list[int]], num_tokens: int, **engine_kwargs) -> list[int]:
    engine = Engine(model_dir, device="cpu", max_total_tokens=4096, **engine_kwargs)
    outs = engine.generate(prompts, SamplingParams(max_tokens=num_tokens, **GREEDY))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    matched = []
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, prompt, num_tokens)
        matched.append(assert_greedy_matches(out.token_ids, ref, ref_logits))
    assert_pages_settled(engine)
    return matched


def test_smollm2_matches_transformers(default_model_dir):
    engine_tok = Engine(default_model_dir, device="cpu", max_total_tokens=256).tokenizer
    chat = engine_tok.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    prompts = [
        engine_tok.encode(chat, add_special_tokens=False),
        engine_tok.encode("The capital of France is"),
        engine_tok.encode("def fibonacci(n):\n    "),
    ]
    matched = _check_model(default_model_dir, prompts, 40)
    assert min(matched) >= 32, f"sequences parted early (near-tie) at {matched}"


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "mistral"])
def test_tiny_checkpoints_match_transformers(tiny_checkpoints, kind):
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 23, 70)]
    matched = _check_model(tiny_checkpoints[kind], prompts, 32)
    assert max(matched) >= 16, f"every sequence parted early: {matched}"


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_tiny_moe_checkpoints_match_transformers(tiny_moe_checkpoints, kind):
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 23, 70)]
    matched = _check_model(tiny_moe_checkpoints[kind], prompts, 32)
    assert max(matched) >= 16, f"every sequence parted early: {matched}"


def test_llama3_rope_scaling_reaches_long_positions(tiny_checkpoints):
    """Past original_max_position_embeddings (64) the llama3 ramp is what decides the tokens."""
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(3, 49152, (300,), generator=gen).tolist()
    _check_model(tiny_checkpoints["llama3"], [prompt], 16, chunked_prefill_size=128)
