"""bench/planner_check.py: the planner's predictions against a measured phase-ratio sweep, on the
committed CPU sweep and profile, and on a made-up sweep whose errors are known."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)

from bench.planner_check import check, main, worker_limits  # noqa: E402
from pd_serve.planner.costs import load_profile  # noqa: E402
from pd_serve.planner.simulator import PoolLimits  # noqa: E402

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
    out = tmp_path / "check.json"
    assert main(["--profile", str(PROFILE), "--results", str(RESULTS), "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "goodput within 25%:" in text and "colocated2" in text
    saved = json.loads(out.read_text())
    assert saved["bar"] == 0.25 and len(saved["rows"]) == len(json.loads(RESULTS.read_text())["rows"])
