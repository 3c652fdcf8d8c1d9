"""bench/serving.py: the metric math on a hand-computed example, the dataset generators, and a
run against a real local 1P1D cluster."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))                   # bench/ (a checkout need not install it)
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))  # cluster_helpers

from bench.serving import format_summary, main  # noqa: E402
from pd_serve.planner.metrics import RequestRecord, compute_metrics, parse_slo  # noqa: E402
from pd_serve.planner.workload import (FIRST_REGULAR_ID, SHAREGPT_LENGTHS, arrival_offsets,  # noqa: E402
                                       random_dataset, shared_prefix_dataset, sharegpt_dataset)

VOCAB = 49152


# ---- metrics on recorded timestamps ---------------------------------------------------------
def example_records() -> list[RequestRecord]:
    """Four requests over a 2 s run (seconds since the start):
    A: sent 0.0, chunks 0.10 0.15 0.25 0.30, 4 tokens -> TTFT 100, E2E 300, TPOT 200/3, ITL 50 100 50
    B: sent 0.5, chunks 0.70 0.72 0.78, 5 tokens (one chunk held 3) -> TTFT 200, E2E 280, TPOT 80/4 = 20,
       ITL 20 60
    C: sent 1.0, one chunk at 1.40, 1 token -> TTFT 400, E2E 400, no TPOT, no ITL
    D: sent 1.2, failed (HTTP 500): counted nowhere but `failed`
    """
    return [
        RequestRecord(10, 4, send_time=0.0, chunk_times=[0.10, 0.15, 0.25, 0.30], num_output_tokens=4),
        RequestRecord(20, 5, send_time=0.5, chunk_times=[0.70, 0.72, 0.78], num_output_tokens=5,
                      num_prompt_tokens=20),
        RequestRecord(30, 1, send_time=1.0, chunk_times=[1.40], num_output_tokens=1),
        RequestRecord(40, 8, send_time=1.2, error="HTTP 500: boom"),
    ]


def approx_stats(mean, median, p90, p99) -> dict:
    return {"mean": pytest.approx(mean), "median": pytest.approx(median),
            "p90": pytest.approx(p90), "p99": pytest.approx(p99)}


def test_metrics_hand_computed_example():
    m = compute_metrics(example_records(), duration_s=2.0, slo_ms={"ttft": 250.0, "tpot": 50.0})
    assert (m["num_requests"], m["completed"], m["failed"]) == (4, 3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (10 + 20 + 30, 4 + 5 + 1)
    assert m["request_throughput"] == pytest.approx(3 / 2.0)
    assert m["input_throughput"] == pytest.approx(60 / 2.0)
    assert m["output_throughput"] == pytest.approx(10 / 2.0)
    assert m["total_token_throughput"] == pytest.approx(70 / 2.0)
    # Percentiles interpolate linearly between sorted values at rank (n - 1) * p / 100.
    # TTFT [100, 200, 400]: p90 at rank 1.8 -> 200 + 0.8 * 200, p99 at 1.98 -> 200 + 0.98 * 200
    assert m["ttft_ms"] == approx_stats(700 / 3, 200, 360, 396)
    # E2E [280, 300, 400]: p90 -> 300 + 0.8 * 100, p99 -> 300 + 0.98 * 100
    assert m["e2e_ms"] == approx_stats(980 / 3, 300, 380, 398)
    # TPOT [20, 200/3] (C has one token: no TPOT): p90 at rank 0.9 -> 20 + 0.9 * (200/3 - 20)
    assert m["tpot_ms"] == approx_stats((20 + 200 / 3) / 2, (20 + 200 / 3) / 2,
                                        20 + 0.9 * (200 / 3 - 20), 20 + 0.99 * (200 / 3 - 20))
    # ITL [20, 50, 50, 60, 100]: p90 at rank 3.6 -> 60 + 0.6 * 40, p99 at 3.96 -> 60 + 0.96 * 40
    assert m["itl_ms"] == approx_stats(280 / 5, 50, 84, 98.4)
    # Goodput, TTFT <= 250 and TPOT <= 50: A's TPOT (66.7) and C's TTFT (400) miss; B alone meets both.
    assert (m["num_good"], m["goodput"]) == (1, pytest.approx(1 / 2.0))


@pytest.mark.parametrize("slo, num_good", [
    ({"ttft": 500.0, "tpot": 50.0}, 2),    # B, and C: one token has no TPOT, which counts as meeting it
    ({"ttft": 500.0, "e2e": 350.0}, 2),    # A (300) and B (280); C's 400 misses
    ({"tpot": 70.0}, 3),
    ({"ttft": 99.0}, 0),                    # the failed request never counts
])
def test_goodput_slos(slo, num_good):
    m = compute_metrics(example_records(), duration_s=2.0, slo_ms=slo)
    assert m["num_good"] == num_good and m["goodput"] == pytest.approx(num_good / 2.0)


def test_no_completed_requests_and_no_slo():
    m = compute_metrics([RequestRecord(5, 5, error="HTTP 400")], duration_s=1.0)
    assert (m["completed"], m["failed"], m["goodput"], m["num_good"]) == (0, 1, None, None)
    assert m["ttft_ms"] == {"mean": None, "median": None, "p90": None, "p99": None}
    assert "Failed requests:" in format_summary(m)


def test_parse_slo():
    assert parse_slo("ttft=500, tpot=50,e2el=9000") == {"ttft": 500.0, "tpot": 50.0, "e2e": 9000.0}
    for bad in ("ttft", "itl=5", "ttft=fast", ""):
        with pytest.raises(Exception):
            parse_slo(bad)


# ---- datasets and arrivals ------------------------------------------------------------------
def test_shared_prefix_shapes():
    prompts = shared_prefix_dataset(np.random.default_rng(0), num_prompts=10, num_prefixes=3,
                                    prefix_len=16, suffix_len=4, output_len=7, vocab_size=VOCAB)
    assert len(prompts) == 10
    assert all(len(p.token_ids) == 20 and p.output_len == 7 for p in prompts)
    assert all(FIRST_REGULAR_ID <= t < VOCAB for p in prompts for t in p.token_ids)
    groups: dict[tuple, list] = {}
    for p in prompts:
        groups.setdefault(tuple(p.token_ids[:16]), []).append(tuple(p.token_ids[16:]))
    assert sorted(len(g) for g in groups.values()) == [3, 3, 4]
    assert len({s for g in groups.values() for s in g}) == 10  # every suffix is its own


def test_sharegpt_shapes():
    table = json.loads(SHAREGPT_LENGTHS.read_text())
    pairs = {tuple(p) for p in table["pairs"]}
    assert len(table["pairs"]) == 1000 and table["description"]
    prompts = sharegpt_dataset(np.random.default_rng(0), num_prompts=50, vocab_size=VOCAB, max_model_len=300)
    assert len(prompts) == 50
    for p in prompts:
        assert (len(p.token_ids), p.output_len) in pairs
        assert len(p.token_ids) + p.output_len <= 300
        assert all(FIRST_REGULAR_ID <= t < VOCAB for t in p.token_ids)
    # more prompts than pairs: the table is reused
    assert len(sharegpt_dataset(np.random.default_rng(1), 1500, VOCAB, None)) == 1500


def test_random_lengths_and_arrivals():
    prompts = random_dataset(np.random.default_rng(0), 200, input_len=100, output_len=10,
                             range_ratio=0.5, vocab_size=VOCAB)
    assert all(50 <= len(p.token_ids) <= 150 and 5 <= p.output_len <= 15 for p in prompts)
    assert len({len(p.token_ids) for p in prompts}) > 20
    fixed = random_dataset(np.random.default_rng(0), 5, 32, 8, 0.0, VOCAB)
    assert all(len(p.token_ids) == 32 and p.output_len == 8 for p in fixed)

    rng = np.random.default_rng(0)
    assert not arrival_offsets(rng, 5, math.inf, 1.0).any()
    for burstiness in (1.0, 0.25):
        offsets = arrival_offsets(rng, 20000, request_rate=10.0, burstiness=burstiness)
        gaps = np.diff(offsets)
        assert offsets[0] == 0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        # gamma(shape k, mean 1/rate): coefficient of variation 1/sqrt(k)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


# ---- against a real cluster -----------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_1p1d():
    from cluster_helpers import start_cluster
    cluster = start_cluster(1, 1)
    yield cluster
    cluster.stop()


def test_against_local_1p1d_cluster(cluster_1p1d, tmp_path, capsys):
    out = tmp_path / "serving.json"
    rc = main(["--base-url", cluster_1p1d.base_url, "--dataset", "random", "--num-prompts", "12",
               "--input-len", "32", "--output-len", "8", "--request-rate", "20",
               "--max-concurrency", "4", "--seed", "1", "--slo", "ttft=60000,tpot=60000",
               "--output", str(out), "--save-requests"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out and "12/12" in captured.err  # table, progress bar

    result = json.loads(out.read_text())
    m = result["metrics"]
    assert m["completed"] + m["failed"] == 12 and m["completed"] == 12
    assert m["total_input_tokens"] == 12 * 32 and m["total_output_tokens"] == 12 * 8
    assert m["num_good"] == 12
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(m[key]) == {"mean", "median", "p90", "p99"}
        assert all(v > 0 for v in m[key].values())
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0 and m["duration_s"] > 0
    assert result["config"]["model"] and result["config"]["num_prompts"] == 12

    requests = result["requests"]
    assert len(requests) == 12
    for r in requests:
        assert r["error"] is None and r["num_output_tokens"] == 8 and r["num_prompt_tokens"] == 32
        assert r["send_time"] <= r["chunk_times"][0] and r["chunk_times"] == sorted(r["chunk_times"])
    # --max-concurrency 4: never more than 4 requests in flight at once
    events = sorted([(r["send_time"], 1) for r in requests] + [(r["chunk_times"][-1], -1) for r in requests])
    assert max(np.cumsum([e for _, e in events])) <= 4


def test_multi_turn_against_local_1p1d_cluster(cluster_1p1d, tmp_path):
    """Closed-loop conversations: each turn's prompt holds the previous turn's and its answer,
    turns follow each other, and the report has per-turn TTFT and the prefix cache's counters."""
    from helpers import TEST_MODEL
    out = tmp_path / "multi.json"
    rc = main(["--base-url", cluster_1p1d.base_url, "--dataset", "multi-turn", "--num-conversations", "3",
               "--num-turns", "3", "--system-prompt-len", "64", "--turn-len", "16", "--output-len", "4",
               "--max-concurrency", "2", "--think-time", "0.05", "--no-progress", "--output", str(out),
               "--save-requests", *(["--tokenizer", TEST_MODEL] if TEST_MODEL else [])])
    assert rc == 0
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert (m["num_requests"], m["completed"]) == (9, 9) and m["total_output_tokens"] == 9 * 4
    requests = [result["requests"][3 * c:3 * c + 3] for c in range(3)]  # conversation by conversation
    for turns in requests:
        prompts = [r["num_prompt_tokens"] for r in turns]
        assert 64 + 16 <= prompts[0] and all(b >= a + 16 + 4 for a, b in zip(prompts, prompts[1:]))
        # closed loop: a turn is sent after the previous one's last chunk and the think time
        assert all(b["send_time"] >= a["chunk_times"][-1] + 0.05 for a, b in zip(turns, turns[1:]))
    # --max-concurrency 2 bounds conversations in flight
    spans = sorted([(t[0]["send_time"], 1) for t in requests] + [(t[-1]["chunk_times"][-1], -1) for t in requests])
    assert max(np.cumsum([e for _, e in spans])) <= 2

    turns = m["multi_turn"]
    assert [t["completed"] for t in turns["by_turn"]] == [3, 3, 3]
    assert turns["ttft_ms_first_turn"]["median"] > 0 and turns["ttft_ms_later_turns"]["median"] > 0
    assert m["cache"]["prompt_tokens"] == m["total_input_tokens"]
    assert m["cache"]["cached_tokens"] > 0 and turns["by_turn"][-1]["mean_cached_tokens"] > 0  # usage
    server = m["server"]  # the gateway's counters: later turns and the shared system prompt hit
    assert server["prefix_cache_query_tokens"]["total"] >= m["total_input_tokens"] - 9
    assert 64 <= server["prefix_cache_hit_tokens"]["total"] < server["prefix_cache_query_tokens"]["total"]
    assert 0 < server["prefill_tokens_computed"]["total"] < m["total_input_tokens"]
    assert server["kv_transfer_bytes"]["total"] > 0
    assert turns["by_turn"][0]["mean_kv_transfer_bytes"] > 0
