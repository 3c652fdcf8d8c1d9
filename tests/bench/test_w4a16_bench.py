"""bench/w4a16.py runs end to end on the CPU (torch reference for the W4A16 side) and writes
its JSON; a weight whose GEMMs disagree is reported and fails the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)

import bench.w4a16 as w4a16_bench  # noqa: E402


def test_quick_cpu_run_writes_every_row(tmp_path):
    out = tmp_path / "w4a16.json"
    assert w4a16_bench.main(["--device", "cpu", "--quick", "--calls", "2", "--repeats", "2",
                             "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["layer"], r["batch"]) for r in result["rows"]] == [("small", 1), ("small", 4)]
    for row in result["rows"]:
        assert row["rel_err"] < 2e-2 and row["w4a16_us"] > 0 and row["bf16_us"] > 0
        assert abs(row["speedup"] - row["bf16_us"] / row["w4a16_us"]) < 1e-9 * row["speedup"]
        # 4 bits a weight plus fp16 scales per group of 128 (and packed zero points)
        assert row["w4a16_weight_bytes"] < row["bf16_weight_bytes"] / 3


def test_a_wrong_product_fails_the_run(tmp_path, monkeypatch):
    real = w4a16_bench.w4a16_matmul
    monkeypatch.setattr(w4a16_bench, "w4a16_matmul", lambda *a, **k: real(*a, **k) * 1.1)
    assert w4a16_bench.main(["--device", "cpu", "--quick", "--calls", "1", "--repeats", "1"]) == 1
