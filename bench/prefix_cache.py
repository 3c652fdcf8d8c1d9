"""The prefix cache's gain: colocated and 1P1D clusters with the radix cache on and with
--disable-radix-cache, each serving a shared-prefix and a multi-turn workload at the same rates.

    python bench/prefix_cache.py --device cpu --output bench/results/prefix-cache-cpu.json
    python bench/prefix_cache.py --device cuda --preset llama3-8b --tokenizer .gpu-model/tok \\
        --output prefix-cache-h200.json      # Llama-3.1-8B's shape, dummy weights, one GPU

Each (mode, cache) pair is a fresh `pd_serve.launch.LocalCluster` (on CUDA every worker shares
--gpu-ids, 1P1D's two with --mem-fraction-static 0.42 each); after a short warm-up it runs
bench/serving.py's shared-prefix dataset at --request-rate, then its multi-turn dataset with
conversations starting at --conversation-rate, the same prompts (--seed) in every pair. Per run:
prefill tokens computed (the workers' pd_serve:prompt_tokens counter; also prompt tokens minus
the prefill side's prefix cache hits), cached tokens as usage reported them, KV bytes the
prefill sent (1P1D; for multi-turn also per turn after the first), TTFT p50/p90 (multi-turn:
first and later turns too) and throughput; per (mode, dataset) the ratios cache on / off. The
JSON is rewritten after every run, so an interrupted run keeps what it measured. --preset serves
dummy weights of that shape with --tokenizer's vocabulary (its rows replace the preset's).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/prefix_cache.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import serving  # noqa: E402
from bench._common import git_commit, write_json  # noqa: E402
from bench.one_batch import PRESETS  # noqa: E402
from bench.phase_ratio import Deployment, start_cluster  # noqa: E402
from pd_serve.launch import LaunchError, launch_transfer_args  # noqa: E402

MODES = {"colocated": Deployment(num_colocated=1), "1p1d": Deployment(num_prefill=1, num_decode=1)}
SHARED_MEM_FRACTION = "0.42"  # each of 1P1D's two workers when they share one GPU
# Workload defaults per device: (flag, CPU, CUDA). The CUDA ones are the prefix-cache issue's.
DEFAULTS = [("num_prompts", 16, 128), ("num_prefixes", 4, 16), ("prefix_len", 256, 2048),
            ("suffix_len", 32, 128), ("output_len", 8, 128), ("request_rate", 0.5, 8.0),
            ("num_conversations", 4, 32), ("num_turns", 4, 8), ("system_prompt_len", 256, 1024),
            ("turn_len", 32, 256), ("conversation_rate", 0.25, 4.0)]
RATIO_KEYS = ["prefill_tokens_computed", "kv_transfer_bytes", "kv_transfer_bytes_per_later_turn",
              "ttft_p50_ms", "ttft_p90_ms", "ttft_later_turns_p50_ms", "request_throughput",
              "output_throughput"]


def log(message: str) -> None:
    print(f"[prefix-cache] {message}", file=sys.stderr, flush=True)


def dataset_argv(args: argparse.Namespace, dataset: str) -> list[str]:
    """bench/serving.py's flags for one dataset's run."""
    common = ["--seed", str(args.seed), "--output-len", str(args.output_len), "--no-progress"]
    if dataset == "shared-prefix":
        return common + ["--dataset", "shared-prefix", "--num-prompts", str(args.num_prompts),
                         "--num-prefixes", str(args.num_prefixes), "--prefix-len", str(args.prefix_len),
                         "--suffix-len", str(args.suffix_len), "--request-rate", str(args.request_rate)]
    tokenizer = ["--tokenizer", str(args.model)] if args.model else []
    return common + tokenizer + [
        "--dataset", "multi-turn", "--num-conversations", str(args.num_conversations),
        "--num-turns", str(args.num_turns), "--system-prompt-len", str(args.system_prompt_len),
        "--turn-len", str(args.turn_len), "--request-rate", str(args.conversation_rate)]


def run_serving(base_url: str, argv: list[str]) -> dict:
    """bench/serving.py's metrics for one run (its printed table dropped)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serving.json"
        with contextlib.redirect_stdout(io.StringIO()):
            serving.main([*argv, "--base-url", base_url, "--output", str(out)])
        if not out.exists():
            raise LaunchError(f"the serving benchmark could not use {base_url} (see above)")
        return json.loads(out.read_text(encoding="utf-8"))["metrics"]


