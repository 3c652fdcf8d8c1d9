"""The gateway's cluster: worker registry and health, and each request's trip through the pools.

Per request (DESIGN.md's lifecycle): decode admits first (reserves pages) -> prefill computes,
samples token 1 and sends the KV -> decode continues from token 1 and streams. With no complete
prefill+decode set registered, requests go to colocated workers. Every wait has a timeout; a
worker that stops heartbeating is dropped and its requests end with an error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import zmq
import zmq.asyncio

from pd_serve import protocol
from pd_serve.cache.pool import KVLayout
from pd_serve.gateway.metrics import GatewayMetrics
from pd_serve.gateway.router import Router, WorkerState
from pd_serve.gateway.source import GenerateSpec, TokenEvent, TokenSource
from pd_serve.protocol import (AbortRequest, Admit, AdmitReply, Generate, Heartbeat, Prefill,
                               PrefillDone, StartDecode, TokenBatch, WorkerStatus)
from pd_serve.transfer.base import layout_mismatch
from pd_serve.transfer.heads import tp_error

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    control_host: str = "127.0.0.1"
    control_port: int = 0  # 0: any free port
    served_model_name: str = "default"
    prefill_policy: str = "least_load"
    decode_policy: str = "least_load"
    worker_timeout_s: float = 10.0  # no heartbeat for this long: the worker is gone
    admit_timeout_s: float = 60.0  # how long a request may wait for decode capacity
    step_timeout_s: float = 120.0  # longest silence from a worker on a live request
    max_outstanding_requests: int = 4096


class ClusterError(Exception):
    """A request the cluster cannot serve (no workers, no capacity)."""


def pair_error(prefill: WorkerStatus, decode: WorkerStatus) -> str:
    """Why this prefill worker cannot hand KV to this decode worker ("" if it can): the same
    model KV layout and transfer backend, and TP sizes the model's KV heads allow (any two do:
    each decode rank receives its heads from the prefill ranks holding them)."""
    if prefill.transfer_backend != decode.transfer_backend:
        return (f"transfer backends differ ({prefill.transfer_backend} vs "
                f"{decode.transfer_backend}): start both with the same --transfer-backend")
    if diff := layout_mismatch(KVLayout(**decode.layout), prefill.layout):
        return f"KV layouts differ (prefill vs decode): {diff}"
    heads = decode.layout.get("num_kv_heads", 0)
    for name, status in (("prefill", prefill), ("decode", decode)):
        if error := tp_error(status.tp, heads):
            return f"{name} --tp: {error}"
    if len(decode.transfer_addresses) != decode.tp:
        return f"decode reports {len(decode.transfer_addresses)} KV receivers for --tp {decode.tp}"
    return ""


@dataclass
class _Flight:
    """One request's mailbox and the workers it is on."""

    queue: asyncio.Queue
    workers: list[str] = field(default_factory=list)


