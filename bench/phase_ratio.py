"""Phase-ratio sweep: for one workload and its SLOs, which use of N devices serves the most
goodput -- x prefill + y decode workers (each xPyD with x + y = N) or N colocated workers?

    python bench/phase_ratio.py --slo ttft=500,tpot=50 --request-rates 2,4,8,16 \
        --input-len 1024 --output-len 128 --num-prompts 200 --output-dir pr-2gpu
    python bench/phase_ratio.py --device cpu --configs 1p1d,colocated2,colocated1 \
        --rate-sweep auto --slo ttft=3000,tpot=300 --worker-args "--max-total-tokens 8192"

Configurations run one after another, each on a fresh `pd_serve.launch.LocalCluster`, and use
slots: on GPU slot i is GPU i (prefill workers take the first slots, decode workers the next);
on CPU a slot is a worker process with cores // N torch threads, so every slot gets the same
share of the machine. Against each configuration bench/serving.py runs once per request rate,
in this process. Flags this script does not know go to it, the same for every run (--dataset,
--input-len, --output-len, --range-ratio, --num-prompts, --seed, --max-concurrency, ...), so
every configuration sees the same prompts and arrival times at a given rate.

--rate-sweep auto first starts each configuration once and sends all prompts at once to measure
its capacity (completed requests/s); the sweep then runs at 1/4, 1/2, 3/4, 1 and 5/4 of the
largest capacity. --rate-sweep plan takes the capacities from `pd-serve plan`'s simulator on
--profile instead (the same workload and worker limits, all prompts at once): no probe runs, so
each configuration starts once.

Per configuration: its SLO capacity, the highest rate served with >= 90 % of requests meeting
every SLO (DistServe's per-configuration goodput; linear between the swept rates, or a bound when
the sweep does not reach the drop). Per (configuration, rate): goodput (completed requests/s
meeting every SLO, as bench/serving.py counts it), SLO attainment (requests meeting every SLO /
requests sent; failures are misses), request and output throughput, TTFT and TPOT p50/p90/p99,
and in results.json every request's TTFT / TPOT / E2E (`latencies_ms`), so goodput under other
SLOs can be counted afterwards (bench/planner_check.py --slo), the p50 / p90 of each phase the
gateway timed (`server_timings_ms`: queue, prefill, prefill_step, transfer, first_token, ...),
and the cores each process kept busy (`host_cpu`: gateway, each worker, "client" = this process;
where the total nears the core count, on CPU, the processes slowed each other down).
--output-dir gets results.json, results.csv and results.png (goodput and SLO attainment against
rate, a line per configuration).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import io
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/phase_ratio.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import serving  # noqa: E402
from bench._common import device_name, git_commit, write_json  # noqa: E402
from pd_serve.launch import LaunchError, LocalCluster, free_port, launch_transfer_args  # noqa: E402
from pd_serve.planner.metrics import RequestRecord, parse_slo, summarize_ms  # noqa: E402
from pd_serve.planner.profile import busy_cores, busy_machine_warning  # noqa: E402
from pd_serve.planner.plan import CAPACITY_TARGET, bounded  # noqa: E402

AUTO_RATE_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25)  # of the largest measured capacity
# bench/serving.py flags that this script sets on every run
SET_HERE = {"base_url": "--base-url", "request_rate": "--request-rate (use --request-rates)",
            "output": "--output (use --output-dir)", "save_requests": "--save-requests"}
TIE_TOLERANCE = 0.02  # the best-configuration lines name others whose goodput is this close
LATENCY_COLUMNS = [f"{m}_{p}_ms" for m in ("ttft", "tpot") for p in ("p50", "p90", "p99")]
CSV_COLUMNS = ["config", "num_prefill", "num_decode", "num_colocated", "num_slots", "request_rate",
               "num_requests", "completed", "failed", "num_good", "slo_attainment", "goodput",
               "goodput_per_slot", "request_throughput", "output_throughput", "duration_s",
               *LATENCY_COLUMNS]


# ---- configurations and rates ---------------------------------------------------------------
@dataclass(frozen=True)
class Deployment:
    """How one configuration fills its slots: prefill + decode workers, or colocated workers."""

    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0

    @property
    def name(self) -> str:
        if self.num_colocated:
            return f"colocated{self.num_colocated}"
        return f"{self.num_prefill}p{self.num_decode}d"

    @property
    def num_slots(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated


def parse_deployment(text: str) -> Deployment:
    """`2p1d` -> 2 prefill + 1 decode workers; `colocated3` -> 3 colocated workers."""
    name = text.strip().lower()
    if m := re.fullmatch(r"(\d+)p(\d+)d", name):
        deployment = Deployment(num_prefill=int(m[1]), num_decode=int(m[2]))
        ok = deployment.num_prefill >= 1 and deployment.num_decode >= 1
    elif m := re.fullmatch(r"colocated(\d+)", name):
        deployment = Deployment(num_colocated=int(m[1]))
        ok = deployment.num_colocated >= 1
    else:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"bad configuration {text!r}: use xPyD (x, y >= 1, e.g. 1p1d) "
                                         "or colocatedK (K >= 1)")
    return deployment


def parse_deployments(text: str) -> list[Deployment]:
    deployments = [parse_deployment(s) for s in text.split(",") if s.strip()]
    if not deployments:
        raise argparse.ArgumentTypeError("empty --configs")
    return list(dict.fromkeys(deployments))  # in order, without repeats


def default_deployments(num_slots: int) -> list[Deployment]:
    """Every xPyD with x + y = num_slots (x, y >= 1), then colocated with num_slots workers."""
    splits = [Deployment(num_prefill=x, num_decode=num_slots - x) for x in range(1, num_slots)]
    return splits + [Deployment(num_colocated=num_slots)]


def parse_rates(text: str) -> list[float]:
    """`1,2,4` -> [1.0, 2.0, 4.0]: finite and > 0, sorted, no repeats."""
    try:
        rates = sorted({float(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad rates {text!r}: use comma-separated req/s, "
                                         "e.g. 1,2,4") from None
    if not rates or not all(0 < r < math.inf for r in rates):
        raise argparse.ArgumentTypeError(f"bad rates {text!r}: each must be finite and > 0")
    return rates


def auto_rates(capacity_rps: float) -> list[float]:
    """AUTO_RATE_FRACTIONS of the capacity, to two significant digits."""
    return sorted({float(f"{capacity_rps * f:.2g}") for f in AUTO_RATE_FRACTIONS})


def planned_capacity(args: argparse.Namespace) -> dict[str, float]:
    """Each configuration's requests/s with every prompt sent at once, as the planner's
    simulator predicts it on --profile for this workload and the workers' limits."""
    from bench.planner_check import spec_of, worker_limits
    from pd_serve.planner.costs import CostModel
    from pd_serve.planner.plan import evaluate, workload, workload_args

    profile = args.profile_data
    costs = CostModel.from_profile(profile)
    wl_args = workload_args(argparse.Namespace(**args.serving), profile.get("max_model_len"))
    requests, limits = workload(wl_args, math.inf), worker_limits(args.worker_argv)
    return {d.name: evaluate(spec_of(vars(d), limits), costs, requests, args.slo)["request_throughput"]
            for d in args.deployments}