def summarize(metrics: dict) -> dict:
    """One run's row: what the prefix cache should change, and the run's throughput."""
    server = metrics.get("server") or {}

    def total(key: str, prefill_side: bool = False) -> float | None:
        if key not in server:
            return None
        workers = server[key]["by_worker"]
        return sum(v for w, v in workers.items() if not (prefill_side and w.startswith("decode")))

    prompt = metrics["cache"]["prompt_tokens"]
    hits = total("prefix_cache_hit_tokens", prefill_side=True)
    row = {"completed": metrics["completed"], "failed": metrics["failed"],
           "duration_s": metrics["duration_s"], "prompt_tokens": prompt,
           "cached_tokens": metrics["cache"]["cached_tokens"],
           "prefix_cache_hit_tokens": hits,
           "prefix_cache_query_tokens": total("prefix_cache_query_tokens", prefill_side=True),
           "decode_prefix_cache_hit_tokens": (None if hits is None else
                                              total("prefix_cache_hit_tokens") - hits),
           "prefill_tokens_computed": total("prefill_tokens_computed"),
           "prompt_minus_hit_tokens": None if hits is None else prompt - hits,
           "kv_transfer_bytes": total("kv_transfer_bytes"),
           "ttft_p50_ms": metrics["ttft_ms"]["median"], "ttft_p90_ms": metrics["ttft_ms"]["p90"],
           "tpot_p50_ms": metrics["tpot_ms"]["median"],
           "request_throughput": metrics["request_throughput"],
           "output_throughput": metrics["output_throughput"],
           "total_token_throughput": metrics["total_token_throughput"]}
    if row["kv_transfer_bytes"] is not None and metrics["completed"]:
        row["kv_transfer_bytes_per_request"] = row["kv_transfer_bytes"] / metrics["completed"]
    if turns := metrics.get("multi_turn"):
        later = [t["mean_kv_transfer_bytes"] for t in turns["by_turn"][1:]
                 if t["mean_kv_transfer_bytes"] is not None]
        row |= {"ttft_first_turn_p50_ms": turns["ttft_ms_first_turn"]["median"],
                "ttft_later_turns_p50_ms": turns["ttft_ms_later_turns"]["median"],
                "ttft_later_turns_p90_ms": turns["ttft_ms_later_turns"]["p90"],
                "kv_transfer_bytes_per_later_turn": sum(later) / len(later) if later else None,
                "by_turn": turns["by_turn"]}
    return row


def ratios(runs: list[dict]) -> list[dict]:
    """Per (mode, dataset) with both cache settings measured: on / off of each RATIO_KEYS value."""
    rows = {(r["mode"], r["dataset"], r["cache"]): r for r in runs}
    out = []
    for (mode, dataset, cache), on in rows.items():
        off = rows.get((mode, dataset, "off"))
        if cache != "on" or off is None:
            continue
        values = {k: on[k] / off[k] for k in RATIO_KEYS
                  if on.get(k) is not None and off.get(k) not in (None, 0)}
        out.append({"mode": mode, "dataset": dataset, "on_over_off": values})
    return out


