"""A 1P1D cluster with --kv-cache-dtype fp8_e4m3: FP8 pages cross from prefill to decode
byte for byte, so greedy output equals the colocated engine's with the same FP8 cache."""

from __future__ import annotations


from cluster_helpers import assert_greedy_completions, start_cluster
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 24


def test_fp8_1p1d_equals_colocated_fp8(default_model_dir):
    reference = Engine(default_model_dir, device=TEST_DEVICE, max_total_tokens=8192,
                       kv_cache_dtype="fp8_e4m3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.text for out in reference.generate(PROMPTS, params)]
    cluster = start_cluster(1, 1, extra=["--kv-cache-dtype", "fp8_e4m3"])
    try:
        assert_greedy_completions(cluster, PROMPTS, want, MAX_TOKENS)
    finally:
        cluster.stop()
