"""A 1P1D cluster with --kv-cache-dtype fp8_e4m3: FP8 pages cross from prefill to decode
byte for byte, so greedy output equals the colocated engine's with the same FP8 cache."""

from __future__ import annotations

import time

import openai

from cluster_helpers import pages, start_cluster
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
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS, want):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == text
        deadline = time.monotonic() + 20  # the workers free their pages just after the reply
        while any(used for used, _ in pages(cluster.base_url).values()):
            assert time.monotonic() < deadline, f"pages still used: {pages(cluster.base_url)}"
            time.sleep(0.2)
    finally:
        cluster.stop()
