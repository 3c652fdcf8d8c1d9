"""The cluster under stress and failure: a burst, a full queue, workers without the cluster key,
kill -9 of each process mid-request, a thousand streams with clients leaving, a soak, and
garbage on its sockets.

Real processes on CPU (one prefill and one decode worker, the embedded model), one cluster for
the module: a test that kills a process starts it again, and the `cluster` fixture restarts
whatever a failed test left dead. Every test ends with no KV page used on any worker and
nothing in flight or queued at the gateway. After a kill no client waits longer than 2x
--worker-timeout (the issue's bound); every other wait is generous (a loaded 2-core box).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import pytest
import zmq

from cluster_helpers import (WORKER_ARGS, health, pages, protocol_errors, restart, start_cluster,
                             wait_idle)
from helpers import TEST_MODEL
from pd_serve import protocol
from pd_serve.launch import free_port

WORKER_TIMEOUT_S = 4.0
HANG_S = 2 * WORKER_TIMEOUT_S  # after a kill, the longest any client or page may wait
REPORT_LAG_S = 3.0  # workers' pages reach the gateway's /metrics with their status (every 1 s)
START_S = 240.0  # a process start-up on a loaded 2-core box
IDLE_S = 30.0  # for the last requests' ends to reach every worker
GATEWAY_ARGS = ("--worker-timeout", str(WORKER_TIMEOUT_S), "--step-timeout", "60")
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time,", "Water boils at",
           "The three primary colours are", "In 1492,", "List three fruits:", "Hello"]
SOAK_S = float(os.environ.get("PD_SERVE_SOAK_S", "60"))
SOAK_WARMUP_S = float(os.environ.get("PD_SERVE_SOAK_WARMUP_S", "20"))


# ---- the module's cluster ----------------------------------------------------------------
@pytest.fixture(scope="module")
def kv_port() -> int:
    """The decode worker's KV receiver port (fixed, so garbage can be sent to it)."""
    return free_port()


@pytest.fixture(scope="module")
def running(kv_port):
    cluster = start_cluster(1, 1, extra=["--port", str(kv_port)], gateway_args=GATEWAY_ARGS)
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(running):
    """The module's cluster with every process up, registered and idle."""
    for name, proc in list(running.procs):
        if proc.poll() is not None:  # a failed test left it dead
            restart_and_wait(running, name, running.gateway_command if name == "gateway" else None)
    running.wait_ready(timeout_s=START_S, num_workers=2)
    wait_drained(running, IDLE_S)
    return running