# ---- one configuration, one rate ------------------------------------------------------------
@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def start_cluster(args: argparse.Namespace, deployment: Deployment):
    """A ready LocalCluster for `deployment` (its worker i on slot i), stopped on exit."""
    cpu_env = {} if args.device == "cuda" else {"OMP_NUM_THREADS": str(args.cpu_threads)}
    with _environ(cpu_env):  # the children copy this process's environment when they start
        cluster = LocalCluster(
            port=free_port(), num_prefill=deployment.num_prefill, num_decode=deployment.num_decode,
            num_colocated=deployment.num_colocated, engine_args=args.worker_argv,
            gateway_args=args.gateway_argv, log_level=args.cluster_log_level,
            gpu_ids=args.gpu_ids[:deployment.num_slots] if args.device == "cuda" else None)
    try:
        cluster.wait_ready(timeout_s=args.startup_timeout)
        yield cluster
    finally:
        cluster.stop()


def run_serving(args: argparse.Namespace, base_url: str, rate: float) -> dict:
    """bench/serving.py's metrics for one run at `rate` (its printed report is dropped; request
    errors still go to stderr), plus `errors`: the first few distinct request errors."""
    slo = ",".join(f"{k}={v:g}" for k, v in args.slo.items())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serving.json"
        argv = [*args.serving_argv, "--base-url", base_url, "--request-rate", str(rate),
                "--slo", slo, "--output", str(out), "--save-requests"]
        with contextlib.redirect_stdout(io.StringIO()):  # its report: the rows here say it
            serving.main(argv)
        if not out.exists():
            raise LaunchError(f"the serving benchmark could not use {base_url} (see above)")
        result = json.loads(out.read_text(encoding="utf-8"))
    errors = sorted({r["error"] for r in result["requests"] if r["error"]})
    records = [RequestRecord(**r) for r in result["requests"]]
    return result["metrics"] | {"errors": errors[:3], "latencies_ms": [_latencies(r) for r in records],
                                "server_timings_ms": server_phases(records)}


