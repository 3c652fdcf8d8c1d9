"""How close `pd-serve plan`'s predictions come to a measured phase-ratio sweep.

    python bench/planner_check.py --profile bench/results/profile-cpu-smollm2.json \
        --results bench/results/phase-ratio-cpu/results.json [--output check.json]

For every measured row of bench/phase_ratio.py's results.json (a configuration at a request
rate), the planner's simulator runs that configuration with the limits its workers ran with
(their --max-running-requests and --chunked-prefill-size in the sweep's --worker-args, else the
engine defaults), on the sweep's workload (the same dataset flags and seed, so the same request
lengths and arrival times) and SLOs. The table gives predicted and measured goodput and the
relative error (predicted - measured) / measured; rows whose measured goodput is 0 get an
absolute error instead. The planner issue's bar is |error| <= 25 % for every row. Where the
sweep kept per-request latencies, each row also compares request by request (same arrivals):
the median |error| of TTFT and TPOT, predicted against measured.

--slo ttft=MS,tpot=MS[,e2e=MS] judges both sides by other SLOs than the sweep's: the measured
goodput is counted again from the requests' latencies that results.json keeps (`latencies_ms`,
sweeps from commit 60efeb2 on), and the simulator runs with the new SLOs.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # `python bench/planner_check.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import git_commit, write_json  # noqa: E402
from bench.phase_ratio import plot_rate_panels, slo_capacity  # noqa: E402
from pd_serve.planner.costs import CostModel, load_profile  # noqa: E402
from pd_serve.planner.metrics import parse_slo  # noqa: E402
from pd_serve.planner.plan import (CAPACITY_TARGET, bounded, summarize, workload,  # noqa: E402
                                   workload_args)
from pd_serve.planner.simulator import ClusterSpec, PoolLimits, simulate, to_records  # noqa: E402

BAR = 0.25  # the planner issue's acceptance: |relative error| of goodput per configuration


def worker_limits(worker_args: list[str]) -> PoolLimits:
    """The limits a sweep's workers ran with: their flags, else the engine defaults."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--max-running-requests", type=int, default=PoolLimits.max_running_requests)
    p.add_argument("--chunked-prefill-size", type=int, default=PoolLimits.chunked_prefill_size)
    known, _ = p.parse_known_args(worker_args)
    return PoolLimits(known.max_running_requests, known.chunked_prefill_size)


def spec_of(row: dict, limits: PoolLimits) -> ClusterSpec:
    if row["num_colocated"]:
        return ClusterSpec(num_colocated=row["num_colocated"], colocated=limits)
    return ClusterSpec(row["num_prefill"], row["num_decode"], prefill=limits, decode=limits)


def rescore(row: dict, slo: dict[str, float]) -> tuple[float, float]:
    """(goodput, SLO attainment) of a measured row under `slo` (ms), from its per-request
    latencies; goodput counts as bench/serving.py does (good requests / the run's duration)."""
    latencies = row.get("latencies_ms")
    if latencies is None:
        raise ValueError(f"row {row['config']} at {row['request_rate']} req/s has no per-request "
                         "latencies (a sweep older than --slo): run the sweep again, or drop --slo")
    index = {"ttft": 0, "tpot": 1, "e2e": 2}
    good = sum(lat is not None and all((lat[index[k]] or 0.0) <= limit for k, limit in slo.items())
               for lat in latencies)
    return good / row["duration_s"], good / row["num_requests"]