@pytest.fixture
def model(cluster) -> str:
    with urllib.request.urlopen(f"{cluster.base_url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def worker(cluster, role: str) -> tuple[str, subprocess.Popen]:
    return next((name, proc) for name, proc in cluster.procs if name.startswith(role))


def drained(cluster, num_workers: int | None = None) -> tuple[bool, dict, dict]:
    """(nothing queued, in flight or holding pages, and num_workers registered if given;
    /health; pages)."""
    state, used = health(cluster.base_url), pages(cluster.base_url)
    ok = (state.get("queued") == 0 and all(w["inflight"] == 0 for w in state["workers"].values())
          and all(u == 0 for u, _ in used.values()))
    if num_workers is not None:
        ok = ok and len(used) == num_workers == len(state["workers"])
    return ok, state, used


def wait_drained(cluster, timeout: float, num_workers: int | None = None) -> tuple[bool, dict, dict]:
    deadline = time.monotonic() + timeout
    while True:
        ok, state, used = drained(cluster, num_workers)
        if ok or time.monotonic() > deadline:
            return ok, state, used
        time.sleep(0.2)


def assert_idle(cluster, num_workers: int = 2, timeout: float = IDLE_S) -> None:
    """No page used on any worker, nothing in flight on any, nothing queued, every worker
    registered (one the gateway dropped while it was paused registers again at its next
    status): the test's end."""
    ok, state, used = wait_drained(cluster, timeout, num_workers)
    assert ok, f"not idle with {num_workers} workers after {timeout} s: health {state}, pages {used}"


def restart_and_wait(cluster, name: str, args: list[str] | None = None) -> None:
    """`name` started again (see restart), and the cluster whole again. A killed worker must
    have left the gateway's registry first, or its old entry would count as registered."""
    if not name.startswith("gateway"):
        deadline = time.monotonic() + HANG_S + REPORT_LAG_S
        while name in health(cluster.base_url).get("workers", {}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert name not in health(cluster.base_url).get("workers", {}), f"dead {name} still registered"
    restart(cluster, name, args)
    cluster.wait_ready(timeout_s=START_S, num_workers=2)


# ---- the client ----------------------------------------------------------------------------
@dataclass
class Reply:
    """One /v1/completions answer as the client saw it."""

    status: int = 0  # 0: no answer (the connection broke before the headers)
    headers: dict = field(default_factory=dict)
    body: dict | None = None  # a whole reply, or an error body
    chunks: list[dict] = field(default_factory=list)  # a stream's events with choices
    usage: dict | None = None  # a stream's usage event
    done: bool = False  # a stream's [DONE] came
    error: str = ""  # an error event, a broken connection
    left: bool = False  # the client closed the connection on purpose
    ended: float = 0.0  # time.monotonic() when the client had all it would get

    @property
    def completion_tokens(self) -> int | None:
        usage = self.usage if self.body is None else self.body.get("usage")
        return usage["completion_tokens"] if usage else None

    def complete(self, max_tokens: int) -> bool:
        """200, no error, every token (a stream: through [DONE])."""
        return (self.status == 200 and not self.error and self.completion_tokens == max_tokens
                and (self.body is not None or self.done))


def request_body(model: str, prompt: str, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                 connector=aiohttp.TCPConnector(limit=limit))


async def call(client: aiohttp.ClientSession, base_url: str, body: dict, *,
               leave_after: int | None = None, started: asyncio.Event | None = None) -> Reply:
    """POST /v1/completions and read the answer: a stream to its end, or (leave_after=k) until
    k chunks have come, then close the connection. `started` is set at a stream's 2nd chunk."""
    reply = Reply()
    try:
        async with client.post(f"{base_url}/v1/completions", json=body) as resp:
            reply.status, reply.headers = resp.status, dict(resp.headers)
            if resp.status != 200 or not body.get("stream"):
                reply.body = await resp.json(content_type=None)
                return reply
            if leave_after == 0:
                reply.left = True
                resp.close()
                return reply
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    reply.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    reply.error = event["error"]["message"]
                elif event.get("usage"):
                    reply.usage = event["usage"]
                elif event.get("choices"):
                    reply.chunks.append(event)
                    if started is not None and len(reply.chunks) == 2:
                        started.set()
                    if leave_after is not None and len(reply.chunks) >= leave_after:
                        reply.left = True
                        resp.close()
                        return reply
            if not reply.done and not reply.error:
                reply.error = "the stream ended without [DONE]"
            return reply
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
        reply.error = reply.error or repr(e)
        return reply
    finally:
        reply.ended = time.monotonic()


async def call_all(base_url: str, bodies: list[dict], limit: int = 0) -> list[Reply]:
    """Every body at once (or at most `limit` at a time)."""
    gate = asyncio.Semaphore(limit or len(bodies))
    async with session(limit) as client:
        async def one(body):
            async with gate:
                return await call(client, base_url, body)
        return await asyncio.gather(*(one(b) for b in bodies))


def no_5xx(replies: list[Reply]) -> None:
    bad = [r for r in replies if r.status >= 500 or r.status == 0]
    assert not bad, f"{len(bad)} replies 5xx or broken, e.g. {bad[0]}"


def short_prompt(rng: random.Random, i: int) -> str:
    return f"{rng.choice(PROMPTS)} {i}"


def long_prompt(i: int, words: int) -> str:
    """About `words` tokens, distinct per i."""
    return f"Request {i}: " + "word " * words


def wait_for(what, timeout: float, interval: float = 0.05):
    """what()'s first truthy value within `timeout` seconds, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(interval)
    return None


def inflight(cluster, role: str) -> int:
    return sum(w["inflight"] for w in health(cluster.base_url).get("workers", {}).values()
               if w["role"] == role)


# ---- 1. a burst ----------------------------------------------------------------------------
def test_burst_of_300_requests_all_complete(cluster, model):
    rng = random.Random(1)
    bodies = [request_body(model, short_prompt(rng, i), rng.randint(8, 16), stream=i % 2 == 0)
              for i in range(300)]
    replies = asyncio.run(call_all(cluster.base_url, bodies))
    no_5xx(replies)
    assert Counter(r.status for r in replies) == {200: 300}
    incomplete = [(b["max_tokens"], r) for b, r in zip(bodies, replies) if not r.complete(b["max_tokens"])]
    assert not incomplete, f"{len(incomplete)} incomplete, e.g. {incomplete[0]}"
    assert_idle(cluster)


# ---- 2. a full queue ------------------------------------------------------------------------
def test_full_queue_answers_429_with_retry_after(cluster, model):
    """--max-queued-requests 8 on a restarted gateway; prompts of ~250 tokens so that prefill's
    room (4 steps of 2,048 tokens) fills and the rest waits in the gateway's queue. (A longer
    --step-timeout: on a loaded CPU the last prompts given to prefill wait minutes there.)"""
    restart_and_wait(cluster, "gateway", [*cluster.gateway_command, "--max-queued-requests", "8",
                                          "--step-timeout", "300"])
    try:
        bodies = [request_body(model, long_prompt(i, 250), 8, stream=i % 2 == 0) for i in range(100)]
        replies = asyncio.run(call_all(cluster.base_url, bodies))
        no_5xx(replies)
        statuses = Counter(r.status for r in replies)
        assert set(statuses) == {200, 429}, statuses
        for reply in replies:
            if reply.status == 200:
                assert reply.complete(8), reply
            else:
                assert int(reply.headers["Retry-After"]) >= 0, reply
                error = reply.body["error"]
                assert error["type"] == "rate_limit_error" and "max-queued-requests" in error["message"]
        assert_idle(cluster)
    finally:
        restart_and_wait(cluster, "gateway", cluster.gateway_command)


# ---- 3. a worker without the cluster key ----------------------------------------------------
def test_worker_without_the_cluster_key_cannot_register(cluster, model, tmp_path):
    """Two decode workers started by hand against the running gateway, one with a wrong
    PD_SERVE_CLUSTER_KEY, one with none: once up (their start-up log line), they do not get
    past the control socket's handshake (nothing of theirs reaches the gateway), are never
    registered, say so in their log, and the cluster still serves."""
    before = protocol_errors(cluster.base_url).get(("gateway", "control"), 0)
    intruders = {}
    for worker_id, key in (("intruder-wrong-key", "wrong"), ("intruder-no-key", None)):
        env = {k: v for k, v in os.environ.items() if k != "PD_SERVE_CLUSTER_KEY"}
        if key is not None:
            env["PD_SERVE_CLUSTER_KEY"] = key
        log = tmp_path / f"{worker_id}.log"
        args = [sys.executable, "-m", "pd_serve.cli", "--log-level", "info", "decode", "--gateway",
                f"tcp://127.0.0.1:{cluster.control_port}", "--worker-id", worker_id, *WORKER_ARGS,
                "--max-total-tokens", "2048", *(["--model", str(TEST_MODEL)] if TEST_MODEL else [])]
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        intruders[worker_id] = (proc, log)
    try:
        for worker_id, (proc, log) in intruders.items():
            line = f"decode {worker_id}: model"  # logged once it is up, before its first status
            up = wait_for(lambda: proc.poll() is not None or line in log.read_text(), START_S, 0.5)
            assert up and proc.poll() is None, f"{worker_id} did not start:\n{log.read_text()[-3000:]}"
        for worker_id, (proc, log) in intruders.items():  # (after UNHEARD_WARN_S)
            assert wait_for(lambda: "no word from the gateway" in log.read_text(), 60, 0.5), \
                f"{worker_id} did not warn:\n{log.read_text()[-3000:]}"
        assert protocol_errors(cluster.base_url).get(("gateway", "control"), 0) == before
        for _ in range(10):
            assert not any(w.startswith("intruder") for w in health(cluster.base_url)["workers"])
            time.sleep(0.3)
        assert all(proc.poll() is None for proc, _ in intruders.values())  # they kept trying
        replies = asyncio.run(call_all(cluster.base_url, [request_body(model, p, 8) for p in PROMPTS[:4]]))
        assert all(r.complete(8) for r in replies), replies
    finally:
        for proc, _ in intruders.values():
            proc.kill()
            proc.wait()
    assert_idle(cluster)


# ---- 4. kill -9 of each process mid-request ----------------------------------------------------
def kill_under_load(cluster, model, pid: int, num_streams: int, stream_long: bool,
                    pause_s: float | None = None):
    """Start `num_streams` streams (each past its first token) and three long prompts (in
    prefill), then kill -9 `pid` (or, with pause_s, stop it for that long and let it run
    again). Returns the time of the kill (or of the resume) and every client's reply."""

    async def main():
        started = [asyncio.Event() for _ in range(num_streams)]
        async with session() as client:
            tasks = [asyncio.create_task(call(client, cluster.base_url,
                                              request_body(model, PROMPTS[i], 2000, stream=True),
                                              started=started[i])) for i in range(num_streams)]
            for event in started:
                await asyncio.wait_for(event.wait(), START_S)
            tasks += [asyncio.create_task(call(client, cluster.base_url, request_body(
                model, long_prompt(i, 1500), 2000, stream=stream_long and i % 2 == 0)))
                for i in range(3)]
            await asyncio.to_thread(wait_for, lambda: inflight(cluster, "prefill"), 60)
            if pause_s is None:
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(pause_s)
                finally:
                    os.kill(pid, signal.SIGCONT)
            killed = time.monotonic()
            return killed, await asyncio.gather(*tasks)

    return asyncio.run(main())


def recovers(cluster, killed: float, replies, name: str) -> None:
    """After worker `name` was killed: every client had its answer within 2x --worker-timeout,
    the other workers' pages are free soon after, and `name` restarted serves."""
    for reply in replies:
        assert reply.ended - killed < HANG_S, (reply.ended - killed, reply)
    free = wait_for(lambda: all(u == 0 for u, _ in pages(cluster.base_url).values()),
                    killed + HANG_S + REPORT_LAG_S - time.monotonic(), 0.2)
    assert free, f"pages still held {HANG_S} s after {name} died: {pages(cluster.base_url)}"
    restart_and_wait(cluster, name)
    assert_idle(cluster)


def test_decode_killed_mid_stream(cluster, model):
    """Streams mid-decode and long prompts in prefill when decode dies: every client gets an
    error within 2x --worker-timeout, and prefill's pages are free by then too."""
    decode, proc = worker(cluster, "decode")
    killed, replies = kill_under_load(cluster, model, proc.pid, 2, stream_long=True)
    assert all(r.error or r.status >= 500 for r in replies), replies  # its decode is gone
    recovers(cluster, killed, replies, decode)


def test_prefill_killed_mid_prefill(cluster, model):
    """Prefill frozen with prompts on it (SIGSTOP), then killed: every client has its answer
    (an error, unless its prompt was through) within 2x --worker-timeout, and decode has freed
    the pages it reserved for them."""
    prefill, proc = worker(cluster, "prefill")
    bodies = [request_body(model, long_prompt(i, 400), 16, stream=i % 2 == 0) for i in range(8)]

    async def main():
        async with session() as client:
            tasks = [asyncio.create_task(call(client, cluster.base_url, body)) for body in bodies]
            while True:  # freeze prefill while it holds prompts
                await asyncio.to_thread(wait_for, lambda: inflight(cluster, "prefill"), 60)
                os.kill(proc.pid, signal.SIGSTOP)
                if await asyncio.to_thread(inflight, cluster, "prefill"):
                    break
                os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGKILL)
            return time.monotonic(), await asyncio.gather(*tasks)

    killed, replies = asyncio.run(main())
    assert any(r.error or r.status >= 500 for r in replies), replies
    assert all(r.complete(16) or r.error or r.status >= 500 for r in replies), replies
    recovers(cluster, killed, replies, prefill)


