"""The gateway's flow control and failure semantics against scripted workers on real zmq
sockets: the queue's order and bound, clear statuses (400, 429, 503), aborts everywhere, worker
restarts, reconcile pings, and hostile control messages. No model, no worker processes."""

from __future__ import annotations

import asyncio
import json
import contextlib
import socket
import threading
import time
from dataclasses import asdict, replace

import pytest
import zmq
import zmq.asyncio

from pd_serve import protocol
from pd_serve.cache.pool import KVLayout
from pd_serve.config import GatewayConfig
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.gateway import cluster as cluster_module
from pd_serve.gateway.cluster import Cluster
from pd_serve.gateway.source import GenerateSpec
from pd_serve.protocol import (AbortRequest, Admit, AdmitReply, GatewayPing, Generate, Heartbeat,
                               Prefill, PrefillDone, Replaced, StartDecode, TokenBatch, TokenDelta,
                               WorkerExit, WorkerStatus)

KEY = b"test-cluster-key"
LAYOUT = asdict(KVLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=8, dtype="float32"))


class FakeWorker:
    """A scripted worker: registers, records what the gateway sends, answers as told."""

    def __init__(self, cluster: Cluster, role: str, worker_id: str, *, key: bytes = KEY,
                 max_running: int = 8, num_pages: int = 64, incarnation: str = "one",
                 long_prefill: int = 0, policy: str = "fcfs", layout: dict | None = None):
        self.role, self.worker_id, self.incarnation = role, worker_id, incarnation
        self.layout = layout or LAYOUT  # its KV layout
        self.long_prefill = long_prefill  # its --long-prefill-token-threshold
        self.policy = policy  # its --schedule-policy
        self.max_running, self.num_pages = max_running, num_pages
        self.codec = protocol.Codec(key)
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)  # (routing id: the gateway's)
        self.sock.setsockopt(zmq.LINGER, 0)
        protocol.secure_control(self.sock, key, server=False)
        self.sock.connect(cluster.control_address)
        self.received: list = []
        self.full_replies = 0  # decode: answer this many Admits "full" first
        self.finish = True  # decode: end a request at StartDecode
        self.prefill_ok = True
        self.address = "tcp://127.0.0.1:1"  # decode: its KV receiver
        self.unreachable: set[str] = set()  # prefill: KV receivers its transfers to fail
        self.answer_prefill = True  # prefill: answer a Prefill at once (else never)
        self.stuck = False  # heartbeats only: alive, but its loop never comes round
        self.seq = 0  # WorkerStatus.seq of the last status
        self.beats = 0  # Heartbeat.seq of the last beat
        self._task = asyncio.create_task(self._serve())

    def status(self) -> WorkerStatus:
        self.seq += 1
        return WorkerStatus(worker_id=self.worker_id, role=self.role, model="m", seq=self.seq,
                            incarnation=self.incarnation, transfer_backend="tcp",
                            transfer_addresses=[self.address] if self.role == "decode" else [],
                            layout=self.layout, num_pages=self.num_pages, num_free_pages=self.num_pages,
                            max_running_requests=self.max_running, max_prefill_tokens=64,
                            max_model_len=4096, long_prefill_token_threshold=self.long_prefill,
                            schedule_policy=self.policy)

    def beat(self) -> Heartbeat:
        self.beats += 1
        return Heartbeat(self.worker_id, self.incarnation, self.beats)

    def send(self, msg) -> None:
        data = self.codec.encode(msg)
        if isinstance(msg, WorkerStatus):
            self.last_status = data  # what a peer on the wire could record
        elif isinstance(msg, Heartbeat):
            self.last_beat = data
        self.sock.send(data)

    def of(self, kind) -> list:
        return [m for m in self.received if isinstance(m, kind)]

    async def _serve(self) -> None:
        self.send(self.status())
        while True:
            if not await self.sock.poll(200):
                self.send(self.beat() if self.stuck else self.status())
                continue
            msg = self.codec.decode(await self.sock.recv())
            self.received.append(msg)
            if isinstance(msg, Admit):
                if self.full_replies:
                    self.full_replies -= 1
                    self.send(AdmitReply(msg.request_id, False, error="full", retryable=True))
                else:
                    self.send(AdmitReply(msg.request_id, True, [0], [self.address]))
            elif isinstance(msg, Prefill) and self.answer_prefill:
                if msg.decode_addresses[0] in self.unreachable:
                    self.send(PrefillDone(msg.request_id, False, error="KV transfer: no "
                                          "acknowledgement within 30 s", retryable=True))
                else:
                    self.send(PrefillDone(msg.request_id, self.prefill_ok, 7,
                                          error="" if self.prefill_ok else "boom"))
            elif isinstance(msg, StartDecode) and self.finish:
                self.send(TokenBatch(self.worker_id, [TokenDelta(msg.request_id, [8], None, True, "length")]))
            elif isinstance(msg, Generate):  # colocated: both tokens at once
                self.send(TokenBatch(self.worker_id, [TokenDelta(msg.request_id, [7, 8], None, True, "length")]))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close()


def spec(rid: str, num_tokens: int = 4, priority: int = 0) -> GenerateSpec:
    return GenerateSpec(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=2), priority)


async def collect(cluster: Cluster, s: GenerateSpec) -> list:
    return [e async for e in cluster.generate(s)]


async def replaced_told(worker: FakeWorker) -> Replaced:
    """The Replaced message the gateway sent a worker, past what it sent before (it hung)."""
    while True:
        msg = worker.codec.receive(await asyncio.wait_for(worker.sock.recv(), 20), "control", "gateway")
        if isinstance(msg, Replaced):
            return msg


