"""A 1P1D cluster serving a GPTQ checkpoint gives the colocated engine's greedy tokens."""

from __future__ import annotations

import openai

from cluster_helpers import start_cluster
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time,"]
MAX_TOKENS = 16


def test_gptq_cluster_equals_colocated(gptq_smollm2_dir):
    """Greedy text and token count of each prompt, served by prefill + decode workers that
    both load the checkpoint, == the colocated engine's on the same checkpoint."""
    reference = Engine(gptq_smollm2_dir, device=TEST_DEVICE, max_total_tokens=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    want = [(out.text, len(out.token_ids)) for out in reference.generate(PROMPTS, params)]
    del reference
    cluster = start_cluster(1, 1, model=gptq_smollm2_dir)
    try:
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        for prompt, (text, num_tokens) in zip(PROMPTS, want):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0)
            assert (out.choices[0].text, out.usage.completion_tokens) == (text, num_tokens)
    finally:
        cluster.stop()
