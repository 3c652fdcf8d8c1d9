"""bench/planner_check.py: the planner's predictions against a measured phase-ratio sweep, on the
committed CPU sweep and profile, and on a made-up sweep whose errors are known."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)

from bench.planner_check import (capacity_check, check, main, request_errors,  # noqa: E402
                                 worker_limits)
from pd_serve.planner.costs import load_profile  # noqa: E402
from pd_serve.planner.simulator import PoolLimits, SimRequest  # noqa: E402

PROFILE = REPO_ROOT / "bench/results/profile-cpu-smollm2.json"
RESULTS = REPO_ROOT / "bench/results/phase-ratio-cpu/results.json"


def test_worker_limits_come_from_the_sweeps_worker_flags():
    assert worker_limits(["--device", "cpu", "--max-total-tokens", "8192"]) == PoolLimits()
    assert worker_limits(["--max-running-requests", "8", "--chunked-prefill-size", "256",
                          "--device", "cpu"]) == PoolLimits(8, 256)


def test_errors_are_relative_to_the_measured_goodput():
    results = json.loads(RESULTS.read_text())
    profile = load_profile(PROFILE)
    rows = check(profile, results)
    assert [(r["config"], r["request_rate"]) for r in rows] == \
        [(r["config"], r["request_rate"]) for r in results["rows"]]
    assert all(r["predicted_goodput"] > 0 for r in rows)
    # The same sweep with every measured goodput halved (and one zeroed): errors follow.
    changed = copy.deepcopy(results)
    for row in changed["rows"]:
        row["goodput"] = row["goodput"] / 2
    changed["rows"][0]["goodput"] = 0.0
    again = check(profile, changed)
    for before, after, row in zip(rows, again, changed["rows"]):
        assert after["predicted_goodput"] == before["predicted_goodput"]  # deterministic
        if row["goodput"] > 0:
            assert after["relative"]
            assert abs(after["error"] - (before["predicted_goodput"] / row["goodput"] - 1)) < 1e-9
    assert not again[0]["relative"] and again[0]["error"] == again[0]["predicted_goodput"]
    # Workers with a smaller decode batch limit are predicted differently.
    limited = copy.deepcopy(results)
    limited["config"]["worker_args"] = ["--max-running-requests", "1"]
    assert [r["predicted_goodput"] for r in check(profile, limited)] != \
        [r["predicted_goodput"] for r in rows]


def test_main_prints_the_table_and_writes_json(tmp_path, capsys):
    out, png = tmp_path / "check.json", tmp_path / "check.png"
    assert main(["--profile", str(PROFILE), "--results", str(RESULTS), "--output", str(out),
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "goodput within 25%:" in text and "colocated2" in text and "per request TTFT/TPOT" in text
    saved = json.loads(out.read_text())
    assert saved["bar"] == 0.25 and len(saved["rows"]) == len(json.loads(RESULTS.read_text())["rows"])
    assert "SLO capacity" in text and [c["config"] for c in saved["slo_capacity"]] == \
        ["1p1d", "colocated2", "colocated1"]


def test_capacity_check_compares_the_90_percent_rates():
    """Measured and predicted SLO capacity, each interpolated over the swept rates; an error
    only where both are pinned, a lower bound where one is, none where both are the same bound."""
    def r(config, rate, measured, predicted):
        return {"config": config, "request_rate": rate, "measured_attainment": measured,
                "predicted_attainment": predicted}

    rows = [r("1p1d", 1, 1.0, 1.0), r("1p1d", 2, 0.8, 0.875),       # 1.5 vs 1.8 (+20 %)
            r("colocated2", 1, 1.0, 1.0), r("colocated2", 2, 0.5, 0.95),  # 1.2 vs >= 2
            r("colocated1", 1, 0.5, 0.4), r("colocated1", 2, 0.1, 0.1)]   # both < 1
    by_config = {c["config"]: c for c in capacity_check(rows)}
    assert by_config["1p1d"]["exact"] and by_config["1p1d"]["error"] == pytest.approx(0.2)
    c2 = by_config["colocated2"]
    assert not c2["exact"] and c2["predicted_bound"] == ">=" and c2["error"] == pytest.approx(2 / 1.2 - 1)
    assert by_config["colocated1"]["error"] is None and by_config["colocated1"]["measured_bound"] == "<"


def test_other_slos_count_the_measured_requests_again(tmp_path, capsys):
    """--slo: the measured goodput is counted from the rows' per-request latencies (here made
    up, so the count is known) and the simulator runs with the new SLOs."""
    results = json.loads(RESULTS.read_text())
    profile = load_profile(PROFILE)
    row = results["rows"][0]
    n, duration = row["num_requests"], row["duration_s"]
    # TPOT 10, 20, ... ms; TTFT 100 ms; every fourth request failed
    row["latencies_ms"] = [None if i % 4 == 3 else [100.0, 10.0 * (i + 1), 500.0] for i in range(n)]
    results["rows"] = [row]
    strict = {"ttft": 1500.0, "tpot": 35.0}  # tpot 10, 20, 30 pass; 40 (i = 3) failed anyway
    [out] = check(profile, results, strict)
    assert out["measured_goodput"] == 3 / duration and out["measured_attainment"] == 3 / n
    assert out["predicted_goodput"] != check(profile, results)[0]["predicted_goodput"]
    [same] = check(profile, results, dict(results["config"]["slo_ms"]) | {"e2e": 400.0})
    assert same["measured_goodput"] == 0.0  # every E2E is 500 ms
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert main(["--profile", str(PROFILE), "--results", str(path), "--slo", "ttft=1500,tpot=35"]) == 0
    del results["rows"][0]["latencies_ms"]  # a sweep from before the latencies were kept
    path.write_text(json.dumps(results))
    with pytest.raises(SystemExit):
        main(["--profile", str(PROFILE), "--results", str(path), "--slo", "ttft=1500,tpot=35"])
    assert "no per-request latencies" in capsys.readouterr().err


def test_request_errors_compare_each_request():
    """Request by request, in send order: |predicted / measured - 1| of TTFT and TPOT, over the
    requests that completed; their median and p90."""
    simulated = [SimRequest(0.0, 8, 3, token_times=[0.1, 0.2, 0.3]),  # TTFT 100, TPOT 100 ms
                 SimRequest(1.0, 8, 3, token_times=[1.2, 1.3, 1.5]),  # TTFT 200, TPOT 150 ms
                 SimRequest(2.0, 8, 3, token_times=[2.1, 2.2, 2.3])]
    measured = [[125.0, 100.0, 300.0], [200.0, 120.0, 440.0], None]  # the third failed
    errors = request_errors(simulated, measured)
    assert errors["ttft"]["median"] == pytest.approx(0.1)  # |0.8 - 1| and 0
    assert errors["ttft"]["p90"] == pytest.approx(0.18)
    assert errors["tpot"]["median"] == pytest.approx(0.125)  # 0 and 150 / 120 - 1
    assert errors["tpot"]["p90"] == pytest.approx(0.225)
    assert request_errors(simulated, None) is None  # a sweep without per-request latencies
    # check() gives every row its request errors when the sweep kept latencies
    results = json.loads(RESULTS.read_text())
    row = results["rows"][0]
    row["latencies_ms"] = [[100.0, 50.0, 500.0]] * row["num_requests"]
    [out] = check(load_profile(PROFILE), dict(results, rows=[row]))
    assert set(out["request_error"]) == {"ttft", "tpot"}
    assert check(load_profile(PROFILE), results)[1]["request_error"] is None


def test_a_gpu_profile_runs_colocated_workers_under_the_overlap_schedule():
    """The committed H200 profile has host and device times: colocated x2 at 21 req/s (a
    committed 2 x H200 sweep) comes out within 5 % of its measured goodput. Charged as whole
    steps, the few-token rests of prompts cost their eager launches and it is >10 % low."""
    profile = load_profile(REPO_ROOT / "bench/results/profile-h200-llama3-8b.json")
    results = json.loads((REPO_ROOT / "bench/results/phase-ratio-h200x2-prefill-runs/run3/"
                          "results.json").read_text())
    results["rows"] = [r for r in results["rows"]
                       if r["config"] == "colocated2" and r["request_rate"] == 21.0]
    [pipelined] = check(profile, results)
    whole = copy.deepcopy(profile)
    for point in whole["prefill"]["points"] + whole["mixed"]["points"]:
        del point["host_s"], point["device_s"]
    [whole_steps] = check(whole, results)
    assert abs(pipelined["error"]) < 0.05, pipelined
    assert whole_steps["error"] < -0.10, whole_steps
