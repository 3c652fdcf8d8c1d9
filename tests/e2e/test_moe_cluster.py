"""A mixture-of-experts model (Qwen2-MoE: routed experts, a shared expert, a dense layer) served
1P1D behind the gateway: the greedy completions of the colocated engine, and every page freed;
also with expert parallelism on one pool (--tp 2 --ep-size 2) and not the other."""

from __future__ import annotations

import pytest
import torch

from cluster_helpers import assert_greedy_completions, start_cluster
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 16


@pytest.mark.parametrize("prefill_ep,decode_ep", [
    (1, 1),
    pytest.param(2, 1, marks=pytest.mark.skipif(
        TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2,
        reason="--tp 2 needs two GPUs"))])
def test_moe_1p1d_equals_the_colocated_engine(tiny_moe_checkpoints, prefill_ep, decode_ep):
    model_dir = tiny_moe_checkpoints["qwen2_moe"]
    reference = Engine(model_dir, device=TEST_DEVICE, max_total_tokens=4096, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.text for out in reference.generate(PROMPTS, params)]
    sizes = {"prefill": prefill_ep, "decode": decode_ep}
    cluster = start_cluster(1, 1, model=model_dir, extra=["--dtype", "float32"],
                            role_tp=sizes, role_ep=sizes)
    try:
        assert_greedy_completions(cluster, PROMPTS, want, MAX_TOKENS)
    finally:
        cluster.stop()