def check(profile: dict, results: dict, slo: dict[str, float] | None = None) -> list[dict]:
    """One row per measured row: predicted vs measured goodput and SLO attainment, under the
    sweep's SLOs or `slo`."""
    config = results["config"]
    slo = slo or config["slo_ms"]
    worker_args = config.get("worker_args") or []
    if isinstance(worker_args, str):
        worker_args = shlex.split(worker_args)
    limits = worker_limits(worker_args)
    serving = argparse.Namespace(**{k.replace("-", "_"): v for k, v in config["serving"].items()})
    wl_args = workload_args(serving, profile.get("max_model_len"))
    costs = CostModel.from_profile(profile)
    out = []
    for row in results["rows"]:
        rate = float(row["request_rate"])
        spec = spec_of(row, limits)
        simulated = simulate(spec, costs, workload(wl_args, rate))
        predicted = summarize(spec, simulated, slo)
        if slo == config["slo_ms"]:
            measured, attainment = row["goodput"] or 0.0, row["slo_attainment"]
        else:
            measured, attainment = rescore(row, slo)
        error = ((predicted["goodput"] - measured) / measured if measured > 0
                 else predicted["goodput"] - measured)
        out.append({"config": row["config"], "request_rate": rate,
                    "measured_goodput": measured, "predicted_goodput": predicted["goodput"],
                    "error": error, "relative": measured > 0,
                    "measured_attainment": attainment,
                    "predicted_attainment": predicted["slo_attainment"],
                    "measured_ttft_p90_ms": row.get("ttft_p90_ms"),
                    "predicted_ttft_p90_ms": predicted["ttft_p90_ms"],
                    "measured_tpot_p90_ms": row.get("tpot_p90_ms"),
                    "predicted_tpot_p90_ms": predicted["tpot_p90_ms"],
                    "request_error": request_errors(simulated, row.get("latencies_ms"))})
    return out


def request_errors(simulated, latencies: list | None) -> dict[str, dict[str, float]] | None:
    """Request by request (send order, both sides' arrivals the same), predicted / measured - 1
    of TTFT and of TPOT over the requests that completed: the median and p90 of its absolute
    value. It shows how close the simulator comes where goodput cannot (a few per cent of
    latency moves many requests across an SLO at the knee). None without per-request latencies
    (sweeps before 60efeb2)."""
    if not latencies:
        return None
    errors: dict[str, list[float]] = {"ttft": [], "tpot": []}
    for record, measured in zip(to_records(simulated), latencies):
        if measured is None:
            continue
        for i, (name, predicted) in enumerate((("ttft", record.ttft), ("tpot", record.tpot))):
            if predicted is not None and measured[i]:
                errors[name].append(abs(predicted * 1000.0 / measured[i] - 1.0))
    return {name: {"median": float(np.median(v)), "p90": float(np.percentile(v, 90))}
            for name, v in errors.items() if v}


def capacity_check(rows: list[dict]) -> list[dict]:
    """Per configuration, the SLO capacity (phase_ratio.slo_capacity: the highest rate at >= 90 %
    attainment, linear between the swept rates) from the measured and from the predicted
    attainments. error: relative to measured when the sweep pins both; when one is only a bound
    (the sweep's rates never crossed the target), the error it implies at least; None when both
    are the same bound."""
    def capacity(key: str) -> dict[str, dict]:
        return slo_capacity([{"config": r["config"], "request_rate": r["request_rate"],
                              "slo_attainment": r[key], "num_slots": 1} for r in rows])

    measured, predicted = capacity("measured_attainment"), capacity("predicted_attainment")
    out = []
    for config, m in measured.items():
        p = predicted[config]
        same_bound = m["bound"] == p["bound"] != "="
        out.append({"config": config, "measured_rps": m["rate"], "measured_bound": m["bound"],
                    "predicted_rps": p["rate"], "predicted_bound": p["bound"],
                    "error": None if same_bound else (p["rate"] - m["rate"]) / m["rate"],
                    "exact": m["bound"] == p["bound"] == "="})
    return out