def server_phases(records: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """p50 / p90 in ms of each phase the gateway timed (queue, prefill, prefill_step, transfer,
    first_token, ...) over the completed requests that carry timings: where TTFT went."""
    timed = [r.server_timings for r in records if r.success and r.server_timings]
    phases = sorted({k for t in timed for k, v in t.items()
                     if isinstance(v, (int, float)) and not k.endswith("_bytes")})
    out = {}
    for phase in phases:
        stats = summarize_ms([t[phase] for t in timed if phase in t])
        out[phase] = {"p50": round(stats["median"], 3), "p90": round(stats["p90"], 3)}
    return out


def host_cpu_seconds(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds (user + system, all threads) so far of each cluster process, by name, and of
    this process ("client": the load generator), with the wall clock under "wall"."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"wall": time.perf_counter(), "client": sum(os.times()[:2])}
    for name, proc in cluster.procs:
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # not Linux, or the process is gone
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def host_cpu_use(before: dict[str, float], after: dict[str, float], duration_s: float) -> dict:
    """Cores each process kept busy over one rate's run (CPU seconds / wall seconds), their
    total, and the machine's core count: above it, the processes took turns on the cores."""
    wall = after["wall"] - before["wall"]
    use = {k: round((after[k] - before[k]) / wall, 3) for k in after if k != "wall" and k in before}
    return {"cores_used": use, "total": round(sum(use.values()), 3), "cores": os.cpu_count(),
            "wall_s": round(wall, 3), "benchmark_s": round(duration_s, 3)}


def _latencies(record: RequestRecord) -> list[float | None] | None:
    """[TTFT, TPOT, E2E] in ms of a completed request (TPOT None below two tokens); None for a
    failed one. Enough to count goodput under other SLOs later (bench/planner_check.py --slo)."""
    if not record.success:
        return None
    ms = lambda v: None if v is None else round(v * 1000.0, 3)  # noqa: E731
    return [ms(record.ttft), ms(record.tpot), ms(record.e2e)]


def make_row(deployment: Deployment, rate: float, metrics: dict) -> dict:
    num_good = metrics["num_good"] or 0
    stats = {"p50": "median", "p90": "p90", "p99": "p99"}
    return {
        "config": deployment.name, "num_prefill": deployment.num_prefill,
        "num_decode": deployment.num_decode, "num_colocated": deployment.num_colocated,
        "num_slots": deployment.num_slots, "request_rate": rate,
        **{k: metrics[k] for k in ("num_requests", "completed", "failed")}, "num_good": num_good,
        "slo_attainment": num_good / metrics["num_requests"], "goodput": metrics["goodput"],
        "goodput_per_slot": metrics["goodput"] / deployment.num_slots,
        **{k: metrics[k] for k in ("request_throughput", "output_throughput", "duration_s")},
        **{f"{m}_{p}_ms": metrics[f"{m}_ms"][s] for m in ("ttft", "tpot") for p, s in stats.items()},
        "errors": metrics["errors"],
        "latencies_ms": metrics["latencies_ms"],  # per request, in send order (not in the CSV)
        "server_timings_ms": metrics.get("server_timings_ms", {}),  # phase p50 / p90 (not in the CSV)
        "host_cpu": metrics.get("host_cpu", {}),  # cores each process kept busy (not in the CSV)
    }


def log(message: str) -> None:
    print(f"[phase-ratio] {message}", file=sys.stderr, flush=True)


def run_deployment(args: argparse.Namespace, deployment: Deployment, rates: list[float],
                   rows: list[dict], tag: str) -> str | None:
    """Starts `deployment`, runs every rate (a row each, appended to `rows` as it comes), stops
    it. Returns None, or the error that ended it early."""
    start = time.perf_counter()
    log(f"{tag} {deployment.name}: starting {deployment.num_slots} worker(s) on {args.device}")
    try:
        with start_cluster(args, deployment) as cluster:
            log(f"{tag} {deployment.name}: ready in {time.perf_counter() - start:.1f} s")
            for i, rate in enumerate(rates, 1):
                log(f"{tag} {deployment.name}: rate {rate:g} req/s ({i}/{len(rates)})")
                before = host_cpu_seconds(cluster)
                metrics = run_serving(args, cluster.base_url, rate)
                row = make_row(deployment, rate, metrics | {"host_cpu": host_cpu_use(
                    before, host_cpu_seconds(cluster), metrics["duration_s"])})
                if dead := [name for name, proc in cluster.procs if proc.poll() is not None]:
                    raise LaunchError(f"{', '.join(dead)} exited during the run")
                rows.append(row)
                log(f"{tag} {deployment.name}: rate {rate:g}: {row['completed']}/{row['num_requests']} "
                    f"completed, {row['request_throughput']:.2f} req/s, goodput {row['goodput']:.2f} "
                    f"req/s, SLO attainment {row['slo_attainment']:.0%}")
    except LaunchError as e:
        log(f"{tag} {deployment.name}: failed: {e}")
        return str(e)
    return None


# ---- report ---------------------------------------------------------------------------------
def best_rows(rows: list[dict]) -> tuple[dict[float, dict], dict | None]:
    """The row with the most goodput at each rate, and overall (ties: higher SLO attainment,
    then fewer slots)."""
    def key(row: dict):
        return row["goodput"], row["slo_attainment"], -row["num_slots"]

    per_rate: dict[float, dict] = {}
    for row in rows:
        if row["request_rate"] not in per_rate or key(row) > key(per_rate[row["request_rate"]]):
            per_rate[row["request_rate"]] = row
    return dict(sorted(per_rate.items())), max(rows, key=key, default=None)


def slo_capacity(rows: list[dict], target: float = CAPACITY_TARGET) -> dict[str, dict]:
    """Per configuration, the highest request rate at which SLO attainment stays >= target
    (DistServe's per-configuration goodput): linear between the swept rates around the first
    drop below it. `bound` says how far the sweep pins it: "=" between two rates, ">=" when every
    rate met the target (the rate is the highest swept), "<" when even the lowest missed it."""
    out: dict[str, dict] = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        points = sorted((r["request_rate"], r["slo_attainment"]) for r in rows if r["config"] == config)
        slots = next(r["num_slots"] for r in rows if r["config"] == config)
        if points[0][1] < target:
            rate, bound = points[0][0], "<"
        else:
            rate, bound = points[-1][0], ">="
            for (r0, a0), (r1, a1) in zip(points, points[1:]):
                if a1 < target:
                    rate, bound = r0 + (r1 - r0) * (a0 - target) / (a0 - a1), "="
                    break
        out[config] = {"rate": rate, "bound": bound, "per_slot": rate / slots, "target": target}
    return out


def format_capacity(capacity: dict[str, dict]) -> str:
    items = [f"{name} {bounded(c['rate'], c['bound'])} req/s "
             f"({bounded(c['per_slot'], c['bound'])} per slot)" for name, c in capacity.items()]
    target = next(iter(capacity.values()))["target"] if capacity else CAPACITY_TARGET
    return f"SLO capacity (highest rate at >= {target:.0%} attainment): " + ("; ".join(items) or "none")


def format_table(rows: list[dict]) -> str:
    def ms3(row: dict, metric: str) -> str:
        values = [row[f"{metric}_{p}_ms"] for p in ("p50", "p90", "p99")]
        return "/".join("-" if v is None else f"{v:.0f}" for v in values)

    head = (f"{'config':<12}{'rate':>7}{'done':>8}{'failed':>7}{'good':>6}{'attain':>8}{'goodput':>9}"
            f"{'req/s':>8}{'out tok/s':>10}  {'TTFT p50/p90/p99 ms':<22}{'TPOT p50/p90/p99 ms':<20}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['config']:<12}{r['request_rate']:>7g}{r['completed']:>5}/{r['num_requests']:<2}"
                     f"{r['failed']:>7}{r['num_good']:>6}{r['slo_attainment']:>8.0%}{r['goodput']:>9.2f}"
                     f"{r['request_throughput']:>8.2f}{r['output_throughput']:>10.1f}  "
                     f"{ms3(r, 'ttft'):<22}{ms3(r, 'tpot'):<20}")
    return "\n".join(lines)


def format_best(rows: list[dict]) -> str:
    per_rate, overall = best_rows(rows)
    if overall is None:
        return "no results"

    def describe(best: dict) -> str:
        close = [r["config"] for r in rows if r is not best and r["request_rate"] == best["request_rate"]
                 and r["goodput"] >= (1 - TIE_TOLERANCE) * best["goodput"]]
        return (f"{best['config']} (goodput {best['goodput']:.2f} req/s, SLO attainment "
                f"{best['slo_attainment']:.0%})" + (f"; within {TIE_TOLERANCE:.0%}: {', '.join(close)}"
                                                    if close else ""))

    lines = ["best configuration per rate (max goodput):"]
    lines += [f"  {rate:>7g} req/s: {describe(row)}" for rate, row in per_rate.items()]
    lines.append(f"best overall: {overall['config']} at {overall['request_rate']:g} req/s, "
                 f"goodput {overall['goodput']:.2f} req/s")
    return "\n".join(lines)


def workload_title(results: dict) -> str:
    s = results["config"]["serving"]
    shape = {"random": f"random {s['input_len']} in / {s['output_len']} out",
             "sharegpt": "sharegpt lengths",
             "shared-prefix": f"shared-prefix {s['num_prefixes']} x {s['prefix_len']} + "
                              f"{s['suffix_len']} in / {s['output_len']} out"}[s["dataset"]]
    slo = ", ".join(f"{k} ≤ {v:g} ms" for k, v in results["config"]["slo_ms"].items())
    return f"{shape}, {s['num_prompts']} prompts per run; SLO {slo}; {results['device']['name']}"


def plot(results: dict, path: Path) -> None:
    """Two panels against request rate: goodput, and SLO attainment; a line per configuration."""
    rows, lines = results["rows"], []
    for i, name in enumerate(results["config"]["configs"]):
        mine = sorted((r for r in rows if r["config"] == name), key=lambda r: r["request_rate"])
        if mine:
            lines.append((i, name, [r["request_rate"] for r in mine], [r["goodput"] for r in mine],
                          [r["slo_attainment"] for r in mine],
                          dict(linestyle="--" if name.startswith("colocated") else "-")))
    plot_rate_panels(lines, f"pd-serve phase ratio: {workload_title(results)}", path,
                     offered=max((r["request_rate"] for r in rows), default=1.0))


def plot_rate_panels(lines, title: str, path, offered: float | None = None) -> None:
    """Goodput and SLO attainment against request rate, one line per (colour index, label,
    rates, goodputs, attainments (0-1), extra plot style); with `offered`, the offered-rate
    diagonal up to it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("matplotlib is needed for the plot: pip install 'pd-serve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax_good, ax_attain) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    for i, label, rates, goodput, attainment, style in lines:
        kw = dict(color=colors[i % len(colors)], marker="osD^v<>p"[i % 8], label=label, alpha=0.85)
        kw.update(style)
        ax_good.plot(rates, goodput, **kw)
        ax_attain.plot(rates, [100 * a for a in attainment], **kw)
    if offered is not None:
        ax_good.plot([0, offered], [0, offered], color="0.6", linestyle=":", label="offered rate")
    ax_good.set(title="Goodput (requests/s meeting every SLO)", xlabel="request rate (req/s)",
                ylabel="goodput (req/s)", xlim=(0, None), ylim=(0, None))
    ax_attain.set(title="SLO attainment (share of requests meeting every SLO)",
                  xlabel="request rate (req/s)", ylabel="SLO attainment (%)", xlim=(0, None),
                  ylim=(-3, 103))
    for ax in (ax_good, ax_attain):
        ax.grid(alpha=0.3)
    ax_good.legend(loc="upper left", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def write_outputs(results: dict, out_dir: Path) -> None:
    write_json(out_dir / "results.json", results)
    with open(out_dir / "results.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results["rows"])
    print(f"wrote {out_dir / 'results.csv'}")
    plot(results, out_dir / "results.png")


# ---- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Other flags go to bench/serving.py for every run (see its --help): --dataset, "
               "--input-len, --output-len, --range-ratio, --num-prompts, --seed, --burstiness, "
               "--max-concurrency, --endpoint, --request-timeout, --no-progress, ...")
    p.add_argument("--slo", type=parse_slo, required=True,
                   help="SLOs in ms that goodput counts, e.g. ttft=500,tpot=50[,e2e=10000]")
    rates = p.add_mutually_exclusive_group(required=True)
    rates.add_argument("--request-rates", type=parse_rates, help="comma-separated req/s, e.g. 1,2,4")
    rates.add_argument("--rate-sweep", choices=["auto", "plan"],
                       help="auto: rates from the measured capacity of the configurations; plan: "
                            "from their capacity as the planner predicts it on --profile")
    p.add_argument("--profile", default=None, help="a pd-serve profile JSON, for --rate-sweep plan")
    g = p.add_argument_group("configurations")
    g.add_argument("--num-gpus", type=int, default=None,
                   help="slots to share out (default: the largest of --configs, else the GPUs "
                        "seen; 2 on CPU)")
    g.add_argument("--configs", type=parse_deployments, default=None,
                   help="e.g. 1p1d,colocated2,colocated1 (default: every xPyD with x + y = N, "
                        "and colocatedN)")
    g.add_argument("--include-colocated-1", action="store_true", help="also colocated with one worker")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when a GPU is seen (default: %(default)s)")
    g.add_argument("--gpu-ids", default=None,
                   help="slot i runs on the i-th of these GPUs (default: 0,1,...)")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU: torch threads per worker (default: cores // N)")
    g.add_argument("--model", default=None,
                   help="model folder for workers and gateway (default: the embedded one)")
    g.add_argument("--worker-args", default="",
                   help='flags for every worker, one string, e.g. '
                        '"--max-total-tokens 8192 --chunked-prefill-size 512"')
    g.add_argument("--gateway-args", default="", help='flags for the gateway, e.g. "--admit-timeout 60"')
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds (default: %(default)s)")
    g.add_argument("--cluster-log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where results.json, results.csv and results.png go "
                        "(default: phase-ratio-DATE-TIME)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """This script's flags and the checked flags for bench/serving.py (`serving_argv`), with the
    device, slots and configurations resolved."""
    p = build_parser()
    args, serving_argv = p.parse_known_args(argv)
    sp = serving.build_parser(prog=f"{p.prog} (flags passed on to bench/serving.py)")
    sargs = sp.parse_args(serving_argv)
    serving.check_args(sp, sargs)
    for dest, flag in SET_HERE.items():
        if getattr(sargs, dest) != sp.get_default(dest):
            p.error(f"{flag} is set by this script")
    if args.model and sargs.tokenizer is None:  # chat: prompts decoded by the served model's tokenizer
        serving_argv += ["--tokenizer", args.model]
    args.serving_argv = serving_argv
    args.serving = {k: str(v) if isinstance(v, Path) else v for k, v in vars(sargs).items()
                    if k not in SET_HERE and k not in ("model", "slo")}

    if (args.rate_sweep == "plan") != (args.profile is not None):
        p.error("--rate-sweep plan and --profile go together")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible")
    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    args.num_slots = args.num_gpus or (max(d.num_slots for d in args.configs) if args.configs else num_gpus)
    if args.num_slots < 1:
        p.error("--num-gpus must be >= 1")
    deployments = args.configs or default_deployments(args.num_slots)
    if args.include_colocated_1:
        deployments = list(dict.fromkeys([*deployments, Deployment(num_colocated=1)]))
    if too_big := [d.name for d in deployments if d.num_slots > args.num_slots]:
        p.error(f"--configs {','.join(too_big)}: more workers than --num-gpus {args.num_slots} slots")
    args.deployments = deployments
    args.gpu_ids = args.gpu_ids.split(",") if args.gpu_ids else [str(i) for i in range(args.num_slots)]
    if args.device == "cuda" and (len(args.gpu_ids) < args.num_slots or args.num_slots > num_gpus):
        p.error(f"{args.num_slots} slots need as many GPUs: {num_gpus} seen, "
                f"--gpu-ids {','.join(args.gpu_ids)}")
    args.cpu_threads = args.cpu_threads or max(1, (os.cpu_count() or 1) // args.num_slots)
    model = ["--model", args.model] if args.model else []
    args.worker_argv = ["--device", args.device, *model, *shlex.split(args.worker_args)]
    args.worker_argv += launch_transfer_args(args.worker_argv)  # as `pd-serve launch` does
    args.profile_data = _checked_profile(p, args) if args.profile else None
    args.gateway_argv = [*model, *shlex.split(args.gateway_args)]
    args.output_dir = args.output_dir or Path(f"phase-ratio-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    return args


def _checked_profile(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """--profile, loaded: it must come from this device type (an error otherwise) and, when
    --model is given, should be of that model (a warning otherwise: a renamed folder may still
    match)."""
    from pd_serve.planner.costs import load_profile
    try:
        profile = load_profile(args.profile)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    if profile.get("device_type") != args.device:
        p.error(f"--profile {args.profile} was recorded on {profile.get('device_type')}, this sweep "
                f"runs on {args.device}: record one here (pd-serve profile --device {args.device})")
    if args.model and Path(args.model).name != profile.get("model"):
        log(f"warning: --profile {args.profile} is of model {profile.get('model')!r}, the sweep "
            f"serves {Path(args.model).name!r}")
    return profile


def device_info(args: argparse.Namespace) -> dict:
    info = {"type": args.device, "num_slots": args.num_slots, "torch": torch.__version__}
    if args.device == "cuda":
        return info | {"name": f"{args.num_slots} x {device_name(torch.device('cuda', 0))}",
                       "gpu_ids": args.gpu_ids[:args.num_slots]}
    return info | {"name": f"CPU ({device_name(torch.device('cpu'))})",
                   "threads_per_worker": args.cpu_threads,
                   "busy_cores_at_start": busy_cores()}  # other processes' (Linux)


def main(argv: list[str] | None = None) -> int:
    """Runs the sweep and writes its outputs; 0 when every configuration ran every rate."""
    args = parse_args(argv)
    results = {
        "benchmark": "phase_ratio", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(), "device": device_info(args),
        "config": {"configs": [d.name for d in args.deployments], "slo_ms": args.slo,
                   "rate_sweep": args.rate_sweep or "fixed", "request_rates": args.request_rates,
                   "model": args.model, "worker_args": args.worker_argv, "gateway_args": args.gateway_argv,
                   "serving_args": args.serving_argv, "serving": args.serving},
        "capacity_rps": {}, "rows": [], "failures": [],
    }
    if warning := busy_machine_warning(results["device"].get("busy_cores_at_start")):
        log(f"warning: {warning}")
    total = len(args.deployments)
    interrupted = False
    try:
        rates = args.request_rates
        if args.rate_sweep == "plan":
            results["capacity_rps"] = planned_capacity(args)
            results["config"]["profile"] = args.profile
            rates = auto_rates(max(results["capacity_rps"].values()))
            results["config"]["request_rates"] = rates
            log(f"predicted capacity {results['capacity_rps']} req/s -> rates "
                f"{', '.join(f'{r:g}' for r in rates)}")
        elif rates is None:  # --rate-sweep auto
            for i, d in enumerate(args.deployments, 1):
                probe: list[dict] = []
                if error := run_deployment(args, d, [math.inf], probe, f"capacity {i}/{total}"):
                    results["failures"].append({"config": d.name, "stage": "capacity", "error": error})
                elif probe:
                    results["capacity_rps"][d.name] = probe[0]["request_throughput"]
            if not any(results["capacity_rps"].values()):
                raise LaunchError("no configuration completed a request: no capacity to sweep from")
            rates = auto_rates(max(results["capacity_rps"].values()))
            results["config"]["request_rates"] = rates
            log(f"capacity {results['capacity_rps']} req/s -> rates {', '.join(f'{r:g}' for r in rates)}")
        for i, d in enumerate(args.deployments, 1):
            if error := run_deployment(args, d, rates, results["rows"], f"{i}/{total}"):
                results["failures"].append({"config": d.name, "stage": "sweep", "error": error})
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: writing what was measured")
    except LaunchError as e:
        log(f"error: {e}")
        results["failures"].append({"config": None, "stage": "capacity", "error": str(e)})
    results["slo_capacity"] = slo_capacity(results["rows"])
    print(format_table(results["rows"]))
    print(format_best(results["rows"]))
    print(format_capacity(results["slo_capacity"]))
    write_outputs(results, args.output_dir)
    if interrupted:
        return 130
    return 1 if results["failures"] or not results["rows"] else 0


if __name__ == "__main__":
    sys.exit(main())