class Cluster(TokenSource):
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = GatewayMetrics()
        self.workers: dict[str, WorkerState] = {}
        self.routers = {"prefill": Router(config.prefill_policy, "prefill"),
                        "decode": Router(config.decode_policy, "decode"),
                        "colocated": Router("least_load", "decode")}
        self._flights: dict[str, _Flight] = {}
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if config.control_port:
            self._sock.bind(f"tcp://{config.control_host}:{config.control_port}")
            port = config.control_port
        else:
            port = self._sock.bind_to_random_port(f"tcp://{config.control_host}")
        self.control_address = f"tcp://{config.control_host}:{port}"
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._reap())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._sock.close()

    def model_name(self) -> str:
        return self.config.served_model_name

    def max_model_len(self) -> int | None:
        lens = [w.status.max_model_len for w in self.workers.values()]
        return min(lens) if lens else None

    def pool(self, role: str) -> list[WorkerState]:
        return sorted((w for w in self.workers.values() if w.status.role == role),
                      key=lambda w: w.worker_id)

    # ---- one request ------------------------------------------------------------------------
    async def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenEvent]:
        rid = spec.request_id
        if len(self._flights) >= self.config.max_outstanding_requests:
            yield TokenEvent([], finished=True, error="gateway at --max-outstanding-requests")
            return
        flight = self._flights[rid] = _Flight(asyncio.Queue(maxsize=spec.params.max_tokens + 16))
        timer = _Timer(self.metrics)
        finished = False
        try:
            run = self._disaggregated if self.pool("prefill") and self.pool("decode") else self._colocated
            async for event in run(spec, flight, timer):
                finished = event.finished
                if finished:
                    event.timings = timer.timings()
                    self.metrics.finished(event.finish_reason or ("error" if event.error else "abort"))
                yield event
        except ClusterError as e:
            finished = True
            self.metrics.finished("error")
            yield TokenEvent([], finished=True, error=str(e))
        finally:
            del self._flights[rid]
            for worker_id in flight.workers:
                state = self.workers.get(worker_id)
                if state is not None:
                    state.inflight.pop(rid, None)
                    if not finished:
                        self._send(worker_id, AbortRequest(rid))

    async def _disaggregated(self, spec, flight, timer) -> AsyncIterator[TokenEvent]:
        sampling = dataclasses.asdict(spec.params)
        estimate = len(spec.prompt_token_ids) + spec.params.max_tokens
        decode, reply = await self._admit(spec, flight, sampling, estimate)
        timer.mark("queue")
        prefill = self._pick_prefill(spec, decode)
        self._enlist(flight, prefill, spec.request_id, len(spec.prompt_token_ids))
        self._send(prefill.worker_id, Prefill(spec.request_id, spec.prompt_token_ids, sampling,
                                              reply.transfer_addresses, reply.dst_page_ids, spec.priority))
        done = await self._next(flight, PrefillDone)
        prefill.inflight.pop(spec.request_id, None)
        flight.workers.remove(prefill.worker_id)
        if not done.ok:
            raise ClusterError(f"prefill failed: {done.error}")
        timer.prefill_timings = done.timings
        timer.tokens(1)
        self._send(decode.worker_id, StartDecode(spec.request_id, done.first_token_id, done.logprob))
        yield TokenEvent([done.first_token_id], None if done.logprob is None else [done.logprob])
        async for event in self._stream(flight, timer):
            yield event

    async def _colocated(self, spec, flight, timer) -> AsyncIterator[TokenEvent]:
        workers = self.pool("colocated")
        if not workers:
            raise ClusterError("no workers: need a prefill and a decode worker, or a colocated one")
        worker = self.routers["colocated"].pick(workers, spec.prompt_token_ids)
        self._enlist(flight, worker, spec.request_id, len(spec.prompt_token_ids) + spec.params.max_tokens)
        self._send(worker.worker_id, Generate(spec.request_id, spec.prompt_token_ids,
                                              dataclasses.asdict(spec.params), spec.priority))
        timer.mark("queue")
        async for event in self._stream(flight, timer):
            yield event

    async def _admit(self, spec, flight, sampling, estimate) -> tuple[WorkerState, AdmitReply]:
        """Ask decode workers for pages until one says yes; full pools are retried, bounded."""
        deadline = time.monotonic() + self.config.admit_timeout_s
        while True:
            workers = self.pool("decode")
            if not workers:
                raise ClusterError("no decode worker is registered")
            decode = self.routers["decode"].pick(workers, spec.prompt_token_ids)
            self._enlist(flight, decode, spec.request_id, estimate)
            self._send(decode.worker_id, Admit(spec.request_id, spec.prompt_token_ids, sampling,
                                               spec.priority))
            reply = await self._next(flight, AdmitReply)
            if reply.ok:
                return decode, reply
            decode.inflight.pop(spec.request_id, None)
            flight.workers.remove(decode.worker_id)
            if not reply.retryable:
                raise ClusterError(reply.error)
            if time.monotonic() > deadline:
                raise ClusterError(f"no decode capacity within {self.config.admit_timeout_s} s "
                                   f"({reply.error})")
            await asyncio.sleep(0.02)

    def _pick_prefill(self, spec, decode: WorkerState) -> WorkerState:
        prefills = self.pool("prefill")
        ok = [p for p in prefills if not pair_error(p.status, decode.status)]
        if not ok:
            why = "; ".join(f"{p.worker_id}: {pair_error(p.status, decode.status)}" for p in prefills)
            raise ClusterError(f"no prefill worker can send KV to decode {decode.worker_id} ({why})")
        return self.routers["prefill"].pick(ok, spec.prompt_token_ids)

    async def _stream(self, flight, timer) -> AsyncIterator[TokenEvent]:
        while True:
            item = await self._next(flight, list)
            rid, token_ids, logprobs, finished, reason, error = item
            if token_ids:
                timer.tokens(len(token_ids))
            if error:
                raise ClusterError(error)
            yield TokenEvent(token_ids, logprobs, finished, reason)
            if finished:
                return

    async def _next(self, flight: _Flight, kind):
        """The request's next message of `kind`; a worker failure arrives as an exception."""
        while True:
            try:
                msg = await asyncio.wait_for(flight.queue.get(), self.config.step_timeout_s)
            except asyncio.TimeoutError:
                raise ClusterError(f"no answer from {', '.join(flight.workers)} within "
                                   f"{self.config.step_timeout_s} s") from None
            if isinstance(msg, ClusterError):
                raise msg
            if isinstance(msg, kind):
                return msg

    def _enlist(self, flight: _Flight, worker: WorkerState, rid: str, tokens: int) -> None:
        flight.workers.append(worker.worker_id)
        worker.inflight[rid] = tokens

    # ---- control socket ----------------------------------------------------------------------
    def _send(self, worker_id: str, msg) -> None:
        try:
            self._sock.send_multipart([worker_id.encode(), protocol.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # unroutable: the worker is gone
            logger.warning("cannot reach %s: %s", worker_id, e)
            self._drop(worker_id, f"worker {worker_id} unreachable")

    async def _receive(self) -> None:
        while True:
            identity, data = await self._sock.recv_multipart()
            try:
                msg = protocol.decode(data)
            except ValueError as e:
                logger.warning("dropped a message from %r: %s", identity, e)
                continue
            worker_id = msg.worker_id if isinstance(msg, Heartbeat) else identity.decode()
            state = self.workers.get(worker_id)
            if isinstance(msg, WorkerStatus):
                if state is None:
                    logger.info("registered %s worker %s (tp %d)", msg.role, worker_id, msg.tp)
                    self.workers[worker_id] = state = WorkerState(msg)
                    self._check_pairs(msg)
                state.status = msg
            if state is not None:
                state.last_seen = time.monotonic()
            if isinstance(msg, TokenBatch):
                for item in msg.items:
                    self._deliver(item[0], item)
            elif isinstance(msg, (AdmitReply, PrefillDone)):
                self._deliver(msg.request_id, msg)

    def _check_pairs(self, status: WorkerStatus) -> None:
        """At registration: say which workers of the other phase this one cannot pair with."""
        other = {"prefill": "decode", "decode": "prefill"}.get(status.role)
        for peer in self.pool(other) if other else []:
            pair = (status, peer.status) if status.role == "prefill" else (peer.status, status)
            if error := pair_error(*pair):
                logger.error("prefill %s cannot send KV to decode %s: %s", pair[0].worker_id,
                             pair[1].worker_id, error)

    def _deliver(self, rid: str, msg) -> None:
        flight = self._flights.get(rid)
        if flight is not None:
            try:
                flight.queue.put_nowait(msg)
            except asyncio.QueueFull:
                logger.warning("request %s: mailbox full, dropping a message", rid)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.config.worker_timeout_s / 4))
            cutoff = time.monotonic() - self.config.worker_timeout_s
            for worker_id in [w for w, s in self.workers.items() if s.last_seen < cutoff]:
                self._drop(worker_id, f"worker {worker_id} stopped responding")

    def _drop(self, worker_id: str, reason: str) -> None:
        state = self.workers.pop(worker_id, None)
        if state is None:
            return
        logger.warning("%s; failing its %d requests", reason, len(state.inflight))
        for rid in state.inflight:
            flight = self._flights.get(rid)
            if flight is not None:
                flight.queue.put_nowait(ClusterError(reason))


class _Timer:
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
