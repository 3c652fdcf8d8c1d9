"""Serving metrics as vLLM's and SGLang's serving benchmarks define them, over what a client
saw of each request: bench/serving.py measures a real server with them, `pd-serve plan` a
simulated one. Per request:
  TTFT  first content chunk - send.
  E2E   last content chunk - send (vLLM's E2EL).
  TPOT  (E2E - TTFT) / (n - 1), n = output tokens; requests with n <= 1 have no TPOT.
  ITL   every gap between consecutive content chunks (one chunk may carry several tokens).
Statistics pool completed requests (ITL: all their gaps); throughputs count completed requests
over the run's wall time; goodput is completed requests per second meeting every SLO (a request
with n <= 1 meets a TPOT SLO).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}  # name on the CLI -> metric
PERCENTILES = (90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds since the benchmark started."""

    prompt_len: int                  # ids in the request (the prompt sent to the chat template for chat)
    max_tokens: int                  # the output length asked for (ignore_eos)
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    num_output_tokens: int = 0       # usage.completion_tokens, else the number of content chunks
    num_prompt_tokens: int | None = None  # usage.prompt_tokens
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    error: str | None = None
    server_timings: dict | None = None  # pd-serve's `timings` on the finishing chunk (seconds)

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def input_tokens(self) -> int:
        return self.num_prompt_tokens if self.num_prompt_tokens is not None else self.prompt_len

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.send_time

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def summarize_ms(values_s: list[float]) -> dict:
    """mean, median, p90, p99 in ms (numpy's linear-interpolation percentiles); None when empty."""
    keys = ["mean", "median"] + [f"p{p}" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    stats = [ms.mean(), np.median(ms)] + [np.percentile(ms, p) for p in PERCENTILES]
    return {k: float(v) for k, v in zip(keys, stats)}


def meets_slo(record: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (ms); no TPOT (n <= 1) counts as 0."""
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2e": record.e2e}
    return all(values[name] * 1000.0 <= limit for name, limit in slo_ms.items())


def compute_metrics(records: list[RequestRecord], duration_s: float,
                    slo_ms: dict[str, float] | None = None) -> dict:
    """Aggregate metrics of one run. `slo_ms` maps ttft / tpot / e2e to limits in ms."""
    done = [r for r in records if r.success]
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    num_good = sum(meets_slo(r, slo_ms) for r in done) if slo_ms else None
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "slo_ms": dict(slo_ms) if slo_ms else None,
        "num_good": num_good,
        "goodput": num_good / duration_s if slo_ms else None,
        "ttft_ms": summarize_ms([r.ttft for r in done]),
        "tpot_ms": summarize_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": summarize_ms([gap for r in done for gap in r.itls]),
        "e2e_ms": summarize_ms([r.e2e for r in done]),
    }


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=500,tpot=50[,e2e=10000]` (ms) -> {"ttft": 500.0, "tpot": 50.0, ...}."""
    slo = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip().lower() not in SLO_KEYS:
            raise argparse.ArgumentTypeError(f"bad SLO {item!r}: use ttft=MS,tpot=MS[,e2e=MS]")
        try:
            ms = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad SLO value in {item!r}: not a number") from None
        if not 0 < ms < math.inf:
            raise argparse.ArgumentTypeError(f"bad SLO value in {item!r}: must be > 0 and finite")
        slo[SLO_KEYS[name.strip().lower()]] = ms
    if not slo:
        raise argparse.ArgumentTypeError("empty SLO")
    return slo