async def until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def gateway(**overrides):
    config = GatewayConfig(**{"cluster_key": KEY, "worker_timeout_s": 5.0, "step_timeout_s": 30.0,
                              "admit_timeout_s": 30.0, **overrides})
    cluster = Cluster(config)
    await cluster.start()
    workers: list[FakeWorker] = []

    def add(role, worker_id, **kw) -> FakeWorker:
        workers.append(FakeWorker(cluster, role, worker_id, **kw))
        return workers[-1]

    try:
        yield cluster, add
    finally:
        for w in workers:
            await w.close()
        await cluster.stop()


def with_gateway(**overrides):
    """Run an async test body `(cluster, add)` against a started gateway (`gateway(**overrides)`)."""
    def wrap(body):
        def test():
            async def run():
                async with gateway(**overrides) as (cluster, add):
                    await body(cluster, add)
            asyncio.run(run())
        test.__doc__ = body.__doc__
        return test
    return wrap


async def ready(cluster: Cluster, n: int) -> None:
    await until(lambda: len(cluster.workers) == n)


async def one_pair(cluster: Cluster, add, **decode_args) -> tuple[FakeWorker, FakeWorker]:
    """A registered decode worker "d" (with `decode_args`) and prefill worker "p"."""
    decode, prefill = add("decode", "d", **decode_args), add("prefill", "p")
    await ready(cluster, 2)
    return decode, prefill


async def held_request(cluster: Cluster, add, **decode_args) -> tuple[FakeWorker, FakeWorker, asyncio.Task]:
    """Request "r" running on a decode worker "d" (with `decode_args`) that never finishes it:
    the decode and prefill workers, and the request's collector task."""
    decode, prefill = await one_pair(cluster, add, **decode_args)
    decode.finish = False
    task = asyncio.create_task(collect(cluster, spec("r")))
    await until(lambda: decode.of(StartDecode))
    return decode, prefill, task


async def queued(cluster: Cluster, specs: list[GenerateSpec]) -> list[asyncio.Task]:
    """Requests sent (their collector tasks) once each waits in the gateway's queue."""
    tasks = [asyncio.create_task(collect(cluster, s)) for s in specs]
    await until(lambda: cluster.num_queued == len(specs))
    return tasks


async def held_then_queued(cluster: Cluster, add, num_queued: int) -> tuple[FakeWorker, list[asyncio.Task]]:
    """Request "r" holding the decode worker's only slot, then `num_queued` requests waiting
    behind it: the prefill worker, and every request's collector task ("r" first)."""
    _, prefill, held = await held_request(cluster, add, max_running=1)
    return prefill, [held] + await queued(cluster, [spec(f"r{i}") for i in range(1, num_queued + 1)])


@with_gateway()
async def test_requests_complete_and_leave_nothing_behind(cluster, add):
    decode, prefill = await one_pair(cluster, add)
    events = await asyncio.gather(*(collect(cluster, spec(f"r{i}")) for i in range(20)))
    assert all(e[-1].finished and not e[-1].error for e in events)
    assert [e.new_token_ids for e in events[0]] == [[7], [8]]
    assert not cluster._flights and not cluster._queue
    assert all(not w.inflight for w in cluster.workers.values())
    assert len(decode.of(Admit)) == len(prefill.of(Prefill)) == 20


async def short_beside_long(cluster, add, threshold: int) -> None:
    """A prefill worker busy with a prompt of many steps (64 tokens a step here) gets no more
    prompts; under --long-prefill-token-threshold, which caps what the long one takes of a step
    while others wait, a short one goes to it at once."""
    add("decode", "d")
    prefill = add("prefill", "p", long_prefill=threshold)
    await ready(cluster, 2)
    prefill.answer_prefill = False
    long = asyncio.create_task(collect(cluster, spec("long", num_tokens=1000)))
    await until(lambda: prefill.of(Prefill))
    short = asyncio.create_task(collect(cluster, spec("short")))
    if threshold:
        await until(lambda: len(prefill.of(Prefill)) == 2)
    else:
        await until(lambda: cluster.num_queued == 1)
        assert len(prefill.of(Prefill)) == 1
    for task in (long, short):
        task.cancel()
    await asyncio.gather(long, short, return_exceptions=True)


@with_gateway()
async def test_a_short_prompt_waits_behind_a_long_one_on_a_busy_prefill_worker(cluster, add):
    await short_beside_long(cluster, add, 0)


@with_gateway()
async def test_a_short_prompt_goes_beside_a_long_one_under_the_long_prefill_threshold(cluster, add):
    await short_beside_long(cluster, add, 32)


@with_gateway()
async def test_a_finished_request_frees_its_worker_before_its_client_reads_the_end(cluster, add):
    """The decode worker's last row of a request frees its slot there at once: a client that
    has not read its answer yet (or never will) holds no worker's room."""
    await one_pair(cluster, add, max_running=1)
    stream = cluster.generate(spec("r"))
    await stream.__anext__()  # token 1 (from prefill); then it reads nothing
    await until(lambda: not cluster.workers["d"].inflight)
    assert not (await collect(cluster, spec("r2")))[-1].error  # on the only slot
    await stream.aclose()


@with_gateway()
async def test_queue_serves_by_priority_then_arrival(cluster, add):
    decode, _, first = await held_request(cluster, add, max_running=1)  # the only slot
    rest = await queued(cluster, [spec(rid, priority=p) for rid, p in
                                  (("low", 5), ("mid", 0), ("high", -3), ("mid2", 0))])
    decode.finish = True
    decode.send(TokenBatch("d", [TokenDelta("r", [8], None, True, "length")]))
    await asyncio.gather(first, *rest)
    assert [m.request_id for m in decode.of(Admit)] == ["r", "high", "mid", "mid2", "low"]


