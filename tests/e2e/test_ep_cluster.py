"""A Qwen3-MoE served 1P1D with expert parallelism over replicated attention (--tp 1
--ep-size 2) on one pool and EP 1 on the other: every rank of the EP pool holds every KV head,
so the first prefill rank's pages reach each decode rank (transfer/connector.py). The greedy
completions, through the openai client, are the colocated EP 1 engine's; every page is freed."""

from __future__ import annotations

import pytest
import torch

from cluster_helpers import assert_greedy_completions, start_cluster
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 16


@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2,
                    reason="--ep-size 2 needs two GPUs")
@pytest.mark.parametrize("prefill_ep,decode_ep", [(2, 1), (1, 2)])
def test_ep_pools_equal_the_colocated_ep1_engine(tiny_moe_checkpoints, prefill_ep, decode_ep):
    model_dir = tiny_moe_checkpoints["qwen3_moe"]
    reference = Engine(model_dir, device=TEST_DEVICE, max_total_tokens=4096, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.text for out in reference.generate(PROMPTS, params)]
    reference.close()
    cluster = start_cluster(1, 1, model=model_dir, extra=["--dtype", "float32"],
                            role_ep={"prefill": prefill_ep, "decode": decode_ep})
    try:
        assert_greedy_completions(cluster, PROMPTS, want, MAX_TOKENS)
    finally:
        cluster.stop()
