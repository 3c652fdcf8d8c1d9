"""bench/tp_handoff.py on CPU (gloo): the TP 2 / TP 1 prefill timing of a tiny preset, and a
1P(TP2)-1D(TP1) cluster of real processes serving every request, with its JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)

from bench.tp_handoff import main  # noqa: E402


def test_quick_run_on_cpu_writes_both_parts(tiny_checkpoints, tmp_path):
    out = tmp_path / "tp.json"
    assert main(["--preset", "tiny", "--device", "cpu", "--prefill-tokens", "64", "--repeats", "2",
                 "--model", str(tiny_checkpoints["llama3"]), "--requests", "3",
                 "--serve-tokens", "40", "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    prefill = record["prefill"]
    assert len(prefill["tp1_seconds"]) == len(prefill["tp2_seconds"]) == 2
    assert prefill["latency_ratio_tp2_to_tp1"] == prefill["tp2_median_s"] / prefill["tp1_median_s"] > 0
    serving = record["serving"]
    assert serving["completed"] == 3
    # 40 tokens = 3 pages of 16 of the tiny model's KV, whatever the TP sizes
    layout = json.loads((tiny_checkpoints["llama3"] / "config.json").read_text())
    head_dim = layout.get("head_dim") or layout["hidden_size"] // layout["num_attention_heads"]
    page_bytes = (layout["num_hidden_layers"] * 2 * 16 * layout["num_key_value_heads"] * head_dim * 4)
    assert all(r["transfer_bytes"] == 3 * page_bytes for r in serving["requests"])
    assert serving["transfer_gbps_median"] > 0
