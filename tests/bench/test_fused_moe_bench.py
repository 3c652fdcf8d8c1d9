"""bench/fused_moe.py runs end to end on the CPU (the reference on both sides) and writes its
JSON; a fused side that disagrees with the reference fails the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)

import bench.fused_moe as moe_bench  # noqa: E402


def test_quick_cpu_run_writes_every_row(tmp_path):
    out = tmp_path / "fused_moe.json"
    assert moe_bench.main(["--device", "cpu", "--quick", "--calls", "2", "--repeats", "2",
                           "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 16]
    for row in rows:
        assert row["rel_err"] < 1e-6 and row["fused_us"] > 0 and row["torch_us"] > 0
        assert 1 <= row["experts_hit"] <= 8 and row["hit_weight_bytes"] > 0


def test_a_wrong_result_fails_the_run(monkeypatch):
    real = moe_bench.fused_moe
    monkeypatch.setattr(moe_bench, "fused_moe", lambda *a, **k: real(*a, **k) * 1.1)
    assert moe_bench.main(["--device", "cpu", "--quick", "--calls", "1", "--repeats", "1"]) == 1


def test_fp8_rows(tmp_path):
    out = tmp_path / "fused_moe.json"
    assert moe_bench.main(["--device", "cpu", "--quick", "--fp8", "--calls", "1", "--repeats", "1",
                           "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["weights"], r["tokens"]) for r in rows] == [
        ("float32", 1), ("float32", 16), ("fp8", 1), ("fp8", 16)]
    for dense, fp8 in zip(rows[:2], rows[2:]):
        per_dense = dense["hit_weight_bytes"] / dense["experts_hit"]
        assert fp8["hit_weight_bytes"] / fp8["experts_hit"] == per_dense / 4 + (2 * 32 + 64) * 4
        assert fp8["rel_err"] < 1e-6
