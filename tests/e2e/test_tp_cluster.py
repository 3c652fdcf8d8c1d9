"""Tensor-parallel workers behind the gateway serve the unsharded engine's greedy completions and
free every page: a colocated worker with --tp 2 (a follower process per extra rank), and 1P1D
with prefill and decode of different TP sizes (each decode rank receives its KV heads from the
prefill ranks holding them)."""

from __future__ import annotations

import json
import os
import signal
import time

import openai
import pytest
import torch

from cluster_helpers import assert_greedy_completions, metrics, start_cluster, wait_idle
from helpers import TEST_DEVICE
from pd_serve import Engine, SamplingParams
from pd_serve.transfer.heads import head_routes

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 16


@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2,
                    reason="--tp 2 needs two GPUs")
def test_colocated_tp2_worker_equals_the_unsharded_engine(tiny_checkpoints):
    model_dir = tiny_checkpoints["llama3"]
    # float32 on the GPU too: in bf16 the two summation orders may part at a near-tie, and
    # token equality is what this test checks (bf16 agreement is a GPU test's business).
    reference = Engine(model_dir, device=TEST_DEVICE, max_total_tokens=4096, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.text for out in reference.generate(PROMPTS, params)]
    cluster = start_cluster(0, 0, num_colocated=1, model=model_dir, extra=["--tp", "2", "--dtype", "float32"])
    try:
        assert_greedy_completions(cluster, PROMPTS, want, MAX_TOKENS)
    finally:
        cluster.stop()


@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2,
                    reason="--tp 2 needs two GPUs")
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("prefill_tp,decode_tp,overlap", [(2, 1, False), (1, 2, False), (1, 2, True)],
                         ids=["p2-d1", "p1-d2", "p1-d2-overlap"])
def test_1p1d_across_tp_sizes_equals_the_unsharded_engine(tiny_checkpoints, arch, prefill_tp,
                                                          decode_tp, overlap, monkeypatch):
    """overlap: the decode worker's TP group under the overlap schedule (on by default on GPU;
    PD_SERVE_OVERLAP_CPU=1 forces it on here)."""
    if overlap:
        monkeypatch.setenv("PD_SERVE_OVERLAP_CPU", "1")  # the workers inherit it
    model_dir = tiny_checkpoints[arch]
    reference = Engine(model_dir, device=TEST_DEVICE, max_total_tokens=4096, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.text for out in reference.generate(PROMPTS, params)]
    cluster = start_cluster(1, 1, model=model_dir, extra=["--dtype", "float32"],
                            role_tp={"prefill": prefill_tp, "decode": decode_tp})
    try:
        assert_greedy_completions(cluster, PROMPTS, want, MAX_TOKENS)
        # Every rank's part shows in its worker's /metrics: one transfer per head route on the
        # prefill side, one per decode rank on the decode side, for each request.
        heads = json.loads((model_dir / "config.json").read_text())["num_key_value_heads"]
        want_counts = {"prefill-0": len(PROMPTS) * len(head_routes(prefill_tp, decode_tp, heads)),
                       "decode-1": len(PROMPTS) * decode_tp}
        deadline = time.monotonic() + 10
        while True:
            m = metrics(cluster.base_url)
            got = {w: m.get(("pd_serve:kv_transfers_total", w)) for w in want_counts}
            if got == want_counts or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == want_counts
    finally:
        cluster.stop()


def _tp_followers(pid: int) -> list[int]:
    """The TP follower processes a worker spawned (children running multiprocessing's spawn)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2,
                    reason="--tp 2 needs two GPUs")
def test_a_killed_decode_follower_ends_the_stream_and_its_worker(tiny_checkpoints):
    """A decode TP group that loses a rank cannot serve: its rank 0 fails at the next step and
    exits, the stream ends with an error within bounds, the prefill worker keeps no page, and
    the next request is refused at once rather than left waiting."""
    cluster = start_cluster(1, 1, model=tiny_checkpoints["llama3"], role_tp={"decode": 2},
                            gateway_args=("--worker-timeout", "2", "--step-timeout", "20"))
    try:
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0,
                               timeout=60)
        model = client.models.list().data[0].id
        decode = dict(cluster.procs)["decode-1"]
        (follower,) = _tp_followers(decode.pid)
        stream = client.completions.create(model=model, prompt="Count to one thousand:", max_tokens=900,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        killed = None
        with pytest.raises(openai.APIError):
            for i, _chunk in enumerate(stream):
                if i == 2:
                    os.kill(follower, signal.SIGKILL)
                    killed = time.monotonic()
        assert killed is not None and time.monotonic() - killed < 25
        assert decode.wait(timeout=30) != 0  # rank 0 failed its next step and exited
        state = wait_idle(cluster)
        assert state["prefill-0"][0] == 0, state
        start = time.monotonic()
        with pytest.raises(openai.APIError):
            client.completions.create(model=model, prompt="Hello", max_tokens=4)
        assert time.monotonic() - start < 10
    finally:
        cluster.stop()