@with_gateway()
async def test_priority_is_honoured_once_a_worker_schedules_by_it(cluster, add):
    """The HTTP layer refuses a non-zero priority unless the source honours it: a cluster
    does once any registered worker runs --schedule-policy priority."""
    assert not cluster.priority_scheduling()  # no worker yet
    await one_pair(cluster, add)
    assert not cluster.priority_scheduling()  # fcfs on both
    add("prefill", "p2", policy="priority")
    await ready(cluster, 3)
    assert cluster.priority_scheduling()


@with_gateway()
async def test_health_needs_a_pair_that_can_hand_kv_over(cluster, add):
    """/health's status: a prefill and a decode pool whose layouts differ (another
    --kv-cache-dtype) serve nothing, every request a 503; a red-team pass saw /health say ok
    (and launch call the cluster ready). A compatible pair, or a colocated worker, serves."""
    from pd_serve.gateway.server import make_routes

    health = next(r.handler for r in make_routes(cluster) if r.path == "/health")

    async def status() -> tuple[int, str]:
        resp = await health(None)
        return resp.status, json.loads(resp.body)["status"]

    assert await status() == (503, "no workers")
    add("prefill", "p")
    add("decode", "d8", layout={**LAYOUT, "dtype": "float8_e4m3fn"})
    await ready(cluster, 2)
    code, why = await status()
    assert code == 503 and why.startswith("no prefill worker can send KV to any decode worker: "
                                          "KV layouts differ"), why
    add("colocated", "c")  # (requests still go to the pools: no help)
    await ready(cluster, 3)
    assert (await status())[0] == 503
    add("decode", "d")
    await ready(cluster, 4)
    assert await status() == (200, "ok")


@with_gateway(max_queued_requests=2)
async def test_a_full_queue_answers_429_with_retry_after(cluster, add):
    _, tasks = await held_then_queued(cluster, add, 2)
    refused = await collect(cluster, spec("r3"))
    assert refused[-1].status == 429 and refused[-1].retry_after and "queue is full" in refused[-1].error
    # counted as rejected, not among finished requests (as a 429 at the outstanding limit is)
    assert cluster.metrics.rejected.labels(reason="queue_full")._value.get() == 1
    assert cluster.metrics.requests.labels(finish_reason="error")._value.get() == 0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await until(lambda: not cluster._flights)


@with_gateway(max_queued_requests=2)
async def test_requests_whose_clients_left_hold_no_place_in_the_queue(cluster, add):
    """"g" left while queued behind "r1", which waits for decode's only slot: "late" queues in
    its place (no 429), and the queue counts only the requests still waiting."""
    _, tasks = await held_then_queued(cluster, add, 1)
    gone = asyncio.create_task(collect(cluster, spec("g")))
    await until(lambda: cluster.num_queued == 2)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert cluster.num_queued == 1
    late = asyncio.create_task(collect(cluster, spec("late")))
    await until(lambda: cluster.num_queued == 2)
    assert not late.done()
    for t in tasks + [late]:
        t.cancel()
    await asyncio.gather(*tasks, late, return_exceptions=True)
    await until(lambda: not cluster._flights)


@with_gateway(max_queued_requests=8)
async def test_entries_of_requests_that_left_the_queue_are_dropped_at_once_past_half_of_it(
        cluster, add):
    """Six queued behind "r" (decode's only slot), four leave behind the head ("r1"): the heap
    keeps their entries while they are at most half of it, then drops them all at once; the
    two still waiting get the slot in their order."""
    _, tasks = await held_then_queued(cluster, add, 6)
    held, waiting = tasks[0], tasks[1:]
    for n, i in enumerate((1, 2, 4, 5), 1):
        waiting[i].cancel()
        await asyncio.gather(waiting[i], return_exceptions=True)
        assert cluster.num_queued == 6 - n
        assert len(cluster._queue) == (6 if n < 4 else 2)
    assert sorted(e.spec.request_id for e in cluster._queue) == ["r1", "r4"]
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    await until(lambda: cluster.num_queued == 1 and "r1" in cluster.workers["d"].inflight)
    for t in (waiting[0], waiting[3]):
        t.cancel()
    await asyncio.gather(waiting[0], waiting[3], return_exceptions=True)
    await until(lambda: not cluster._flights and not cluster._queue)


@with_gateway()
async def test_the_queue_counts_right_when_many_of_its_requests_leave_at_once(cluster, add):
    """Eight queued behind "r" (decode's only slot); six leave at once, as the choices of one
    request whose client left do: the queue counts the two still waiting, and none once they
    are served."""
    decode, _, held = await held_request(cluster, add, max_running=1)
    waiting = await queued(cluster, [spec(f"r{i}") for i in range(1, 9)])
    staying, leaving = waiting[:2], waiting[2:]
    for t in leaving:
        t.cancel()
    await asyncio.gather(*leaving, return_exceptions=True)
    assert cluster.num_queued == 2
    decode.finish = True
    decode.send(TokenBatch("d", [TokenDelta("r", [8], None, True, "length")]))
    await asyncio.gather(held, *staying)
    await until(lambda: not cluster._flights)
    assert cluster.num_queued == 0


@with_gateway()
async def test_a_full_decode_pool_sends_the_request_back_to_wait(cluster, add):
    decode, _ = await one_pair(cluster, add)
    decode.full_replies = 3
    events = await collect(cluster, spec("r"))
    assert not events[-1].error and len(decode.of(Admit)) == 4


@with_gateway()
async def test_impossible_requests_fail_at_once_with_a_clear_status(cluster, add):
    assert (await collect(cluster, spec("none")))[-1].status == 503  # no workers
    await one_pair(cluster, add, num_pages=4)
    start = time.monotonic()
    too_long = (await collect(cluster, spec("long", num_tokens=100)))[-1]
    assert too_long.status == 400 and "largest decode pool holds 4" in too_long.error
    assert time.monotonic() - start < 10