def test_gateway_killed_mid_stream(cluster, model):
    """The gateway killed with streams on decode and prompts on prefill: the clients' streams
    break at once; the workers, pinged no more, drop every request and free their pages; a
    gateway started again on the same control port sees every worker re-register with no page
    used, and serves. A worker drops the requests at the first look at its clock past 1.5x
    --worker-timeout, which on a loaded box may come after a long prefill step, when the new
    gateway's first ping (which has none of them) has dropped them already: either way they go
    (tests/unit/test_role_schedulers.py pins down the worker's own path)."""
    _, proc = worker(cluster, "gateway")
    killed, replies = kill_under_load(cluster, model, proc.pid, 3, stream_long=False)
    for reply in replies:
        assert reply.error and not reply.done, reply
        assert reply.ended - killed < HANG_S, (reply.ended - killed, reply)
    time.sleep(max(0.0, killed + HANG_S - time.monotonic()))
    restart_and_wait(cluster, "gateway", cluster.gateway_command)
    used = wait_idle(cluster, IDLE_S)
    assert len(used) == 2 and all(u == 0 for u, _ in used.values()), used
    replies = asyncio.run(call_all(cluster.base_url, [request_body(model, p, 8, stream=s)
                                                      for p in PROMPTS[:2] for s in (False, True)]))
    assert all(r.complete(8) for r in replies), replies
    assert_idle(cluster)


