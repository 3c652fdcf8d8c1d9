"""`pd-serve plan`: which split of N devices (xPyD or N colocated) and which batch limits serve
the most goodput for a workload, predicted by simulation on a recorded profile.

    pd-serve plan --profile bench/results/profile-cpu-smollm2.json --num-gpus 2 \
        --input-len 64 --output-len 16 --request-rate 0.5,1,2 --slo ttft=1500,tpot=150

The workload is bench/serving.py's (planner/workload.py): the same dataset flags and defaults,
and with the same --seed the same request lengths and arrival times, so a prediction lines up with a measured run
(bench/phase_ratio.py). For every split, every combination of the limits grids is simulated
(prefill: --chunk-sizes; decode: --max-running; colocated: both) and the best is kept: most
goodput, then most SLO attainment, then lowest p90 latencies relative to their SLOs.
With --capacity instead of rates: each split's SLO capacity (the highest rate at which its best
limits keep >= 90 % of requests within the SLOs) and the split with the most.

    pd-serve plan --profile bench/results/profile-cpu-smollm2-dense.json --num-gpus 2 \
        --input-len 64 --output-len 16 --num-prompts 48 --capacity --slo ttft=1500,tpot=150
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from pd_serve.planner.costs import CostModel, load_profile
from pd_serve.planner.metrics import parse_slo
from pd_serve.planner.simulator import ClusterSpec, PoolLimits, metrics, simulate
from pd_serve.planner.workload import DATASETS, add_workload_args, arrival_offsets, make_prompts

CAPACITY_TARGET = 0.9  # SLO attainment that defines a split's capacity (DistServe's 90 %)
CAPACITY_PRECISION = 0.02  # bisection stops when the bracket is this narrow, relative
DATASET_FLAGS = ("dataset", "input_len", "output_len", "range_ratio", "num_prompts", "seed",
                 "burstiness", "sharegpt_lengths", "max_model_len", "num_prefixes", "prefix_len",
                 "suffix_len")


def float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers") from None
    if not values or not all(v > 0 for v in values):  # (NaN is not > 0)
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers > 0")
    return values


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    from pd_serve.planner.profile import int_list

    parser.add_argument("--profile", required=True, help="a profile JSON from pd-serve profile")
    parser.add_argument("--num-gpus", type=int, default=2,
                        help="devices to split (default: %(default)s; 1: colocated x1 alone, for "
                             "its limits)")
    parser.add_argument("--request-rate", type=float_list, default=None,
                        help="mean requests/s; a comma-separated list sweeps (inf: all at once)")
    parser.add_argument("--capacity", action="store_true",
                        help="instead of --request-rate: each split's SLO capacity, the highest "
                             f"rate at which its best limits keep >= {CAPACITY_TARGET * 100:.0f}%% of "
                             "requests within the SLOs (bisection), and the split with the most")
    parser.add_argument("--slo", required=True, help="SLOs in ms, e.g. ttft=500,tpot=50[,e2e=10000]")
    parser.add_argument("--chunk-sizes", type=int_list, default=[256, 512, 1024, 2048],
                        help="--chunked-prefill-size values to try (default: 256,512,1024,2048)")
    parser.add_argument("--max-running", type=int_list, default=[16, 32, 64, 128, 256],
                        help="decode/colocated --max-running-requests values to try "
                             "(default: 16,32,64,128,256)")
    parser.add_argument("--transfer-gbps", type=float, default=None, help="override the profile's")
    parser.add_argument("--transfer-latency-ms", type=float, default=None, help="override the profile's")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not a table")
    g = parser.add_argument_group("workload (bench/serving.py's flags; default: its defaults)")
    g.add_argument("--dataset", choices=DATASETS, default=None)
    for flag in ("input-len", "output-len", "num-prompts", "seed", "max-model-len", "num-prefixes",
                 "prefix-len", "suffix-len"):
        g.add_argument(f"--{flag}", type=int, default=None)
    for flag in ("range-ratio", "burstiness"):
        g.add_argument(f"--{flag}", type=float, default=None)
    g.add_argument("--sharegpt-lengths", default=None)


def run(args: argparse.Namespace) -> None:
    try:
        slo = parse_slo(args.slo)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--slo: {e}") from None
    if args.num_gpus < 1:
        raise ValueError("--num-gpus must be >= 1")
    if args.transfer_gbps is not None and not 0 < args.transfer_gbps < math.inf:
        raise ValueError(f"--transfer-gbps {args.transfer_gbps} must be > 0 and finite")
    if args.transfer_latency_ms is not None and not 0 <= args.transfer_latency_ms < math.inf:
        raise ValueError(f"--transfer-latency-ms {args.transfer_latency_ms} must be >= 0 and finite")
    overrides = {}
    if args.transfer_gbps is not None:
        overrides["transfer_gbps"] = args.transfer_gbps
    if args.transfer_latency_ms is not None:
        overrides["transfer_latency_s"] = args.transfer_latency_ms / 1000
    if (args.request_rate is None) == (not args.capacity):
        raise ValueError("give --request-rate (rates to plan for) or --capacity (find each split's "
                         "highest rate within the SLOs), one of the two")
    profile = load_profile(args.profile)
    costs = CostModel.from_profile(profile, **overrides)
    wl_args = workload_args(args, profile.get("max_model_len"))
    about = {"profile": args.profile, "device": profile.get("device"), "model": profile.get("model"),
             "num_gpus": args.num_gpus, "slo_ms": slo,
             "workload": {k: getattr(wl_args, k) for k in DATASET_FLAGS}}
    if args.capacity:
        result = plan_capacity(costs, args.num_gpus, wl_args, slo, args.chunk_sizes, args.max_running,
                               progress=Progress("capacity"))
        print(json.dumps(about | result, indent=2, default=str) if args.json
              else format_capacity(result))
        return
    results = [plan_rate(costs, args.num_gpus, workload(wl_args, rate), rate, slo,
                         args.chunk_sizes, args.max_running, Progress(f"rate {rate:g}"))
               for rate in args.request_rate]
    if args.json:
        print(json.dumps(about | {"rates": results}, indent=2, default=str))
        return
    for result in results:
        print(format_table(result))


def workload_args(args: argparse.Namespace, max_model_len: int | None) -> argparse.Namespace:
    """The workload's flags (bench/serving.py's) with this command's dataset flags laid over
    their defaults."""
    defaults = argparse.ArgumentParser()
    add_workload_args(defaults)
    merged = vars(defaults.parse_args([]))
    merged.update({k: getattr(args, k) for k in DATASET_FLAGS if getattr(args, k) is not None})
    merged["max_model_len"] = merged["max_model_len"] or max_model_len
    merged["sharegpt_lengths"] = Path(merged["sharegpt_lengths"])
    if min(merged[k] for k in ("num_prompts", "input_len", "output_len", "num_prefixes")) < 1 \
            or min(merged[k] for k in ("prefix_len", "suffix_len")) < 0 \
            or not 0 <= merged["range_ratio"] < 1 or not 0 < merged["burstiness"] < math.inf:
        raise ValueError("--num-prompts, --input-len, --output-len, --num-prefixes must be >= 1, "
                         "--prefix-len and --suffix-len >= 0, --range-ratio in [0, 1), "
                         "--burstiness > 0 and finite")
    limit = merged["max_model_len"]
    if limit and merged["dataset"] != "sharegpt":
        if merged["dataset"] == "shared-prefix":
            longest = merged["prefix_len"] + merged["suffix_len"] + merged["output_len"]
        else:  # random: lengths up to (1 + range ratio) times the flags' (workload.py)
            longest = sum(math.floor(merged[k] * (1 + merged["range_ratio"]))
                          for k in ("input_len", "output_len"))
        if longest > limit:
            raise ValueError(f"requests of up to {longest} tokens (prompt and output) exceed the "
                             f"profile's context length {limit}: lower --input-len / --output-len")
    return argparse.Namespace(**merged)


def workload(args: argparse.Namespace, rate: float) -> list[tuple[float, int, int]]:
    """(arrival s, input tokens, output tokens) per request, drawn exactly as bench/serving.py
    draws them for this seed and rate."""
    rng = np.random.default_rng(args.seed)
    prompts = make_prompts(args, rng, args.max_model_len)
    offsets = arrival_offsets(rng, len(prompts), rate, args.burstiness)
    return [(float(t), len(p.token_ids), p.output_len) for t, p in zip(offsets, prompts)]


def candidates(num_gpus: int, chunk_sizes, max_running) -> dict[str, list[ClusterSpec]]:
    """Every split of num_gpus with every combination of the limit grids, by split name.
    Larger limits come first, so among equal predictions the roomier limits are kept."""
    chunks, running = sorted(chunk_sizes, reverse=True), sorted(max_running, reverse=True)
    out: dict[str, list[ClusterSpec]] = {}
    for x in range(1, num_gpus):
        specs = [ClusterSpec(x, num_gpus - x, prefill=PoolLimits(chunked_prefill_size=c),
                             decode=PoolLimits(max_running_requests=m))
                 for c, m in itertools.product(chunks, running)]
        out[specs[0].name] = specs
    out[f"colocated{num_gpus}"] = [ClusterSpec(num_colocated=num_gpus, colocated=PoolLimits(m, c))
                           for c, m in itertools.product(chunks, running)]
    return out


class Progress:
    """One stderr line per simulated split (its name, how many of how many, the time so far and
    an estimate of what is left), so a plan over many GPUs shows it is moving: each split
    simulates every limit combination, seconds each on a large workload."""

    def __init__(self, what: str):
        self.what, self.start = what, time.monotonic()

    def __call__(self, done: int, total: int, name: str) -> None:
        spent = time.monotonic() - self.start
        left = f" (about {spent / done * (total - done):.0f} s left)" if done < total else ""
        print(f"plan ({self.what}): {name} simulated, {done} of {total} splits, {spent:.0f} s{left}",
              file=sys.stderr, flush=True)


def evaluate(spec: ClusterSpec, costs: CostModel, requests, slo: dict[str, float]) -> dict:
    return summarize(spec, simulate(spec, costs, requests), slo)


def summarize(spec: ClusterSpec, simulated, slo: dict[str, float]) -> dict:
    """The predicted metrics of `spec` from its simulated requests."""
    m = metrics(simulated, slo)
    limits = ({"colocated": _limits(spec.colocated)} if spec.num_colocated else
              {"prefill": _limits(spec.prefill), "decode": _limits(spec.decode)})
    return {"config": spec.name, "num_prefill": spec.num_prefill, "num_decode": spec.num_decode,
            "num_colocated": spec.num_colocated, "limits": limits, "goodput": m["goodput"],
            "slo_attainment": m["num_good"] / m["num_requests"],
            "request_throughput": m["request_throughput"], "duration_s": m["duration_s"],
            **{f"{k}_{s}_ms": m[f"{k}_ms"][s] for k in ("ttft", "tpot", "e2e") for s in ("median", "p90")}}


def plan_rate(costs: CostModel, num_gpus: int, requests, rate: float, slo: dict[str, float],
              chunk_sizes, max_running, progress=None) -> dict:
    """The best limits of every split at one rate, and the best split. progress(done, total,
    name) is called after each split."""
    rows = []
    splits = candidates(num_gpus, chunk_sizes, max_running)
    for name, specs in splits.items():
        rows.append(max((evaluate(s, costs, requests, slo) for s in specs), key=lambda r: _rank(r, slo)))
        if progress:
            progress(len(rows), len(splits), name)
    best = max(rows, key=lambda r: _rank(r, slo))
    return {"request_rate": "inf" if math.isinf(rate) else rate, "configs": rows, "best": best}


def plan_capacity(costs: CostModel, num_gpus: int, wl_args, slo: dict[str, float], chunk_sizes,
                  max_running, target: float = CAPACITY_TARGET, progress=None) -> dict:
    """Every split's SLO capacity: the highest rate at which the best of its limits keeps
    >= target attainment, found by bisection between a rate that meets the target and one that
    does not (starting from twice the split's all-at-once throughput), to within 2 %
    (`fails_at_rps`); `bound` ">=" when even that rate meets it, "<" when a 64th of it does not.
    On a finite burst of requests attainment need not fall steadily with the rate, so this is a
    rate where it crosses the target, not always the highest. The split with the most wins.
    progress(done, total, name) is called after each split."""
    rows = []
    splits = candidates(num_gpus, chunk_sizes, max_running)
    for name, specs in splits.items():
        rows.append(_capacity(specs, costs, wl_args, slo, target))
        if progress:
            progress(len(rows), len(splits), name)
    best = max(rows, key=lambda r: (r["bound"] != "<", r["capacity_rps"]))
    return {"target": target, "slo_ms": slo, "num_gpus": num_gpus, "configs": rows, "best": best}


def _capacity(specs: list[ClusterSpec], costs: CostModel, wl_args, slo: dict[str, float],
              target: float) -> dict:
    """One split's row of plan_capacity."""
    def best_at(rate: float) -> dict:  # the limits that keep the most requests within the SLOs
        requests = workload(wl_args, rate)
        return max((evaluate(s, costs, requests, slo) for s in specs),
                   key=lambda r: (r["slo_attainment"], round(r["goodput"], 6)))

    hi = 2 * best_at(math.inf)["request_throughput"]
    lo = hi / 64
    best_hi = best_at(hi)
    if best_hi["slo_attainment"] >= target:
        return best_hi | {"capacity_rps": hi, "bound": ">="}
    best_lo = best_at(lo)
    if best_lo["slo_attainment"] < target:
        return best_lo | {"capacity_rps": lo, "bound": "<"}
    while hi - lo > CAPACITY_PRECISION * lo:
        mid = (lo + hi) / 2
        row = best_at(mid)
        if row["slo_attainment"] >= target:
            lo, best_lo = mid, row
        else:
            hi = mid
    return best_lo | {"capacity_rps": lo, "bound": "=", "fails_at_rps": hi}


def bounded(rate: float, bound: str) -> str:
    """A capacity as text: `2.5`, or with its bound, `>=4` / `<1` (see plan_capacity)."""
    return ("" if bound == "=" else bound) + format(rate, ".3g")


def format_capacity(result: dict) -> str:
    n = result["num_gpus"]

    def rps(row: dict, per: int = 1) -> str:
        return bounded(row["capacity_rps"] / per, row["bound"])

    rows = [(row, f"{rps(row):>9}{rps(row, n):>9}") for row in result["configs"]]
    best = result["best"]
    return _table(f"SLO capacity: the highest rate with >= {result['target']:.0%} of requests "
                  f"within the SLOs", f"{'req/s':>9}{'per GPU':>9}", rows, best,
                  f"recommended: {best['config']} ({limit_flags(best)}), SLO capacity "
                  f"{rps(best)} req/s on {n} GPU{'s' if n > 1 else ''}")


def _rank(row: dict, slo: dict[str, float]):
    """Most goodput, then attainment, then the lowest sum of p90 latency / SLO (strict ties keep
    the earlier row)."""
    pressure = sum((row.get(f"{k}_p90_ms") or 0.0) / limit for k, limit in slo.items())
    return (round(row["goodput"], 6), row["slo_attainment"], -round(pressure, 6))


def _limits(limits: PoolLimits) -> dict:
    return {"chunked_prefill_size": limits.chunked_prefill_size,
            "max_running_requests": limits.max_running_requests}


SEARCHED = {"prefill": ("chunked_prefill_size",), "decode": ("max_running_requests",),
            "colocated": ("chunked_prefill_size", "max_running_requests")}


def limit_flags(row: dict) -> str:
    """The searched limits of each pool as worker flags, e.g. `decode --max-running-requests 64`."""
    return "; ".join(pool + "".join(f" --{k.replace('_', '-')} {lim[k]}" for k in SEARCHED[pool])
                     for pool, lim in row["limits"].items())


def describe_limits(row: dict) -> str:
    short = {"chunked_prefill_size": "chunk", "max_running_requests": "mr"}
    return ", ".join(f"{pool[0].upper()} " + " ".join(f"{short[k]}={lim[k]}" for k in SEARCHED[pool])
                     for pool, lim in row["limits"].items())


def format_table(result: dict) -> str:
    rows = [(row, f"{row['goodput']:>9.3f}{row['slo_attainment']:>8.0%}") for row in result["configs"]]
    best = result["best"]
    return _table(f"request rate {result['request_rate']} req/s (goodput in req/s, latencies in ms)",
                  f"{'goodput':>9}{'attain':>8}", rows, best,
                  f"recommended: {best['config']} ({limit_flags(best)}), predicted goodput "
                  f"{best['goodput']:.3f} req/s, {best['slo_attainment']:.0%} within the SLOs\n")


def _table(title: str, head: str, rows: list[tuple[dict, str]], best: dict, footer: str) -> str:
    """One line per split: its name and limits, the given columns, p90 TTFT and TPOT; * marks
    the best."""
    lines = [title, f"{'config':<12}{'best limits':<24}{head}{'TTFT p90':>10}{'TPOT p90':>10}"]
    for row, columns in rows:
        lines.append(f"{row['config']:<12}{describe_limits(row):<24}{columns}{row['ttft_p90_ms']:>10.1f}"
                     f"{row['tpot_p90_ms'] or 0:>10.1f}{' *' if row is best else ''}")
    return "\n".join(lines + [footer])