def format_capacity(rows: list[dict]) -> str:
    lines = [f"SLO capacity (highest rate at >= {CAPACITY_TARGET:.0%} attainment), measured / predicted:"]
    for c in rows:
        m = bounded(c["measured_rps"], c["measured_bound"])
        p = bounded(c["predicted_rps"], c["predicted_bound"])
        if c["error"] is None:
            verdict = "both beyond the swept rates"
        else:
            verdict = f"{c['error']:+.0%}" + ("" if c["exact"] else " at least (a bound)")
        lines.append(f"  {c['config']:<12}{m:>8} / {p:<8} {verdict}")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'config':<12}{'rate':>6}{'measured':>10}{'predicted':>10}{'error':>9}"
             f"{'attain m/p':>13}{'TTFT p90 m/p':>16}{'TPOT p90 m/p':>15}"
             f"{'per request TTFT/TPOT':>23}"]
    for r in rows:
        err = f"{r['error']:+.0%}" if r["relative"] else f"{r['error']:+.2f}"
        lines.append(f"{r['config']:<12}{r['request_rate']:>6g}{r['measured_goodput']:>10.3f}"
                     f"{r['predicted_goodput']:>10.3f}{err:>9}"
                     f"{r['measured_attainment']:>7.0%}/{r['predicted_attainment']:<5.0%}"
                     f"{_ms(r['measured_ttft_p90_ms']):>8}/{_ms(r['predicted_ttft_p90_ms']):<7}"
                     f"{_ms(r['measured_tpot_p90_ms']):>7}/{_ms(r['predicted_tpot_p90_ms']):<7}"
                     f"{_request_error(r.get('request_error')):>16}")
    relative = [abs(r["error"]) for r in rows if r["relative"]]
    within = sum(e <= BAR for e in relative)
    lines.append(f"goodput within {BAR:.0%}: {within} of {len(relative)} rows"
                 + (f"; largest |error| {max(relative):.0%}" if relative else ""))
    medians = {k: [r["request_error"][k]["median"] for r in rows
                   if r.get("request_error") and k in r["request_error"]] for k in ("ttft", "tpot")}
    if medians["ttft"] and medians["tpot"]:
        lines.append("per request, predicted against measured, median |error| over the rows' "
                     f"medians: TTFT {np.median(medians['ttft']):.1%}, TPOT "
                     f"{np.median(medians['tpot']):.1%} (largest row median "
                     f"{max(medians['ttft']):.1%} / {max(medians['tpot']):.1%})")
    return "\n".join(lines)


def _request_error(error: dict | None) -> str:
    """A row's median per-request |error| of TTFT / TPOT, or - without latencies."""
    if not error:
        return "-"
    return "/".join(f"{error[k]['median']:.0%}" if k in error else "-" for k in ("ttft", "tpot"))


def _ms(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.0f}"


def plot(rows: list[dict], title: str, path: str | Path) -> None:
    """phase_ratio's two panels (goodput, SLO attainment against rate), a colour per
    configuration: measured solid and filled, predicted dashed and hollow."""
    lines = []
    for i, name in enumerate(dict.fromkeys(r["config"] for r in rows)):
        mine = sorted((r for r in rows if r["config"] == name), key=lambda r: r["request_rate"])
        for side, style in (("measured", {}), ("predicted", dict(linestyle="--", markerfacecolor="none"))):
            lines.append((i, f"{name} {side}", [r["request_rate"] for r in mine],
                          [r[f"{side}_goodput"] for r in mine],
                          [r[f"{side}_attainment"] for r in mine], style))
    plot_rate_panels(lines, f"planner check: {title}", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="a profile JSON from pd-serve profile")
    p.add_argument("--results", required=True, help="a results.json from bench/phase_ratio.py")
    p.add_argument("--output", default=None, help="write the rows as JSON here")
    p.add_argument("--plot", default=None,
                   help="write a PNG here: measured and predicted goodput and SLO attainment")
    p.add_argument("--slo", type=parse_slo, default=None,
                   help="judge by these SLOs (ms) instead of the sweep's, e.g. ttft=2000,tpot=7")
    args = p.parse_args(argv)
    profile = load_profile(args.profile)
    results = json.loads(Path(args.results).read_text())
    try:
        rows = check(profile, results, args.slo)
    except ValueError as e:
        p.error(str(e))
    capacity = capacity_check(rows)
    print(format_table(rows))
    print(format_capacity(capacity))
    if args.output:
        write_json(args.output, {"profile": args.profile, "results": args.results,
                                 "results_commit": results.get("commit"), "git_commit": git_commit(),
                                 "slo_ms": args.slo or results["config"]["slo_ms"], "bar": BAR,
                                 "rows": rows, "slo_capacity": capacity})
    if args.plot:
        plot(rows, f"{Path(args.results).parent.name} against {Path(args.profile).name}",
             args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
