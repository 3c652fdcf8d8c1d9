"""A mixture-of-experts model (Qwen2-MoE: routed experts, a shared expert, a dense layer) served
1P1D behind the gateway: the greedy completions of the colocated engine, and every page freed."""

from __future__ import annotations

from cluster_helpers import assert_greedy_completions, start_cluster
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 16


def test_moe_1p1d_equals_the_colocated_engine(tiny_moe_checkpoints):
    model_dir = tiny_moe_checkpoints["qwen2_moe"]
    reference = Engine(model_dir, device=TEST_DEVICE, max_total_tokens=4096, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.text for out in reference.generate(PROMPTS, params)]
    cluster = start_cluster(1, 1, model=model_dir, extra=["--dtype", "float32"])
    try:
        assert_greedy_completions(cluster, PROMPTS, want, MAX_TOKENS)
    finally:
        cluster.stop()