def test_gateway_paused_past_the_workers_patience(cluster, model):
    """The gateway frozen (SIGSTOP: a long pause, a starved host) with streams on decode and
    prompts on prefill, for longer than the workers wait for its pings (1.5x --worker-timeout):
    the workers drop those requests. When the gateway runs again, either it finds the workers
    silent for too long and fails their requests, or it hears them first and each worker fails
    the requests it dropped at the gateway's next ping (the path
    tests/unit/test_role_schedulers.py pins down). In the first case a prompt that had no
    token yet goes to the queue again (the gateway's retry before a first token) and may be
    answered in full. Every stream past its first token has an error, every other client an
    error or its whole answer, none left hanging: each error within 2x --worker-timeout of the
    resume. Then the cluster serves on."""
    _, proc = worker(cluster, "gateway")
    resumed, replies = kill_under_load(cluster, model, proc.pid, 3, stream_long=True,
                                       pause_s=1.5 * WORKER_TIMEOUT_S + 2)
    for i, reply in enumerate(replies):
        if i >= 3 and reply.complete(2000):  # a long prompt, retried
            continue
        assert reply.error or reply.status >= 500, reply
        assert reply.ended - resumed < HANG_S, (reply.ended - resumed, reply)
    assert proc.poll() is None
    assert_idle(cluster)
    replies = asyncio.run(call_all(cluster.base_url, [request_body(model, p, 8) for p in PROMPTS[:2]]))
    assert all(r.complete(8) for r in replies), replies


