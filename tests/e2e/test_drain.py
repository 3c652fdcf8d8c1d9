"""SIGTERM drains a worker (--drain-timeout): real processes, the official openai client. The
gateway routes new requests around a draining worker, what it holds finishes, then it exits
(status 0) and leaves the gateway at once; past the timeout what is left fails with a clear
error."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from cluster_helpers import health, start_cluster, wait_idle

PROMPT = "Count to one thousand:"


def client_for(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s")


def decode_holding(cluster, count: int) -> list[str]:
    """The decode workers with requests in flight, once `count` requests are in flight."""
    workers = health(cluster.base_url).get("workers", {})
    busy = [w for w, info in workers.items() if w.startswith("decode") and info["inflight"]]
    return busy if sum(workers[w]["inflight"] for w in busy) >= count else []


def test_sigterm_drains_held_requests_and_routes_new_ones_elsewhere():
    cluster = start_cluster(1, 2, extra=("--drain-timeout", "300"),
                            gateway_args=("--worker-timeout", "3", "--step-timeout", "60",
                                          "--decode-policy", "round_robin"))
    try:
        client = client_for(cluster)
        model = client.models.list().data[0].id
        held: dict = {}

        def long_request():  # long enough to be running through the checks below
            held["out"] = client.completions.create(model=model, prompt=PROMPT, max_tokens=400,
                                                    temperature=0, extra_body={"ignore_eos": True})

        thread = threading.Thread(target=long_request)
        thread.start()
        victim_id = wait_for(lambda: decode_holding(cluster, 1), 60, "the long request on a decode")[0]
        victim = dict(cluster.procs)[victim_id]
        os.kill(victim.pid, signal.SIGTERM)
        wait_for(lambda: health(cluster.base_url)["workers"][victim_id]["draining"], 15,
                 "the gateway sees the worker draining")
        # Round robin would give one of two new requests to the draining worker.
        streams = [client.completions.create(model=model, prompt=f"{i} apples and", max_tokens=16,
                                             temperature=0, stream=True) for i in range(2)]
        firsts = [next(iter(s)) for s in streams]
        assert all(f.choices for f in firsts)
        workers = health(cluster.base_url)["workers"]
        assert workers[victim_id]["inflight"] == 1, workers  # only the long request
        assert thread.is_alive(), "the long request ended before the checks: make it longer"
        for s in streams:
            for _ in s:
                pass
        thread.join(timeout=300)
        out = held["out"]
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 400
        assert victim.wait(timeout=60) == 0
        # WorkerExit: gone from the gateway at once (its silence alone would take 3 s)
        wait_for(lambda: victim_id not in health(cluster.base_url)["workers"], 2, "the worker leaves")
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].finish_reason == "length"
        assert all(used == 0 for used, _ in wait_idle(cluster).values())
    finally:
        cluster.stop()


def test_drain_timeout_fails_what_is_left_and_exits():
    cluster = start_cluster(0, 0, num_colocated=1, extra=("--drain-timeout", "2"),
                            gateway_args=("--worker-timeout", "30", "--step-timeout", "60"))
    try:
        client = client_for(cluster)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=5000,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        worker = dict(cluster.procs)["colocated-0"]
        start = None
        with pytest.raises(openai.APIError, match="drain-timeout"):
            for i, _chunk in enumerate(stream):
                if i == 2:
                    os.kill(worker.pid, signal.SIGTERM)
                    start = time.monotonic()
        # failed by WorkerExit, well before the gateway's 30 s --worker-timeout
        assert start is not None and time.monotonic() - start < 20
        assert worker.wait(timeout=30) == 0
        assert health(cluster.base_url)["workers"] == {}
    finally:
        cluster.stop()


def test_a_prefill_worker_ended_by_its_drain_timeout_exits_cleanly():
    """A prefill worker whose drain timeout ends requests in the middle of prefills and KV sends
    still exits with status 0 (its KV sender stopped before the interpreter goes: exiting with
    the sender's I/O thread live aborted the process in libzmq), and the decode side frees
    every page those requests reserved."""
    cluster = start_cluster(1, 1, extra=("--drain-timeout", "1"),
                            gateway_args=("--worker-timeout", "30", "--step-timeout", "60"))
    try:
        client = client_for(cluster)
        model = client.models.list().data[0].id
        errors = []

        def long_prompt(i):
            try:
                client.completions.create(model=model, prompt=f"{i} " + "word " * 1500,
                                          max_tokens=50, temperature=0)
            except openai.APIError as e:
                errors.append(e)

        threads = [threading.Thread(target=long_prompt, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        prefill = dict(cluster.procs)["prefill-0"]
        wait_for(lambda: health(cluster.base_url)["workers"]["prefill-0"]["inflight"] >= 4, 120,
                 "prefills in flight")
        os.kill(prefill.pid, signal.SIGTERM)
        assert prefill.wait(timeout=60) == 0
        for t in threads:
            t.join(timeout=120)
        assert errors, "the drain timeout ended none of the requests: make them longer"
        assert all(used == 0 for used, _ in wait_idle(cluster).values())
    finally:
        cluster.stop()