@with_gateway()
async def test_a_failed_prefill_aborts_the_request_on_decode(cluster, add):
    decode, prefill = await one_pair(cluster, add)
    prefill.prefill_ok = False
    events = await collect(cluster, spec("r"))
    assert "prefill failed: boom" in events[-1].error
    await until(lambda: [m.request_id for m in decode.of(AbortRequest)] == ["r"])


@with_gateway()
async def test_a_failed_transfer_goes_to_another_pair_and_its_pair_rests(cluster, add):
    """A transfer that fails (a partition between prefill and one decode, which the control
    plane still sees alive) sends the request, which has no output yet, to another pair; the
    failed pair gets no new request while another pair can take it."""
    d1, prefill = await one_pair(cluster, add)
    prefill.answer_prefill = False
    task = asyncio.create_task(collect(cluster, spec("r")))
    await until(lambda: prefill.of(Prefill))
    d2 = add("decode", "d2")
    d2.address = "tcp://127.0.0.1:2"
    await ready(cluster, 3)
    prefill.unreachable, prefill.answer_prefill = {d1.address}, True
    prefill.send(PrefillDone("r", False, error="KV transfer: no acknowledgement", retryable=True))
    events = await asyncio.wait_for(task, 20)
    assert [t for e in events for t in e.new_token_ids] == [7, 8] and not events[-1].error
    assert prefill.of(Prefill)[1].decode_addresses == [d2.address]
    for i in range(4):
        events = await collect(cluster, spec(f"r{i}"))
        assert events[-1].finished and not events[-1].error
    assert len(d1.of(Admit)) == 1 and len(d2.of(StartDecode)) == 5


@with_gateway(retry_max_retries=2)
async def test_a_pair_whose_transfers_fail_is_tried_again_when_it_is_the_only_one(cluster, add):
    """With no other pair, a resting one still serves (the failure may have passed); a request
    whose transfers keep failing ends with the error after --retry-max-retries."""
    decode, prefill = await one_pair(cluster, add)
    prefill.unreachable = {decode.address}
    events = await collect(cluster, spec("r"))
    assert "KV transfer: no acknowledgement" in events[-1].error
    assert len(prefill.of(Prefill)) == 3  # the first try and two more
    prefill.unreachable = set()
    events = await collect(cluster, spec("r2"))
    assert events[-1].finished and not events[-1].error


@with_gateway()
async def test_a_decode_failure_during_prefill_fails_the_request(cluster, add):
    """An error from any worker of the request ends it, whatever the gateway waits on: here
    decode fails it (as a worker that dropped it while the gateway was silent does) while
    prefill still computes; prefill is told to abort."""
    decode, prefill = await one_pair(cluster, add)
    prefill.answer_prefill = False
    task = asyncio.create_task(collect(cluster, spec("r")))
    await until(lambda: prefill.of(Prefill))
    decode.send(TokenBatch("d", [TokenDelta("r", [], None, True, None, "dropped it")]))
    events = await asyncio.wait_for(task, 20)
    assert "dropped it" in events[-1].error
    await until(lambda: "r" in [m.request_id for m in prefill.of(AbortRequest)])


@with_gateway()
async def test_a_prefill_worker_that_exits_after_its_last_answer_fails_none_of_them(cluster, add):
    """A drained prefill worker sends its last PrefillDone and then WorkerExit, back to back:
    the request it answered is done with it and goes on on decode."""
    decode, prefill = await one_pair(cluster, add)
    prefill.answer_prefill = False
    task = asyncio.create_task(collect(cluster, spec("r")))
    await until(lambda: prefill.of(Prefill))
    prefill.send(PrefillDone("r", True, 7))
    prefill.send(WorkerExit("p", prefill.incarnation, "drained"))
    events = await task
    assert [e.new_token_ids for e in events] == [[7], [8]] and not events[-1].error


@with_gateway(step_timeout_s=1.0)
async def test_step_timeout_counts_a_workers_silence_not_a_requests_wait(cluster, add):
    """A request may wait longer than --step-timeout on a worker whose loop steps on (its turn
    in a queue); a worker whose loop goes silent fails it."""
    decode, _, task = await held_request(cluster, add)
    await asyncio.sleep(3.0)  # three step timeouts, the worker's status coming meanwhile
    assert not task.done()
    decode.stuck = True
    events = await task
    assert "--step-timeout" in events[-1].error and "d" in cluster.workers


@with_gateway(worker_timeout_s=1.0)
async def test_queued_requests_get_503_when_no_pair_is_left(cluster, add):
    prefill, tasks = await held_then_queued(cluster, add, 2)
    await prefill.close()  # silent from now on: dropped after the worker timeout
    events = await asyncio.gather(*tasks[1:])
    assert all(e[-1].status == 503 and "no prefill+decode pair" in e[-1].error for e in events)
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)


@with_gateway(worker_timeout_s=1.0)
async def test_queued_requests_go_to_colocated_workers_when_no_pair_is_left(cluster, add):
    """The pair's prefill worker died with requests queued: a colocated worker serves them
    (the README: without a pair, requests go to colocated workers), no 503."""
    prefill, tasks = await held_then_queued(cluster, add, 2)
    colocated = add("colocated", "c")
    await ready(cluster, 3)
    await prefill.close()  # silent from now on: dropped after the worker timeout
    events = await asyncio.wait_for(asyncio.gather(*tasks[1:]), 20)
    assert all(e[-1].finished and not e[-1].error for e in events), [e[-1] for e in events]
    assert [[t for e in es for t in e.new_token_ids] for es in events] == [[7, 8], [7, 8]]
    assert sorted(m.request_id for m in colocated.of(Generate)) == ["r1~retry1", "r2~retry1"]
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)


