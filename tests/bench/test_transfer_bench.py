"""bench/transfer.py --quick on the CPU: every size, the steady-state rate (with its host time a
request) and a bit-exact check land in its JSON; with an FP8 KV cache the same tokens move half
the bytes of bf16."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_bench(tmp_path: Path, dtype: str) -> dict:
    out = tmp_path / f"{dtype}.json"
    subprocess.run([sys.executable, str(REPO_ROOT / "bench/transfer.py"), "--quick", "--backends", "tcp",
                    "--sizes-mib", "1,4", "--in-flight", "2", "--dtype", dtype, "--output", str(out)],
                   check=True, timeout=300, capture_output=True)
    return json.loads(out.read_text())


def test_quick_run_and_fp8_halves_the_bytes_per_token(tmp_path):
    bf16, fp8 = run_bench(tmp_path, "bfloat16"), run_bench(tmp_path, "float8_e4m3fn")
    for result in (bf16, fp8):
        (tcp,) = result["backends"]
        assert tcp["verify"]["ok"] and "error" not in tcp
        assert [row["size_mib"] for row in tcp["sizes"]] == [1, 4]
        assert all(row["pipelined_gbps"] > 0 and row["in_flight_requests"] == 8 for row in tcp["sizes"])
        for row in tcp["sizes"]:  # host time a request: wall, and each side's process CPU
            assert row["pipelined_us_per_request"] > 0
            assert 0 < row["pipelined_sender_cpu_us"] and 0 < row["pipelined_receiver_cpu_us"]
    assert fp8["layout"]["dtype"] == "float8_e4m3fn"
    assert fp8["layout"]["page_size"] == 2 * bf16["layout"]["page_size"]  # 1 MiB pages either way
    (bf16_row,), (fp8_row,) = bf16["backends"][0]["latency"], fp8["backends"][0]["latency"]
    assert bf16_row["tokens"] == fp8_row["tokens"] == 1024
    assert fp8_row["size_mib"] == bf16_row["size_mib"] / 2