def run_pair(args: argparse.Namespace, mode: str, cache: str, runs: list[dict], record: dict) -> None:
    """One cluster: warm-up, then each dataset; every run's row goes into `runs` and the JSON."""
    deployment = MODES[mode]
    worker_args = list(args.base_worker_argv)
    if cache == "off":
        worker_args.append("--disable-radix-cache")
    if mode == "1p1d" and args.device == "cuda" and len(args.gpu_ids) == 1:
        worker_args += ["--mem-fraction-static", SHARED_MEM_FRACTION]
    cluster_args = argparse.Namespace(
        device=args.device, cpu_threads=args.cpu_threads,
        worker_argv=worker_args + launch_transfer_args(worker_args), gateway_argv=args.gateway_argv,
        cluster_log_level="warning", gpu_ids=args.gpu_ids, startup_timeout=args.startup_timeout)
    start = time.perf_counter()
    with start_cluster(cluster_args, deployment) as cluster:
        log(f"{mode} cache {cache}: ready in {time.perf_counter() - start:.1f} s")
        run_serving(cluster.base_url, ["--dataset", "random", "--num-prompts", "4", "--input-len", "64",
                                       "--output-len", "4", "--no-progress"])
        for dataset in ("shared-prefix", "multi-turn"):
            metrics = run_serving(cluster.base_url, dataset_argv(args, dataset))
            row = {"mode": mode, "cache": cache, "dataset": dataset} | summarize(metrics)
            runs.append(row)
            log(f"{mode} cache {cache} {dataset}: {row['completed']} done, {row['failed']} failed, "
                f"prefill tokens {row['prefill_tokens_computed']}, TTFT p50 {row['ttft_p50_ms']} ms")
            if dead := [name for name, proc in cluster.procs if proc.poll() is not None]:
                raise LaunchError(f"{', '.join(dead)} exited during the run")
            record["ratios"] = ratios(runs)
            if args.output:
                write_json(args.output, record)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="dummy weights of this shape")
    p.add_argument("--tokenizer", help="with --preset: folder with tokenizer.json (and its config)")
    p.add_argument("--modes", default="colocated,1p1d", help="comma list of colocated, 1p1d")
    p.add_argument("--gpu-ids", default="0", help="GPUs the workers share in turn (default: 0)")
    p.add_argument("--worker-args", default="", help="more flags for every worker, one string")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="CPU: torch threads per worker; more than the cores free on a busy box "
                        "slows every step down (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the JSON here")
    w = p.add_argument_group("workload (default: the device's; see DEFAULTS)")
    for name, _, _ in DEFAULTS:
        w.add_argument(f"--{name.replace('_', '-')}", type=float if "rate" in name else int, default=None)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, cpu, cuda in DEFAULTS:
        if getattr(args, name) is None:
            setattr(args, name, cuda if args.device == "cuda" else cpu)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown {', '.join(bad)} (choose from {', '.join(MODES)})")
    if bool(args.preset) != bool(args.tokenizer) or (args.preset and args.model):
        p.error("--preset goes with --tokenizer, and not with --model")
    args.gpu_ids = args.gpu_ids.split(",")
    return args


def preset_model(preset: str, tokenizer_dir: Path, out_dir: Path) -> Path:
    """A model folder of `preset`'s config with the tokenizer's files and vocabulary size (and
    an 8192-token context), for --load-format dummy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    vocab = serving.load_tokenizer(str(out_dir)).vocab_size
    config = PRESETS[preset] | {"vocab_size": vocab, "max_position_embeddings": 8192,
                                "bos_token_id": 1, "eos_token_id": 2}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="prefix-cache-") as tmp:
        dummy = []
        if args.preset:
            args.model = preset_model(args.preset, Path(args.tokenizer), Path(tmp) / args.preset)
            dummy = ["--load-format", "dummy"]
        model = ["--model", str(args.model)] if args.model else []
        args.base_worker_argv = ["--device", args.device, *model, *dummy, *shlex.split(args.worker_args)]
        args.gateway_argv = model
        workload = {name: getattr(args, name) for name, _, _ in DEFAULTS}
        record = {"bench": "prefix_cache", "commit": git_commit(), "device": args.device,
                  "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                  "model": args.preset or str(args.model or "default"),
                  "worker_args": args.worker_args, "modes": args.modes, "workload": workload,
                  "runs": runs, "ratios": []}
        try:
            for mode in args.modes:
                for cache in ("on", "off"):
                    log(f"{mode} cache {cache}: starting")
                    try:
                        run_pair(args, mode, cache, runs, record)
                    except LaunchError as e:
                        log(f"{mode} cache {cache}: failed: {e}")
                        record.setdefault("errors", []).append(f"{mode} cache {cache}: {e}")
        except KeyboardInterrupt:
            record["interrupted"] = True
            log("interrupted: writing what was measured")
    record["ratios"] = ratios(runs)
    if args.output:
        write_json(args.output, record)
    print(format_table(record))
    return 0 if runs and not record.get("errors") else 1


def format_table(record: dict) -> str:
    """A row per run, then the on / off ratios."""
    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:.3g}" if isinstance(value, float) and not math.isnan(value) else str(value)

    keys = ["prompt_tokens", "prefill_tokens_computed", "kv_transfer_bytes", "ttft_p50_ms",
            "ttft_p90_ms", "request_throughput"]
    lines = ["mode       cache dataset        " + " ".join(f"{k:>24}" for k in keys)]
    for r in record["runs"]:
        lines.append(f"{r['mode']:<10} {r['cache']:<5} {r['dataset']:<14} "
                     + " ".join(f"{cell(r.get(k)):>24}" for k in keys))
    for ratio in record["ratios"]:
        lines.append(f"on/off {ratio['mode']} {ratio['dataset']}: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in ratio["on_over_off"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
