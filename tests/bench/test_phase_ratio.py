"""bench/phase_ratio.py: configuration names and defaults, rates, the best-configuration pick, and
a small sweep of two real CPU clusters (1P1D and one colocated worker) with every output file."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)

from bench import phase_ratio  # noqa: E402
from bench.phase_ratio import (Deployment, auto_rates, best_rows, default_deployments,  # noqa: E402
                               format_best, format_capacity, main, parse_args, parse_deployments,
                               parse_rates, planned_capacity, slo_capacity)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_configuration_names():
    assert parse_deployments("1p1d, 2P1D,colocated2,colocated1,1p1d") == [
        Deployment(1, 1), Deployment(2, 1), Deployment(num_colocated=2), Deployment(num_colocated=1)]
    assert [d.name for d in default_deployments(3)] == ["1p2d", "2p1d", "colocated3"]
    assert [d.name for d in default_deployments(1)] == ["colocated1"]
    assert Deployment(2, 1).num_slots == 3 and Deployment(num_colocated=4).num_slots == 4
    for bad in ("1p0d", "0p1d", "colocated0", "2p", "colocated", "", "1p1d,xyz"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_deployments(bad)


def test_rates():
    assert parse_rates("4,1, 2,1") == [1.0, 2.0, 4.0]
    for bad in ("", "0", "-1", "inf", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
    assert auto_rates(3.3) == [0.82, 1.6, 2.5, 3.3, 4.1]


def test_rates_from_the_planner(capsys):
    """--rate-sweep plan: each configuration's capacity as the simulator predicts it on the
    profile (all prompts at once); the rates are the auto fractions of the largest."""
    profile = REPO_ROOT / "bench" / "results" / "profile-cpu-smollm2.json"
    flags = ["--device", "cpu", "--configs", "1p1d,colocated2,colocated1", "--slo",
             "ttft=1500,tpot=150", "--input-len", "64", "--output-len", "16", "--num-prompts", "48"]
    args = parse_args([*flags, "--rate-sweep", "plan", "--profile", str(profile)])
    capacity = planned_capacity(args)
    assert list(capacity) == ["1p1d", "colocated2", "colocated1"]
    # two colocated workers take the burst in about half the time one does
    assert 1.6 < capacity["colocated2"] / capacity["colocated1"] < 2.4
    assert all(0 < c < 100 for c in capacity.values())
    for bad in (["--rate-sweep", "plan"], ["--request-rates", "1", "--profile", str(profile)]):
        with pytest.raises(SystemExit):
            parse_args([*flags, *bad])
    assert "--rate-sweep plan and --profile go together" in capsys.readouterr().err
    gpu_profile = REPO_ROOT / "bench" / "results" / "profile-h200-llama3-8b.json"
    for bad, why in ((gpu_profile, "was recorded on cuda, this sweep runs on cpu"),
                     (REPO_ROOT / "no-such-profile.json", "no such file")):
        with pytest.raises(SystemExit):
            parse_args([*flags, "--rate-sweep", "plan", "--profile", str(bad)])
        assert why in capsys.readouterr().err
    parse_args([*flags, "--rate-sweep", "plan", "--profile", str(profile), "--model", "/models/other"])
    assert "is of model 'SmolLM2" in capsys.readouterr().err  # a warning: the sweep may go on


def row(config: str, rate: float, goodput: float, attainment: float, num_slots: int = 2) -> dict:
    return {"config": config, "request_rate": rate, "goodput": goodput,
            "slo_attainment": attainment, "num_slots": num_slots}


def test_best_configuration():
    rows = [row("1p1d", 1, 0.90, 1.0), row("colocated2", 1, 0.95, 1.0),
            row("colocated1", 1, 0.95, 1.0, num_slots=1), row("1p1d", 4, 3.20, 0.8),
            row("colocated2", 4, 2.00, 0.5), row("colocated1", 4, 1.00, 0.25, num_slots=1)]
    per_rate, overall = best_rows(rows)
    # at rate 1 colocated2 and colocated1 tie on goodput and attainment: the one with fewer slots wins
    assert {rate: r["config"] for rate, r in per_rate.items()} == {1: "colocated1", 4: "1p1d"}
    assert overall["config"] == "1p1d" and overall["request_rate"] == 4
    text = format_best(rows)
    assert "1 req/s: colocated1" in text and "within 2%: colocated2" in text  # 1p1d is 5% behind
    assert "best overall: 1p1d at 4 req/s" in text
    assert best_rows([]) == ({}, None) and format_best([]) == "no results"


def test_slo_capacity_interpolates_at_the_first_drop_and_bounds_the_rest():
    """The highest rate at >= 90 % attainment: linear between the two rates around the first
    drop below 90 % (a later recovery does not count); a bound when the sweep never crosses it."""
    rows = [row("1p1d", 1, 1.0, 1.0), row("1p1d", 2, 1.9, 0.95), row("1p1d", 4, 2.0, 0.75),
            row("1p1d", 6, 3.0, 0.95),
            row("colocated2", 1, 1.0, 1.0), row("colocated2", 4, 3.9, 0.97),
            row("colocated1", 1, 0.5, 0.5, num_slots=1), row("colocated1", 2, 0.2, 0.1, num_slots=1)]
    cap = slo_capacity(rows)
    assert cap["1p1d"]["bound"] == "=" and cap["1p1d"]["rate"] == pytest.approx(2 + 2 * 0.05 / 0.2)
    assert cap["1p1d"]["per_slot"] == pytest.approx(cap["1p1d"]["rate"] / 2)
    assert (cap["colocated2"]["bound"], cap["colocated2"]["rate"]) == (">=", 4)
    assert (cap["colocated1"]["bound"], cap["colocated1"]["rate"]) == ("<", 1)
    text = format_capacity(cap)
    assert "1p1d 2.5 req/s (1.25 per slot)" in text and "colocated2 >=4 req/s (>=2 per slot)" in text
    assert "colocated1 <1 req/s (<1 per slot)" in text and "90%" in text


def test_sweep_two_cpu_configurations(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(phase_ratio, "busy_cores", lambda seconds=1.0: 1.25)  # other load
    out_dir = tmp_path / "sweep"
    num_prompts, rates = 6, [2.0, 4.0]
    rc = main(["--device", "cpu", "--configs", "1p1d,colocated1", "--request-rates", "2,4",
               "--slo", "ttft=60000,tpot=60000", "--worker-args", "--max-total-tokens 8192",
               "--dataset", "random", "--num-prompts", str(num_prompts), "--input-len", "16",
               "--output-len", "4", "--no-progress", "--output-dir", str(out_dir)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "TTFT p50/p90/p99" in captured.out and "best overall:" in captured.out
    assert "1p1d: rate 2 req/s" in captured.err and "colocated1: ready" in captured.err  # progress
    assert "warning: other processes kept 1.25 of" in captured.err  # other load: said

    result = json.loads((out_dir / "results.json").read_text())
    assert result["benchmark"] == "phase_ratio" and result["commit"]
    assert result["device"]["type"] == "cpu" and result["device"]["num_slots"] == 2
    assert result["device"]["busy_cores_at_start"] == 1.25
    assert result["config"]["configs"] == ["1p1d", "colocated1"] and result["failures"] == []
    assert result["config"]["serving"]["input_len"] == 16
    rows = result["rows"]
    assert sorted((r["config"], r["request_rate"]) for r in rows) == \
        sorted((c, rate) for c in ("1p1d", "colocated1") for rate in rates)
    for r in rows:
        assert r["num_requests"] == num_prompts and r["completed"] + r["failed"] == num_prompts
        assert r["completed"] == num_prompts and r["num_good"] == num_prompts and r["slo_attainment"] == 1.0
        assert r["goodput"] == pytest.approx(r["request_throughput"]) and r["output_throughput"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["tpot_p50_ms"] <= r["tpot_p90_ms"] <= r["tpot_p99_ms"]
        latencies = r["latencies_ms"]  # per request: TTFT, TPOT, E2E
        assert len(latencies) == num_prompts and all(ttft <= e2e for ttft, _, e2e in latencies)
        assert max(ttft for ttft, _, _ in latencies) == pytest.approx(r["ttft_p99_ms"], rel=0.2)
        phases = r["server_timings_ms"]  # the gateway's, from each stream's finishing chunk
        assert {"queue", "first_token", "e2e"} <= set(phases) and "transfer_bytes" not in phases
        assert (r["config"] == "1p1d") == ({"prefill", "prefill_step", "transfer"} <= set(phases))
        assert all(0 <= p["p50"] <= p["p90"] for p in phases.values())
        assert phases["first_token"]["p50"] <= r["ttft_p50_ms"]  # the client's clock starts first
        cpu = r["host_cpu"]  # cores each process kept busy while the rate ran
        names = {"client", "gateway"} | ({"prefill-0", "decode-1"} if r["config"] == "1p1d"
                                         else {"colocated-0"})
        assert set(cpu["cores_used"]) == names and cpu["cores"] == os.cpu_count()
        assert all(0 <= v <= cpu["cores"] for v in cpu["cores_used"].values())
        assert cpu["total"] == pytest.approx(sum(cpu["cores_used"].values()), abs=0.01)
        assert cpu["cores_used"]["client"] > 0 and cpu["total"] > 0
        assert cpu["wall_s"] >= cpu["benchmark_s"] > 0
    assert [(r["num_prefill"], r["num_decode"], r["num_colocated"]) for r in rows if r["config"] == "1p1d"] \
        == [(1, 1, 0)] * 2

    with open(out_dir / "results.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows) and {"goodput", "slo_attainment", "tpot_p99_ms"} <= set(csv_rows[0])
    assert all(int(r["completed"]) + int(r["failed"]) == num_prompts for r in csv_rows)
    png = (out_dir / "results.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