async def lose_prefill_mid_request(cluster, add) -> tuple[FakeWorker, asyncio.Task]:
    """Request "r" on prefill "p1", which then goes silent (dropped after the worker timeout)
    while "p2" is registered: the decode worker and the request's collector task."""
    decode, p1 = add("decode", "d"), add("prefill", "p1")
    await ready(cluster, 2)
    p1.answer_prefill = False
    task = asyncio.create_task(collect(cluster, spec("r")))
    await until(lambda: p1.of(Prefill))
    add("prefill", "p2")
    await ready(cluster, 3)
    await p1.close()
    return decode, task


@with_gateway(worker_timeout_s=1.0)
async def test_a_request_that_lost_its_worker_before_its_first_token_goes_again(cluster, add):
    """Its prefill worker died: the request is aborted where it still was (decode's pages) and
    served by the other prefill worker under a new id; the client sees only its tokens."""
    decode, task = await lose_prefill_mid_request(cluster, add)
    events = await asyncio.wait_for(task, 20)
    assert [e.new_token_ids for e in events] == [[7], [8]] and not events[-1].error
    assert [m.request_id for m in decode.of(Admit)] == ["r", "r~retry1"]
    assert [m.request_id for m in decode.of(AbortRequest)] == ["r"]
    assert cluster.metrics.retried._value.get() == 1
    assert not cluster._flights and all(not w.inflight for w in cluster.workers.values())


@with_gateway(worker_timeout_s=1.0)
async def test_a_retried_request_keeps_its_place_in_the_queue(cluster, add):
    """"q" arrived after "r" and waits for decode's only slot, which "r" holds; "r" loses its
    prefill worker and queues again, ahead of "q"."""
    decode, p1 = add("decode", "d", max_running=1), add("prefill", "p1")
    await ready(cluster, 2)
    p1.answer_prefill = False
    first = asyncio.create_task(collect(cluster, spec("r")))
    await until(lambda: p1.of(Prefill))
    later = await queued(cluster, [spec("q")])
    add("prefill", "p2")
    await ready(cluster, 3)
    await p1.close()
    events = await asyncio.wait_for(asyncio.gather(first, *later), 20)
    assert all(not e[-1].error for e in events)
    assert [m.request_id for m in decode.of(Admit)] == ["r", "r~retry1", "q"]


async def lose_decode_mid_request(cluster, add, whole: bool) -> list:
    """Request "r" (`whole` or streamed) gets its first token from prefill, then its decode
    worker "d1" goes silent (dropped after the worker timeout) while "d2" is registered: the
    request's events."""
    d1, _ = await one_pair(cluster, add)
    d1.finish = False
    task = asyncio.create_task(collect(cluster, replace(spec("r"), whole=whole)))
    await until(lambda: d1.of(StartDecode))
    d2 = add("decode", "d2")
    await ready(cluster, 3)
    await d1.close()
    events = await asyncio.wait_for(task, 20)
    assert [m.request_id for m in d2.of(StartDecode)] == (["r~retry1"] if whole else [])
    return events


@with_gateway(worker_timeout_s=1.0)
async def test_a_whole_request_that_lost_its_worker_after_tokens_starts_over(cluster, add):
    """Not streamed, its client has seen nothing: it starts over on the other decode worker,
    and the tokens of the lost attempt are void (a restart event)."""
    events = await lose_decode_mid_request(cluster, add, whole=True)
    assert [(e.new_token_ids, e.restart) for e in events] == [([7], False), ([], True),
                                                               ([7], False), ([8], False)]
    assert not events[-1].error and events[-1].finished
    assert cluster.metrics.retried._value.get() == 1


@with_gateway(worker_timeout_s=1.0)
async def test_a_streamed_request_that_lost_its_worker_after_tokens_fails(cluster, add):
    events = await lose_decode_mid_request(cluster, add, whole=False)
    assert [e.new_token_ids for e in events[:-1]] == [[7]] and not any(e.restart for e in events)
    assert events[-1].status == 500 and "worker d" in events[-1].error


@with_gateway(worker_timeout_s=1.0, retry_max_retries=0)
async def test_with_no_retries_a_lost_worker_fails_the_request(cluster, add):
    decode, task = await lose_prefill_mid_request(cluster, add)
    events = await asyncio.wait_for(task, 20)
    assert events[-1].status == 500 and "worker p1" in events[-1].error  # (unreachable or silent)
    assert [m.request_id for m in decode.of(Admit)] == ["r"]


@with_gateway(worker_timeout_s=60.0)
async def test_a_send_to_a_disconnected_worker_drops_it_at_once(cluster, add):
    """zmq reports an unroutable worker on the send's future: the gateway's next message to
    it (its pings) drops the worker then, long before the 60 s worker timeout."""
    decode, _ = await one_pair(cluster, add)
    await decode.close()
    await until(lambda: "d" not in cluster.workers, timeout=40.0)
    events = await collect(cluster, spec("r"))
    assert events[-1].status == 503 and "no workers" in events[-1].error


@with_gateway()
async def test_a_restarted_worker_fails_its_old_requests_at_once(cluster, add):
    decode, _, task = await held_request(cluster, add)
    start = time.monotonic()
    decode.incarnation = "two"
    decode.send(decode.status())
    events = await task
    assert "restarted" in events[-1].error and time.monotonic() - start < 5


@with_gateway()
async def test_queued_requests_wait_through_a_worker_restart(cluster, add):
    """The only prefill worker restarts (a new incarnation under its id) while requests wait
    in the queue: they wait on and the new process serves them (no 503 for the instant the
    pool was empty)."""
    decode, prefill, held = await held_request(cluster, add, max_running=1)
    waiting = await queued(cluster, [spec("r1"), spec("r2")])
    prefill.incarnation, prefill.seq = "two", 0
    prefill.send(prefill.status())
    await until(lambda: cluster.workers["p"].status.incarnation == "two")
    decode.finish = True
    held.cancel()  # "r" frees decode's only slot
    await asyncio.gather(held, return_exceptions=True)
    events = await asyncio.wait_for(asyncio.gather(*waiting), 20)
    assert all(not e[-1].error for e in events), [e[-1].error for e in events]
    assert [m.request_id for m in prefill.of(Prefill)] == ["r", "r1", "r2"]