# ---- 5. clients leaving -------------------------------------------------------------------------
def test_1000_streams_with_a_fifth_of_clients_leaving(cluster, model):
    """1,000 streams, at most 100 at a time; a seeded fifth of the clients leave: before the
    answer's headers (cancelled after a random moment), or after k of the 8 chunks. The rest
    complete; nothing is left in flight, queued or holding pages."""
    rng = random.Random(5)
    plans = []  # (body, leave_after chunks | None, cancel after seconds | None)
    for i in range(1000):
        body = request_body(model, short_prompt(rng, i), 8, stream=True)
        if rng.random() >= 0.2:
            plans.append((body, None, None))
        elif rng.random() < 0.3:
            plans.append((body, None, rng.uniform(0.0, 0.5)))
        else:
            plans.append((body, rng.randint(0, 7), None))

    async def main():
        gate = asyncio.Semaphore(100)
        async with session(100) as client:
            async def one(body, leave_after, cancel_after):
                async with gate:
                    request = call(client, cluster.base_url, body, leave_after=leave_after)
                    if cancel_after is None:
                        return await request
                    try:
                        return await asyncio.wait_for(request, cancel_after)
                    except TimeoutError:
                        return Reply(left=True, ended=time.monotonic())
            return await asyncio.gather(*(one(*plan) for plan in plans))

    replies = asyncio.run(main())
    no_5xx([r for r in replies if r.status or not r.left])
    stayed = [r for (_, leave, cancel), r in zip(plans, replies) if leave is None and cancel is None]
    left = len(replies) - len(stayed)
    assert 150 < left < 250
    incomplete = [r for r in stayed if not r.complete(8)]
    assert not incomplete, f"{len(incomplete)} of {len(stayed)} streams incomplete, e.g. {incomplete[0]}"
    assert_idle(cluster)


