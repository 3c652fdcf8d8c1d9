"""A tiny DeepSeek-V3 (multi-head latent attention, DeepSeekMoE) served colocated and 1P1D
behind the gateway: the colocated engine's greedy completions, every page freed, and in 1P1D
the KV bytes moved are the latent pages' (kv_lora_rank + qk_rope_head_dim values per token and
layer), sent layer group by layer group. Also a prefill pool of TP 2 (and EP 2) handing off to
a decode pool of TP 1: every prefill rank holds the whole latent, so one rank's pages serve."""

from __future__ import annotations

import time

import pytest
import torch

from cluster_helpers import assert_greedy_completions, metrics, start_cluster
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams
from pd_serve.cache.pool import pages_for

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory, tiny_checkpoint_writer, default_model_dir):
    return tiny_checkpoint_writer("deepseek_v3", tmp_path_factory.mktemp("mla") / "deepseek_v3",
                                  default_model_dir, seed=14)


@pytest.mark.parametrize("split", ["colocated", "1p1d", pytest.param("1p1d-prefill-tp2", marks=(
    pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2,
                       reason="--tp 2 needs two GPUs")))])
def test_deepseek_v3_cluster_equals_the_colocated_engine(deepseek_v3, split):
    reference = Engine(deepseek_v3, device=TEST_DEVICE, max_total_tokens=4096, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.text for out in reference.generate(PROMPTS, params)]
    sizes = (0, 0, 1) if split == "colocated" else (1, 1, 0)
    tp = {"prefill": 2, "decode": 1} if split == "1p1d-prefill-tp2" else None
    cluster = start_cluster(*sizes, model=deepseek_v3, role_tp=tp, role_ep=tp,
                            extra=["--dtype", "float32", "--transfer-layer-groups", "2"])
    try:
        assert_greedy_completions(cluster, PROMPTS, want, MAX_TOKENS)
        if split != "colocated":
            layout = reference.kv_pool.layout
            cfg = reference.model_config
            assert layout.bytes_per_token == cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
            num_pages = sum(pages_for(len(reference.tokenizer.encode(p)), layout.page_size)
                            for p in PROMPTS)
            want_bytes = num_pages * layout.bytes_per_page
            deadline = time.monotonic() + 60  # workers report their metrics with each heartbeat
            while True:
                moved = {w: v for (name, w), v in metrics(cluster.base_url).items()
                         if name == "pd_serve:kv_transfer_bytes_total" and v}
                if sorted(moved.values()) == [want_bytes] * 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert sorted(moved.values()) == [want_bytes] * 2, (moved, want_bytes)  # sent, received
    finally:
        cluster.stop()
