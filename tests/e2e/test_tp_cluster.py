"""A colocated worker with --tp 2 (a follower process per extra rank) behind the gateway serves
the same greedy completions as the unsharded engine, and frees every page."""

from __future__ import annotations

import time

import openai
import pytest
import torch

from cluster_helpers import pages, start_cluster
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 16


@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2,
                    reason="--tp 2 needs two GPUs")
def test_colocated_tp2_worker_equals_the_unsharded_engine(tiny_checkpoints):
    model_dir = tiny_checkpoints["llama3"]
    reference = Engine(model_dir, device=TEST_DEVICE, max_total_tokens=4096)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.text for out in reference.generate(PROMPTS, params)]
    cluster = start_cluster(0, 0, num_colocated=1, model=model_dir, extra=["--tp", "2"])
    try:
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS, want):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == text
        deadline = time.monotonic() + 20
        while any(used for used, _ in pages(cluster.base_url).values()):
            assert time.monotonic() < deadline, f"pages still used: {pages(cluster.base_url)}"
            time.sleep(0.2)
    finally:
        cluster.stop()