# ---- 6. a soak -----------------------------------------------------------------------------------
def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_soak_rss_stays_flat(cluster, model):
    """Steady load (8 clients in a closed loop: short prompts, 4-32 tokens, streamed or not, one
    in ten streams left after a few chunks) for PD_SERVE_SOAK_S seconds (60) after a warm-up of
    PD_SERVE_SOAK_WARMUP_S (20): each process's RSS at the end is within +15 % or +50 MiB
    (whichever is more) of its RSS after the warm-up, both read under load. Every request
    that stayed completes. For a 10-minute soak:

        PD_SERVE_SOAK_S=600 .venv/bin/python -m pytest tests/e2e/test_resilience.py -k soak
    """
    pids = {name: proc.pid for name, proc in cluster.procs}
    rss = {}

    async def main():
        stop = asyncio.Event()
        results: list[tuple[int, Reply]] = []

        async def client_loop(seed: int):
            rng = random.Random(seed)
            async with session(1) as client:
                i = 0
                while not stop.is_set():
                    max_tokens, stream = rng.randint(4, 32), rng.random() < 0.5
                    leave = rng.randint(1, 3) if stream and rng.random() < 0.1 else None
                    body = request_body(model, short_prompt(rng, i), max_tokens, stream)
                    reply = await call(client, cluster.base_url, body, leave_after=leave)
                    results.append((max_tokens, reply))
                    i += 1

        loops = [asyncio.create_task(client_loop(seed)) for seed in range(8)]
        await asyncio.sleep(SOAK_WARMUP_S)
        rss["start"] = {name: rss_kib(pid) for name, pid in pids.items()}
        await asyncio.sleep(SOAK_S)
        rss["end"] = {name: rss_kib(pid) for name, pid in pids.items()}
        stop.set()
        await asyncio.gather(*loops)
        return results

    results = asyncio.run(main())
    print(f"soak: {len(results)} requests in {SOAK_S:.0f} s after a {SOAK_WARMUP_S:.0f} s warm-up; RSS MiB "
          + ", ".join(f"{name} {rss['start'][name] / 1024:.0f} -> {rss['end'][name] / 1024:.0f}"
                      for name in pids))
    no_5xx([reply for _, reply in results])
    incomplete = [r for n, r in results if not r.left and not r.complete(n)]
    assert len(results) > 16 and not incomplete, (len(results), incomplete[:1])
    for name, start in rss["start"].items():
        end = rss["end"][name]
        assert end <= max(start * 1.15, start + 50 * 1024), \
            f"{name}: RSS {start / 1024:.0f} MiB after the warm-up, {end / 1024:.0f} MiB at the end"
    assert_idle(cluster)


