"""A sliding-window checkpoint served past its window: a colocated worker and a 1P1D cluster
give the engine's greedy tokens, which are transformers' (a tiny random Mistral, window 16,
prompts and outputs several windows long; the KV of a prompt crosses from prefill to decode)."""

from __future__ import annotations

import pytest
import torch
import transformers

from cluster_helpers import assert_greedy_completions, start_cluster
from helpers import TEST_DEVICE, assert_greedy_matches, hf_greedy
from pd_serve import Engine, SamplingParams

WINDOW, MAX_TOKENS = 16, 40


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory, tiny_checkpoint_writer, default_model_dir):
    """(model dir, prompts as text, the engine's greedy texts), the engine checked against
    transformers token for token (the near-tie rule)."""
    model_dir = tiny_checkpoint_writer("mistral", tmp_path_factory.mktemp("swa") / "mistral",
                                       default_model_dir, seed=11,
                                       shape=dict(sliding_window=WINDOW))
    engine = Engine(model_dir, device=TEST_DEVICE, max_total_tokens=4096)
    words = "the quick brown fox jumps over a lazy dog while seven ravens watch".split()
    prompts = [" ".join(words[i % len(words)] for i in range(n)) for n in (4, 30, 70)]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    assert max(map(len, ids)) > 3 * WINDOW
    outs = engine.generate(ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    if TEST_DEVICE == "cpu":  # on GPU (bf16) tests/gpu compares with transformers instead
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        matched = [assert_greedy_matches(out.token_ids, *hf_greedy(hf, p, MAX_TOKENS))
                   for p, out in zip(ids, outs)]
        assert max(matched) == MAX_TOKENS, matched
    return model_dir, prompts, [out.text for out in outs]


@pytest.mark.parametrize("split", [(0, 0, 1), (1, 1, 0)], ids=["colocated", "1p1d"])
def test_window_served_equals_engine(mistral_window, split):
    model_dir, prompts, texts = mistral_window
    num_prefill, num_decode, num_colocated = split
    cluster = start_cluster(num_prefill, num_decode, num_colocated, model=model_dir)
    try:
        assert_greedy_completions(cluster, prompts, texts, MAX_TOKENS)
    finally:
        cluster.stop()
