"""Start local clusters for end-to-end tests and read their state."""

from __future__ import annotations

import json
import time
import urllib.request

import openai

from prometheus_client.parser import text_string_to_metric_families

from helpers import TEST_DEVICE, TEST_MODEL, TEST_TRANSFER
from pd_serve.launch import LocalCluster, free_port

WORKER_ARGS = ["--device", TEST_DEVICE, "--max-total-tokens", "8192", "--transfer-timeout", "10",
               *TEST_TRANSFER]


def start_cluster(num_prefill=1, num_decode=1, num_colocated=0, model=None, extra=(),
                  gateway_args=("--worker-timeout", "3", "--step-timeout", "30"),
                  role_tp=None, role_ep=None) -> LocalCluster:
    model = model or TEST_MODEL
    engine_args = list(WORKER_ARGS) + (["--model", str(model)] if model else []) + list(extra)
    cluster = LocalCluster(port=free_port(), num_prefill=num_prefill, num_decode=num_decode,
                           num_colocated=num_colocated, engine_args=engine_args,
                           gateway_args=list(gateway_args) + (["--model", str(model)] if model else []),
                           log_level="warning", role_tp=role_tp, role_ep=role_ep)
    try:
        cluster.wait_ready(timeout_s=240)
    except Exception:
        cluster.stop()
        raise
    return cluster


def metrics(base_url: str) -> dict:
    """{(sample name, worker label): value} from the gateway's /metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, s.labels.get("worker", ""))] = s.value
    return out


def pages(base_url: str) -> dict[str, tuple[float, float]]:
    """worker -> (used pages, total pages)."""
    m = metrics(base_url)
    return {w: (m[("pd_serve:kv_pages_used", w)], m[("pd_serve:kv_pages_total", w)])
            for (name, w) in m if name == "pd_serve:kv_pages_total"}


def health(base_url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())
    except OSError:  # not listening (yet)
        return {}


def wait_idle(cluster, timeout=20.0) -> dict:
    """Every worker's pages, once none is used (or at the timeout): {worker: (used, total)}."""
    deadline = time.monotonic() + timeout
    while True:
        state = pages(cluster.base_url)
        if all(used == 0 for used, _ in state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def assert_greedy_completions(cluster, prompts: list[str], texts: list[str], max_tokens: int) -> None:
    """The cluster's greedy completions (ignore_eos) are `texts`, and then every page is free."""
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for prompt, text in zip(prompts, texts):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == text
    state = wait_idle(cluster)
    assert all(used == 0 for used, _ in state.values()), f"pages still used: {state}"


def protocol_errors(base_url: str) -> dict[tuple[str, str], float]:
    """(worker, socket) -> messages refused there (pd_serve:protocol_errors_total); worker
    "gateway" is the gateway's own count, the others come with each worker's heartbeat."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.labels.get("worker", ""), s.labels["socket"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "pd_serve:protocol_errors_total"}


def restart(cluster, name: str, args: list[str] | None = None) -> None:
    """Start process `name` of the cluster again (killed first if it still runs), from its own
    command line or from `args` (pd-serve CLI arguments), in its place in cluster.procs. A
    worker comes back under the same --worker-id: a new incarnation."""
    i, proc = next((i, p) for i, (n, p) in enumerate(cluster.procs) if n == name)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    level_at = proc.args.index("--log-level")
    cluster._start(name, args if args is not None else proc.args[level_at + 2:], proc.args[level_at + 1])
    cluster.procs[i] = cluster.procs.pop()