@with_gateway()
async def test_pings_list_each_workers_requests(cluster, add):
    decode, _ = await one_pair(cluster, add)
    decode.finish = False
    task = asyncio.create_task(collect(cluster, spec("r")))
    await until(lambda: any("r" in p.request_ids for p in decode.of(GatewayPing)))
    ping = decode.of(GatewayPing)[-1]
    assert ping.gateway_id == cluster.gateway_id and ping.timeout_s == 5.0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await until(lambda: "r" in [m.request_id for m in decode.of(AbortRequest)])


@with_gateway()
async def test_a_flight_whose_consumer_ended_is_reaped(cluster, add):
    decode, _ = await one_pair(cluster, add)
    decode.finish = False
    stream = cluster.generate(spec("r"))

    async def first_event():  # reads one event, then ends without closing the stream
        return await stream.__anext__()
    await asyncio.create_task(first_event())
    await until(lambda: not cluster._flights)
    await until(lambda: "r" in [m.request_id for m in decode.of(AbortRequest)])
    await stream.aclose()


def _hostile_messages(key: bytes) -> list[tuple[bytes, list[bytes]]]:
    """(identity, frames) a broken or hostile peer sends the control port; each is refused."""
    keyed, plain = protocol.Codec(key), protocol.Codec()
    status = dict(worker_id="evil", role="decode", model="m", layout=LAYOUT)
    return [
        (b"evil", [b"\x00" * 8]),
        (b"evil", [b"a", b"b"]),
        (b"evil", [b""]),
        (b"evil", [plain.encode(WorkerStatus(**status))]),  # without the key
        (b"evil", [keyed.encode(WorkerStatus(**{**status, "role": ["decode"]}))]),
        (b"evil", [keyed.encode(WorkerStatus(**{**status, "layout": {"num_layers": "x"}}))]),
        (b"evil", [keyed.encode(WorkerStatus(**{**status, "layout": 5}))]),
        (b"evil", [keyed.encode(TokenBatch("evil", [[]]))]),
        (b"evil", [keyed.encode(TokenBatch("evil", [5]))]),
        (b"evil", [keyed.encode(TokenBatch("evil", [[["r"], [1], None, True, None, ""]]))]),
        (b"evil", [keyed.encode(AdmitReply({"id": 1}, True))]),
        (b"evil", [keyed.encode(PrefillDone(["r"], True))]),
        (b"evil", [plain.encode(WorkerStatus(**{**status, "worker_id": "d"}))]),  # another's id
        # a registered worker's messages from a connection not its own
        (b"evil", [keyed.encode(TokenBatch("d", [TokenDelta("r", [1], None, True)]))]),
        (b"d", [keyed.encode(TokenBatch("d", [TokenDelta("r", [1], None, True)]))]),
    ]


@with_gateway(max_queued_requests=3, max_outstanding_requests=5)
async def test_a_request_has_at_most_as_many_choices_as_the_queue_holds(cluster, add):
    assert cluster.max_choices() == 3  # (each choice queues as a request of its own)


@with_gateway()
async def test_a_status_sent_again_from_another_connection_moves_nothing(cluster, add):
    """A peer that recorded a worker's keyed status off the wire sends it from a connection of
    its own: it is no newer than the last, so it is refused, not taken for a reconnect (which
    would route the worker's requests to the peer); the worker serves on."""
    decode, _ = await one_pair(cluster, add)
    route, before = cluster.workers["d"].route, _errors("control")
    peer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    protocol.secure_control(peer, KEY, server=False)  # (the wire is encrypted: a key holder)
    peer.connect(cluster.control_address)
    try:
        await peer.send(decode.last_status)
        await until(lambda: _errors("control") > before)
        assert cluster.workers["d"].route == route
        assert not (await collect(cluster, spec("r")))[-1].error and decode.of(StartDecode)
    finally:
        peer.close()


@with_gateway(worker_timeout_s=1.0)
async def test_a_heartbeat_sent_again_cannot_keep_a_hung_worker_registered(cluster, add):
    """A peer that recorded a worker's keyed heartbeat off the wire sends it again and again,
    from a connection of its own, after the worker hung: each is no newer than the last beat
    heard, so it is refused, and the worker is dropped at --worker-timeout as if alone."""
    decode, _ = await one_pair(cluster, add)
    decode.stuck = True  # heartbeats only
    await until(lambda: cluster.workers["d"].beat_seq >= 2)
    decode._task.cancel()  # hung
    peer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    protocol.secure_control(peer, KEY, server=False)  # (the wire is encrypted: a key holder)
    peer.connect(cluster.control_address)
    before = _errors("control")
    try:
        async def replay():
            while True:
                await peer.send(decode.last_beat)
                await asyncio.sleep(0.1)
        replaying = asyncio.create_task(replay())
        await until(lambda: "d" not in cluster.workers)
        assert _errors("control") > before
        replaying.cancel()
    finally:
        peer.close()


@with_gateway()
async def test_a_peer_squatting_a_worker_id_cannot_keep_the_worker_out(cluster, add):
    """A peer connects first under a worker's id as its ZMQ identity (the gateway routed by
    worker id, so the worker's own connection was never heard, for good); the gateway's
    routing ids are its own, so the worker registers and serves. Without the key the peer
    does not get past the handshake: its message never arrives; with it, it is refused."""
    squatters = []
    for key in (b"", KEY):
        before = _errors("control")
        squatter = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        squatter.setsockopt(zmq.IDENTITY, b"d")
        squatter.setsockopt(zmq.LINGER, 0)
        protocol.secure_control(squatter, key, server=False)
        squatter.connect(cluster.control_address)
        squatters.append(squatter)
        await squatter.send(b"junk")
        if key:
            await until(lambda: _errors("control") > before)
        else:
            await asyncio.sleep(1.0)
            assert _errors("control") == before
    try:
        await one_pair(cluster, add)
        assert not (await collect(cluster, spec("r")))[-1].error
    finally:
        for squatter in squatters:
            squatter.close()


