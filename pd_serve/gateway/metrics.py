"""Prometheus metrics of the gateway, plus every registered worker's series, in one scrape.

Workers send their exposition text with each heartbeat; the gateway re-emits their samples
with a `worker` label, merged per metric family so each family appears once.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pd_serve.protocol import ERRORS_REGISTRY

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pd_serve:time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pd_serve:time_per_output_token_seconds", "TPOT per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pd_serve:inter_token_latency_seconds", "gap between token arrivals",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pd_serve:e2e_request_latency_seconds", "end-to-end latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("pd_serve:request_queue_time_seconds",
                                    "arrival until decode admitted it", buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pd_serve:requests", "finished requests", ["finish_reason"], registry=r)
        self.queued = Gauge("pd_serve:num_requests_queued", "requests waiting in the gateway's "
                            "queue for a prefill+decode pair", registry=r)
        self.rejected = Counter("pd_serve:requests_rejected", "requests refused before they ran, "
                                "by why (queue_full, outstanding, admit_timeout)", ["reason"], registry=r)
        self.retried = Counter("pd_serve:request_retries", "requests sent back to the queue "
                               "because their worker was lost before their first token", registry=r)
        self.num_workers = Gauge("pd_serve:num_workers", "registered workers", ["role"], registry=r)

    def finished(self, reason: str) -> None:
        self.requests.labels(finish_reason=reason).inc()


def render(gateway: GatewayMetrics, workers: dict) -> bytes:
    """The gateway's series followed by all workers' series (label worker=<id>)."""
    for role in ("prefill", "decode", "colocated"):
        gateway.num_workers.labels(role=role).set(sum(w.status.role == role for w in workers.values()))
    families: dict[str, Metric] = {}
    own = generate_latest(ERRORS_REGISTRY).decode()  # named like the workers' own: merged with them
    for worker_id, text in [("gateway", own)] + [(w, s.status.metrics) for w, s in sorted(workers.items())]:
        try:
            parsed = list(text_string_to_metric_families(text))
        except Exception:  # noqa: BLE001 (whatever a worker sent, the scrape goes on)
            logger.warning("worker %s sent metrics that do not parse; left out", worker_id)
            continue
        for fam in parsed:
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, "worker": worker_id}, s.value, s.timestamp)
    registry = CollectorRegistry()
    registry.register(_Static(list(families.values())))
    return generate_latest(gateway.registry) + generate_latest(registry)


class _Static:
    def __init__(self, metrics: list[Metric]):
        self.metrics = metrics

    def collect(self):
        return self.metrics


class RequestTimer:
    """Phase timings of one request, and the latency metrics they feed."""

    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.marks: dict[str, float] = {}
        self.prefill_timings: dict = {}
        self.num_tokens = 0
        self.last_token = self.start

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()
        if name == "queue":
            self.metrics.queue_time.observe(self.marks[name] - self.start)

    def tokens(self, n: int) -> None:
        t = time.monotonic()
        if self.num_tokens == 0:
            self.marks["first_token"] = t
            self.metrics.ttft.observe(t - self.start)
        else:
            self.metrics.itl.observe(t - self.last_token)
        self.last_token = t
        self.num_tokens += n

    def timings(self) -> dict:
        end = time.monotonic()
        out = {"e2e": end - self.start, "queue": self.marks.get("queue", end) - self.start,
               **{k: v for k, v in self.prefill_timings.items()}}
        if "first_token" in self.marks:
            out["first_token"] = self.marks["first_token"] - self.start
            out["decode"] = end - self.marks["first_token"]
            if self.num_tokens > 1:
                out["tpot"] = out["decode"] / (self.num_tokens - 1)
                self.metrics.tpot.observe(out["tpot"])
        self.metrics.e2e.observe(out["e2e"])
        return out
