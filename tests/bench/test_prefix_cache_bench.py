"""bench/prefix_cache.py without clusters: its flags, the serving runs it asks for, the rows it
makes of bench/serving.py's metrics and the cache on / off ratios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)

from bench import prefix_cache  # noqa: E402
from bench.serving import build_parser, check_args  # noqa: E402


def test_defaults_per_device_and_serving_argv():
    cpu = prefix_cache.parse_args(["--device", "cpu", "--num-turns", "3"])
    assert (cpu.prefix_len, cpu.num_turns, cpu.request_rate, cpu.modes) == (256, 3, 0.5, ["colocated", "1p1d"])
    for dataset in ("shared-prefix", "multi-turn"):
        argv = prefix_cache.dataset_argv(cpu, dataset)
        p = build_parser()
        args = p.parse_args(argv)
        check_args(p, args)  # bench/serving.py takes them
        assert args.dataset == dataset and args.output_len == cpu.output_len and args.seed == cpu.seed
    mt = build_parser().parse_args(prefix_cache.dataset_argv(cpu, "multi-turn"))
    assert (mt.num_turns, mt.request_rate, mt.tokenizer) == (3, cpu.conversation_rate, None)
    gpu = prefix_cache.build_parser().parse_args([])
    for name, _, cuda in prefix_cache.DEFAULTS:  # the issue's workload on CUDA
        assert getattr(gpu, name) is None and cuda
    with pytest.raises(SystemExit):
        prefix_cache.parse_args(["--device", "cpu", "--modes", "2p2d"])
    with pytest.raises(SystemExit):
        prefix_cache.parse_args(["--device", "cpu", "--preset", "llama3-8b"])  # needs --tokenizer


def _metrics(ttft_ms: float, server: dict | None, turns: dict | None = None) -> dict:
    stats = {"mean": ttft_ms, "median": ttft_ms, "p90": 2 * ttft_ms, "p99": 3 * ttft_ms}
    m = {"completed": 10, "failed": 0, "duration_s": 5.0, "request_throughput": 2.0,
         "output_throughput": 20.0, "total_token_throughput": 220.0, "ttft_ms": stats, "tpot_ms": stats,
         "cache": {"prompt_tokens": 1000, "cached_tokens": None}, "server": server}
    return m | ({"multi_turn": turns} if turns else {})


def _counter(**by_worker: float) -> dict:
    return {"total": sum(by_worker.values()), "by_worker": by_worker}


def test_summarize_and_ratios():
    on = prefix_cache.summarize(_metrics(100.0, {
        "prefill_tokens_computed": _counter(**{"prefill-0": 150.0}),
        "prefix_cache_hit_tokens": _counter(**{"prefill-0": 800.0, "decode-1": 700.0}),
        "prefix_cache_query_tokens": _counter(**{"prefill-0": 1000.0}),
        "kv_transfer_bytes": _counter(**{"prefill-0": 4000.0})}, turns={
        "ttft_ms_first_turn": {"median": 300.0}, "ttft_ms_later_turns": {"median": 50.0, "p90": 80.0},
        "by_turn": [{"mean_kv_transfer_bytes": 1000.0}, {"mean_kv_transfer_bytes": 100.0},
                    {"mean_kv_transfer_bytes": 300.0}]}))
    # the prefill side's hits only: the decode worker's are reported apart
    assert (on["prefix_cache_hit_tokens"], on["decode_prefix_cache_hit_tokens"]) == (800.0, 700.0)
    assert (on["prompt_minus_hit_tokens"], on["prefill_tokens_computed"]) == (200.0, 150.0)
    assert on["kv_transfer_bytes_per_request"] == 400.0 and on["kv_transfer_bytes_per_later_turn"] == 200.0
    assert (on["ttft_p50_ms"], on["ttft_p90_ms"], on["ttft_later_turns_p50_ms"]) == (100.0, 200.0, 50.0)

    off = prefix_cache.summarize(_metrics(400.0, {
        "prefill_tokens_computed": _counter(**{"prefill-0": 1000.0}),
        "kv_transfer_bytes": _counter(**{"prefill-0": 8000.0})}))
    assert off["prefix_cache_hit_tokens"] is None and off["kv_transfer_bytes"] == 8000.0
    no_server = prefix_cache.summarize(_metrics(400.0, None))  # not a pd-serve gateway: no counters
    assert no_server["prefill_tokens_computed"] is None and no_server["kv_transfer_bytes"] is None

    runs = [{"mode": "1p1d", "dataset": "multi-turn", "cache": "on"} | on,
            {"mode": "1p1d", "dataset": "multi-turn", "cache": "off"} | off,
            {"mode": "colocated", "dataset": "multi-turn", "cache": "on"} | on]  # no off: no ratio
    (ratio,) = prefix_cache.ratios(runs)
    assert (ratio["mode"], ratio["dataset"]) == ("1p1d", "multi-turn")
    assert ratio["on_over_off"] == {"prefill_tokens_computed": 0.15, "kv_transfer_bytes": 0.5,
                                    "ttft_p50_ms": 0.25, "ttft_p90_ms": 0.25,
                                    "request_throughput": 1.0, "output_throughput": 1.0}
    table = prefix_cache.format_table({"runs": runs, "ratios": [ratio]})
    assert "on/off 1p1d multi-turn: prefill_tokens_computed 0.150" in table


def test_preset_model_takes_the_tokenizers_vocabulary(tmp_path, default_model_dir):
    out = prefix_cache.preset_model("llama3-8b", Path(default_model_dir), tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 4096 and config["num_hidden_layers"] == 32
    assert config["vocab_size"] == 49152 and (out / "tokenizer.json").exists()