@with_gateway()
async def test_a_worker_restarted_under_its_id_takes_over_from_a_hung_one(cluster, add):
    """A replacement under the same worker id (a new incarnation) registers while the old
    process, hung, still holds its connection; when the old one wakes, its messages are
    refused and it is told it was replaced (so it exits), and requests go to the new one."""
    old, _ = await one_pair(cluster, add)
    old._task.cancel()  # hung: silent, its connection open
    new = add("decode", "d", incarnation="two")
    await until(lambda: "d" in cluster.workers and cluster.workers["d"].status.incarnation == "two")
    before = _errors("control")
    old.send(old.status())  # the old process wakes up, on its own connection
    await until(lambda: _errors("control") > before)
    assert cluster.workers["d"].status.incarnation == "two"
    told = await replaced_told(old)
    assert (told.worker_id, told.incarnation) == ("d", "one")
    assert not new.of(Replaced)
    assert not (await collect(cluster, spec("r")))[-1].error
    assert new.of(StartDecode) and not old.of(StartDecode)


@with_gateway(worker_timeout_s=1.0)
async def test_a_hung_worker_dropped_before_its_replacement_came_cannot_take_over(cluster, add):
    """The old process hangs past the worker timeout (dropped), then the replacement registers
    under its id; when the old one wakes it is refused and told it was replaced, and the new
    one keeps the id (not taken for a restart of the new one)."""
    old, _ = await one_pair(cluster, add)
    old._task.cancel()  # hung: silent, its connection open
    await until(lambda: "d" not in cluster.workers)
    new = add("decode", "d", incarnation="two")
    await until(lambda: "d" in cluster.workers)
    old.send(old.status())  # the old process wakes up
    told = await replaced_told(old)
    assert cluster.workers["d"].status.incarnation == "two" and not new.of(Replaced)
    assert not (await collect(cluster, spec("r")))[-1].error
    assert new.of(StartDecode)


@with_gateway()
async def test_a_worker_on_a_new_connection_is_served_there(cluster, add):
    """The same process (incarnation) registering from a new connection, as after a reconnect,
    moves the worker to it."""
    first, _ = await one_pair(cluster, add)
    first._task.cancel()  # its old connection stays open, silent
    route = cluster.workers["d"].route
    second = add("decode", "d")
    second.seq = first.seq + 1  # the same process: its statuses count on
    await until(lambda: cluster.workers["d"].route != route)
    assert not (await collect(cluster, spec("r")))[-1].error
    assert second.of(StartDecode) and not first.of(StartDecode)


@with_gateway()
async def test_a_worker_that_reconnects_ends_what_it_held(cluster, add):
    """A worker whose control connection broke (a reset, a TCP timeout after a partition) is
    connected again by zmq, on a new connection: what was in flight on the old one, either way,
    is lost (here: the request's last tokens). Its requests end with an error (or go again,
    before output) at once, instead of waiting for messages that never come while the worker's
    statuses keep it looking alive; the worker serves on from the new connection."""
    first, _, task = await held_request(cluster, add)
    await first.close()  # the old connection is gone, with what was on it
    second = add("decode", "d")
    second.seq = first.seq + 1  # the same process (incarnation): its statuses count on
    events = await asyncio.wait_for(task, 20)
    assert events[-1].finished and "reconnected" in events[-1].error
    await until(lambda: any(not p.request_ids for p in second.of(GatewayPing)))
    assert not (await collect(cluster, spec("r2")))[-1].error and second.of(StartDecode)


@with_gateway()
async def test_a_large_message_is_decoded_off_the_event_loop_and_in_order(cluster, add):
    """A message past THREAD_DECODE_BYTES (here a row of 6,000 tokens with top-20 logprobs) is
    decoded in a worker thread, not on the loop that serves HTTP, and the small message sent
    right after it is handled after it."""
    decode, _, task = await held_request(cluster, add)
    threads = []
    receive = cluster.codec.receive

    def recording_receive(data, *args):
        threads.append((len(data), threading.get_ident()))
        return receive(data, *args)

    cluster.codec.receive = recording_receive
    loop_thread = threading.get_ident()
    rows = [protocol.Logprob(8, -0.5, [(t, -1.0 - t / 100) for t in range(20)]) for _ in range(6000)]
    decode.send(TokenBatch("d", [TokenDelta("r", [8] * 6000, rows)]))
    decode.send(TokenBatch("d", [TokenDelta("r", [9], None, True, "length")]))
    events = await asyncio.wait_for(task, 20)
    big = [t for size, t in threads if size > cluster_module.THREAD_DECODE_BYTES]
    assert len(big) == 1 and big[0] != loop_thread
    assert all(t == loop_thread for size, t in threads if size <= cluster_module.THREAD_DECODE_BYTES)
    tokens = [e.new_token_ids for e in events]
    assert tokens[-2:] == [[8] * 6000, [9]] and events[-1].finished
    assert events[-2].logprobs[0].top[19] == (19, -1.19)


