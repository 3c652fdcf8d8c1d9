"""`pd-serve launch --model FILE.gguf`: the gateway and a colocated worker each find the file's
converted folder (one conversion wins, the other reuses it) and serve the engine's tokens."""

from __future__ import annotations

from cluster_helpers import assert_greedy_completions, start_cluster
from gguf_checkpoints import write_gguf
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):"]


def test_gguf_file_served(tmp_path, monkeypatch, tiny_checkpoint_writer, default_model_dir):
    monkeypatch.setenv("PD_SERVE_CACHE", str(tmp_path / "cache"))  # the workers inherit it
    hf_dir = tiny_checkpoint_writer("llama", tmp_path / "llama", default_model_dir, seed=13)
    gguf_path = write_gguf(hf_dir, tmp_path / "tiny-llama.gguf")
    engine = Engine(hf_dir, device=TEST_DEVICE, max_total_tokens=1024)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    texts = [engine.generate([p], params)[0].text for p in PROMPTS]
    cluster = start_cluster(0, 0, 1, model=gguf_path)
    try:
        assert_greedy_completions(cluster, PROMPTS, texts, 16)
    finally:
        cluster.stop()
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one converted folder, no leftovers