# ---- 7. garbage on the sockets ---------------------------------------------------------------------
def send_garbage(address: str, header: bytes, curve_key: bytes = b"") -> zmq.Socket:
    """8 raw bytes over TCP (not even ZMTP), then from a zmq DEALER a 3-frame message and
    `header` (an unkeyed message); curve_key: the DEALER passes the control socket's handshake
    with it. Returns the DEALER (still connected: answers come to it)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"\x00\xffgarbag")
        time.sleep(0.2)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"garbage")
    dealer.setsockopt(zmq.LINGER, 0)
    protocol.secure_control(dealer, curve_key, server=False)
    dealer.connect(address)
    dealer.send_multipart([b"\x01", b"\x02\x03", b"\xff" * 100])
    dealer.send(header)
    return dealer


def test_garbage_on_the_control_and_kv_sockets_is_refused(cluster, model, kv_port):
    prompt = request_body(model, PROMPTS[0], 12)
    [want] = asyncio.run(call_all(cluster.base_url, [prompt]))
    assert want.complete(12), want
    decode, _ = worker(cluster, "decode")
    before = protocol_errors(cluster.base_url)
    # past the control socket's handshake (a key holder's connection), unkeyed messages
    control = send_garbage(f"tcp://127.0.0.1:{cluster.control_port}",
                           protocol.encode(protocol.WorkerStatus("garbage", "decode", "m")),
                           cluster.cluster_key.encode())
    # without the key: not past the handshake, nothing reaches the gateway
    keyless = send_garbage(f"tcp://127.0.0.1:{cluster.control_port}",
                           protocol.encode(protocol.WorkerStatus("keyless", "decode", "m")))
    kv = send_garbage(f"tcp://127.0.0.1:{kv_port}",
                      protocol.encode(protocol.TransferHello("garbage", "tcp", {})))
    try:
        # an unkeyed hello is refused with an answer (so a sender without the key fails at
        # once), and the answer carries the cluster key's tag
        assert kv.poll(30_000), "the KV receiver did not answer an unkeyed hello"
        answer = kv.recv()
        try:
            welcome = protocol.Codec(cluster.cluster_key.encode()).decode(answer)
        except protocol.ProtocolError as e:
            pytest.fail(f"the KV receiver's answer {answer[:80]!r} lacks the cluster key's tag "
                        f"({e}): it runs without PD_SERVE_CLUSTER_KEY")
        assert isinstance(welcome, protocol.TransferWelcome) and not welcome.ok, welcome

        def rose():
            now = protocol_errors(cluster.base_url)
            return all(now.get(k, 0) >= before.get(k, 0) + 2
                       for k in (("gateway", "control"), (decode, "kv-receiver"))) and now
        assert wait_for(rose, 30, 0.5), (before, protocol_errors(cluster.base_url))
        time.sleep(2.0)  # the keyless DEALER's two messages never arrive: the key holder's do
        key = ("gateway", "control")
        assert protocol_errors(cluster.base_url).get(key, 0) == before.get(key, 0) + 2
    finally:
        control.close()
        kv.close()
        keyless.close()
    assert not {"garbage", "keyless"} & set(health(cluster.base_url)["workers"])
    [after] = asyncio.run(call_all(cluster.base_url, [prompt]))
    assert after.complete(12) and after.body["choices"][0]["text"] == want.body["choices"][0]["text"]
    assert_idle(cluster)