@with_gateway()
async def test_hostile_control_messages_are_refused_and_the_gateway_serves_on(cluster, add):
    await one_pair(cluster, add)
    before = _errors("control")
    ctx = zmq.asyncio.Context.instance()
    rogues = {}
    messages = _hostile_messages(KEY)
    for identity, frames in messages:
        if identity not in rogues:
            rogues[identity] = ctx.socket(zmq.DEALER)
            rogues[identity].setsockopt(zmq.IDENTITY, identity)
            rogues[identity].setsockopt(zmq.LINGER, 0)
            protocol.secure_control(rogues[identity], KEY, server=False)  # (past the handshake)
            rogues[identity].connect(cluster.control_address)
        await rogues[identity].send_multipart(frames)
    host, port = cluster.control_address.removeprefix("tcp://").split(":")
    raw = socket.create_connection((host, int(port)))
    raw.sendall(b"\x01\x02\x03\x04\x05\x06\x07\x08")  # not even zmq
    await until(lambda: _errors("control") - before >= len(messages))
    raw.close()
    for rogue in rogues.values():
        rogue.close()
    assert sorted(cluster.workers) == ["d", "p"] and not cluster.dead.is_set()
    assert not (await collect(cluster, spec("after")))[-1].error


def _errors(sock: str) -> float:
    return protocol.PROTOCOL_ERRORS.labels(socket=sock)._value.get()


@pytest.mark.parametrize("bad", [
    ("TokenBatch", {"worker_id": "d", "items": [[]]}),
    ("AbortRequest", {"request_id": ["r"]}),
    ("WorkerStatus", {"worker_id": "w", "role": "decode", "model": "m", "tp": "2"}),
    ("Admit", {"request_id": "r", "prompt_token_ids": [1, "2"], "sampling": {}}),
    ("KVChunks", {"chunks": [{"request_id": ["r"]}], "frames": [1]}),
    ("TransferAcks", {"acks": [["r", "yes", ""]]}),
])
def test_ill_typed_messages_do_not_decode(bad):
    import msgpack
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(msgpack.packb(list(bad)))


def test_the_cluster_key_tag_is_checked():
    msg = AbortRequest("r")
    assert protocol.Codec(KEY).decode(protocol.Codec(KEY).encode(msg)) == msg
    for data in (protocol.encode(msg), protocol.Codec(b"other").encode(msg)):
        with pytest.raises(protocol.ProtocolError, match="cluster-key"):
            protocol.Codec(KEY).decode(data)


class ThreadWorker:
    """A worker in a thread of its own (a sync socket): it keeps sending its status every
    0.2 s while the gateway's event loop is held up, as a worker process does."""

    def __init__(self, cluster: Cluster, role: str, worker_id: str):
        self.role, self.worker_id, self.incarnation, self.seq = role, worker_id, "one", 0
        self.layout, self.long_prefill, self.policy = LAYOUT, 0, "fcfs"
        self.max_running, self.num_pages, self.address = 8, 64, "tcp://127.0.0.1:1"
        self.codec, self.stop = protocol.Codec(KEY), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(cluster.control_address,))
        self.thread.start()

    def status(self) -> WorkerStatus:
        return FakeWorker.status(self)  # (its fields are here too)

    def _run(self, address: str) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        protocol.secure_control(sock, KEY, server=False)
        sock.connect(address)
        while not self.stop.wait(0.2):
            sock.send(self.codec.encode(self.status()))
            while sock.poll(0):
                sock.recv()
        sock.close()


@with_gateway(worker_timeout_s=2.0)
async def test_a_gateway_held_up_past_the_worker_timeout_keeps_its_workers(cluster, add):
    """The gateway's own loop held up (a paused process, a starved VM) past --worker-timeout
    while its workers kept talking: their messages of that time wait unread, so it keeps
    them, also while it works through them one thread-decoded message at a time (it dropped
    them, failing every request: a red-team pass). A worker gone silent is still dropped."""
    from pd_serve.gateway import cluster as cluster_module

    dropped, drop = [], cluster._drop
    cluster._drop = lambda worker_id, *a, **kw: (dropped.append(worker_id), drop(worker_id, *a, **kw))
    saved, cluster_module.THREAD_DECODE_BYTES = cluster_module.THREAD_DECODE_BYTES, 0
    workers = [ThreadWorker(cluster, "decode", "d"), ThreadWorker(cluster, "prefill", "p")]
    try:
        await ready(cluster, 2)
        time.sleep(5.0)  # the gateway's loop stops; the workers go on
        await asyncio.sleep(2.5)
        assert set(cluster.workers) == {"d", "p"} and not dropped
        workers[0].stop.set()  # then gone for real: dropped after the timeout
        await until(lambda: "d" not in cluster.workers, 10)
        assert dropped == ["d"]
    finally:
        cluster_module.THREAD_DECODE_BYTES = saved
        for w in workers:
            w.stop.set()
            w.thread.join(10)


@with_gateway()
async def test_a_peer_without_the_key_gets_nothing_buffered(cluster, add):
    """With a cluster key the control socket speaks CURVE under a key pair derived from it: a
    peer without the key (or with another) fails the handshake, so its message of many
    frames, each under the frame cap, never reaches the gateway, which zmq would otherwise
    have taken whole, all its frames buffered, before any tag could be checked (a red-team
    pass: 16 x 64 MiB); a key holder's such message is refused after it arrives."""
    before = _errors("control")
    peers = []
    for key in (b"", b"another key, sixteen bytes long"):
        peer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        protocol.secure_control(peer, key, server=False)
        peer.connect(cluster.control_address)
        peers.append(peer)
        await peer.send_multipart([b"x" * 2**20] * 8)
    await asyncio.sleep(1.5)
    assert _errors("control") == before
    holder = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    holder.setsockopt(zmq.LINGER, 0)
    protocol.secure_control(holder, KEY, server=False)
    holder.connect(cluster.control_address)
    peers.append(holder)
    try:
        await holder.send_multipart([b"x" * 2**20] * 8)
        await until(lambda: _errors("control") == before + 1)
        await one_pair(cluster, add)
        assert not (await collect(cluster, spec("r")))[-1].error
    finally:
        for peer in peers:
            peer.close()
