"""The gateway's cluster: worker registry and health, and each request's trip through the pools.

Per request (DESIGN.md's lifecycle): decode admits first (reserves pages) -> prefill computes,
samples token 1 and sends the KV -> decode continues from token 1 and streams. With no complete
prefill+decode set registered, requests go to colocated workers. Every wait has a timeout; a
worker that stops heartbeating is dropped and its requests end with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import zmq
import zmq.asyncio

from pd_serve import protocol
from pd_serve.cache.pool import pages_for
from pd_serve.config import GatewayConfig
from pd_serve.gateway.metrics import GatewayMetrics, RequestTimer
from pd_serve.gateway.router import Router, WorkerState, pair_error, status_error
from pd_serve.gateway.source import GenerateSpec, TokenEvent, TokenSource
from pd_serve.ports import bind_zmq
from pd_serve.protocol import (AbortRequest, Admit, AdmitReply, GatewayPing, Generate, Heartbeat,
                               Prefill, PrefillDone, Replaced, StartDecode, TokenBatch, TokenDelta,
                               WorkerExit, WorkerStatus)

logger = logging.getLogger(__name__)
CONTROL_MAX_BYTES = 64 * 2**20  # largest control message (a 128k-token prompt is ~1 MiB)
# a message past this is decoded in a worker thread: a PrefillDone with an 8k-token prompt's
# top-20 logprobs is ~4 MiB and 0.3 s of msgpack and type checks, which on the event loop
# stalled every stream and /health
THREAD_DECODE_BYTES = 2**20
FULL_BACKOFF_S = 0.05  # a decode worker whose pool was full gets no new request for this long
# A prefill+decode pair whose KV transfer failed (a partition between them, a stalled decode the
# control plane still sees alive) gets no new request for this long while another pair can
# take it; the request itself goes again, on another pair if there is one.
TRANSFER_BACKOFF_S = 10.0
DISPATCH_TICK_S = 0.05
SILENCE_CHECK_S = 5.0  # how often a waiting request looks whether its workers still step


class ClusterError(Exception):
    """A request the cluster cannot serve, with the HTTP status it maps to: 400 (it can never
    fit), 429 (the queue is full), 503 (no workers or no capacity in time), 500 (a worker
    failed). worker_lost: a worker of the request left the cluster, or its KV did not reach
    decode (the request may go again on others). rejected: refused before it ran, counted in
    pd_serve:requests_rejected, not among finished requests."""

    def __init__(self, message: str, status: int = 500, retry_after: float | None = None,
                 worker_lost: bool = False, rejected: bool = False):
        super().__init__(message)
        self.status, self.retry_after, self.worker_lost = status, retry_after, worker_lost
        self.rejected = rejected


@dataclass
class _Flight:
    """One request's mailbox, the workers it is on, and the task consuming it."""

    queue: asyncio.Queue
    task: asyncio.Task | None
    workers: list[str] = field(default_factory=list)
    error: ClusterError | None = None  # a worker it was on failed
    arrival: int | None = None  # its place among equal priorities in the queue, kept by a retry

    def fail(self, error: ClusterError) -> None:
        self.error = error
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(error)  # wakes the consumer (a full mailbox wakes it anyway)


@dataclass(order=True)
class _Waiting:
    """A request in the gateway's queue: served by priority (lower first), then arrival."""

    priority: int
    seq: int
    spec: GenerateSpec = field(compare=False)
    pair: asyncio.Future = field(compare=False)  # -> (decode, prefill) WorkerStates


class Cluster(TokenSource):
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = GatewayMetrics()
        self.gateway_id = secrets.token_hex(8)  # this incarnation; workers drop what others sent
        self.codec = protocol.Codec(config.cluster_key)
        self.workers: dict[str, WorkerState] = {}
        # incarnations (process runs) that a newer one under the same worker id replaced: a
        # replaced process that wakes up (it hung) is refused, not taken for another restart
        self._superseded: dict[str, set[str]] = {}
        self._incarnations: dict[str, str] = {}  # worker id -> its last registered incarnation
        self._routes: dict[bytes, str] = {}  # control connection -> the worker registered on it
        balance = (config.balance_abs_threshold, config.balance_rel_threshold)
        self.routers = {"prefill": Router(config.prefill_policy, "prefill", *balance),
                        "decode": Router(config.decode_policy, "decode", *balance),
                        "colocated": Router(config.prefill_policy, "prefill", *balance)}
        self._flights: dict[str, _Flight] = {}
        self._queue: list[_Waiting] = []  # a heap
        # requests waiting in it: counted out once each, by whoever ends the wait (its pair,
        # a failure, or _unqueue); the heap may still hold entries of ones that stopped waiting
        self._num_waiting = 0
        self._seq = itertools.count()
        self._capacity = asyncio.Event()  # set when a queued request may now find a pair
        self._failed_pairs: dict[tuple[str, str], float] = {}  # (prefill, decode) -> back-off end
        self.fatal = ""  # why a background task died: /health reports it, the server exits
        self.dead = asyncio.Event()
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
        protocol.secure_control(self._sock, config.cluster_key, server=True)
        port = bind_zmq(self._sock, config.control_host, config.control_port,
                        ("--control-host", "--control-port"))
        self.control_address = f"tcp://{config.control_host}:{port}"
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._drained_at = time.monotonic()  # when the receive loop last found the socket empty
        self._idle = False  # ... and it waits on it still (_heard_until)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(coro(), name=coro.__name__)
                       for coro in (self._receive, self._reap, self._dispatch)]
        for task in self._tasks:
            task.add_done_callback(self._supervise)

    def _supervise(self, task: asyncio.Task) -> None:
        """A background task must never end while the gateway runs: if one does, say why and
        let the server exit (non-zero) rather than serve as a zombie."""
        if self._stopping:
            return
        error = task.exception() if not task.cancelled() else None
        self.fatal = f"gateway task {task.get_name()} died: {error!r}"
        logger.critical(self.fatal, exc_info=error)
        self.dead.set()

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        self._sock.close()

    def model_name(self) -> str:
        return self.config.served_model_name

    def max_model_len(self) -> int | None:
        lens = [w.status.max_model_len for w in self.workers.values()]
        return min(lens) if lens else None

    def priority_scheduling(self) -> bool:
        """Any registered worker schedules by priority (its queue and the gateway's then both
        honour it)."""
        return any(w.status.schedule_policy == "priority" for w in self.workers.values())

    def max_choices(self) -> int:
        """Each choice queues and flies as a request of its own."""
        return min(self.config.max_queued_requests, self.config.max_outstanding_requests)

    def pool(self, role: str) -> list[WorkerState]:
        """The role's workers that take new requests (a draining one finishes what it has)."""
        return sorted((w for w in self.workers.values()
                       if w.status.role == role and not w.status.draining), key=lambda w: w.worker_id)

    @property
    def num_queued(self) -> int:
        return self._num_waiting

    # ---- one request ------------------------------------------------------------------------
    async def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenEvent]:
        rid = spec.request_id
        if len(self._flights) >= self.config.max_outstanding_requests or rid in self._flights:
            self.metrics.rejected.labels(reason="outstanding").inc()
            yield TokenEvent([], finished=True, status=429, retry_after=1,
                             error=f"gateway at --max-outstanding-requests "
                                   f"({self.config.max_outstanding_requests}); retry later")
            return
        flight = self._flights[rid] = _Flight(asyncio.Queue(maxsize=spec.params.max_tokens + 16),
                                              asyncio.current_task())
        timer = RequestTimer(self.metrics)
        completed = False  # a worker finished it: nothing to abort
        started = False  # a token went out: from here a failure is the client's to see,
        # unless the request is whole (its client sees nothing before the end)
        try:
            for attempt in itertools.count(1):
                try:
                    run = (self._disaggregated if self.pool("prefill") and self.pool("decode")
                           else self._colocated)
                    async for event in run(spec, flight, timer):
                        started = True
                        if event.finished:
                            completed = True
                            event.timings = timer.timings()
                            self.metrics.finished(event.finish_reason or "abort")
                        yield event
                    return
                except ClusterError as e:
                    if ((started and not spec.whole) or not e.worker_lost
                            or attempt > self.config.retry_max_retries):
                        raise
                    logger.warning("request %s: %s before its %s; to the queue again (retry %d "
                                   "of %d)", rid, e, "output was sent" if started else "first token",
                                   attempt, self.config.retry_max_retries)
                    self.metrics.retried.inc()
                    spec = self._again(spec, flight, f"{rid}~retry{attempt}")
                    if started:
                        yield TokenEvent([], restart=True)
                        started = False
        except ClusterError as e:
            if not e.rejected or attempt > 1:  # (refused before it ran: requests_rejected)
                self.metrics.finished("error")
            yield TokenEvent([], finished=True, error=str(e), status=e.status,
                             retry_after=e.retry_after)
        finally:
            self._end(spec.request_id, flight, abort=not completed)

    def closed_early(self, reason: str) -> None:
        self.metrics.finished(reason)

    def _again(self, spec: GenerateSpec, flight: _Flight, rid: str) -> GenerateSpec:
        """The request lost a worker before its first token: abort it on the workers that still
        hold it, and send it again under a new id, so that a late message of the failed attempt
        (a surviving worker's) cannot pass for one of the new attempt. It keeps its place in
        the queue (flight.arrival)."""
        self._end(spec.request_id, flight, abort=True)
        flight.error = None
        while not flight.queue.empty():
            flight.queue.get_nowait()
        self._flights[rid] = flight
        return replace(spec, request_id=rid)

    def _end(self, rid: str, flight: _Flight, abort: bool) -> None:
        """The request is over at the gateway: forget it on every worker, and abort it on those
        still holding it (it failed, or its client left), from this one place."""
        if self._flights.get(rid) is not flight:
            return
        del self._flights[rid]
        for worker_id in flight.workers:
            state = self.workers.get(worker_id)
            if state is not None:
                state.inflight.pop(rid, None)
                if abort:
                    self._send(worker_id, AbortRequest(rid))
        flight.workers.clear()
        self._capacity.set()

    async def _disaggregated(self, spec, flight, timer) -> AsyncIterator[TokenEvent]:
        decode, prefill, reply = await self._admit(spec, flight)
        timer.mark("queue")
        self._send(prefill.worker_id, Prefill(spec.request_id, spec.prompt_token_ids, spec.params,
                                              reply.transfer_addresses, reply.dst_page_ids, spec.priority,
                                              reply.cached_tokens))
        done = await self._next(flight, PrefillDone)  # (prefill has left it: _deliver)
        if not done.ok:
            if done.retryable:  # the KV did not arrive: this pair rests, the request goes again
                self._failed_pairs[prefill.worker_id, decode.worker_id] = \
                    time.monotonic() + TRANSFER_BACKOFF_S
            raise ClusterError(f"prefill failed: {done.error}", worker_lost=done.retryable)
        timer.prefill_timings = done.timings | {"decode_cached_tokens": reply.cached_tokens}
        timer.tokens(1)
        self._send(decode.worker_id, StartDecode(spec.request_id, done.first_token_id, done.logprob))
        yield TokenEvent([done.first_token_id], None if done.logprob is None else [done.logprob],
                         cached_tokens=done.timings.get("cached_tokens", 0),
                         prompt_logprobs=done.prompt_logprobs)
        async for event in self._stream(flight, timer):
            yield event

    async def _colocated(self, spec, flight, timer) -> AsyncIterator[TokenEvent]:
        workers = self.pool("colocated")
        if not workers:
            raise ClusterError("no workers: need a prefill and a decode worker, or a colocated one",
                               503, self.config.worker_timeout_s)
        worker = self.routers["colocated"].pick(workers, spec.prompt_token_ids)
        self._enlist(flight, worker, spec.request_id, len(spec.prompt_token_ids) + spec.params.max_tokens)
        self._send(worker.worker_id, Generate(spec.request_id, spec.prompt_token_ids, spec.params,
                                              spec.priority))
        timer.mark("queue")
        async for event in self._stream(flight, timer):
            yield event

    # ---- flow control: the queue, and a pair for its head ------------------------------------
    async def _admit(self, spec, flight) -> tuple[WorkerState, WorkerState, AdmitReply]:
        """Wait in the queue for a decode worker with room and a prefill worker that can take
        the prompt soon, then have decode reserve its pages; a full decode pool sends the
        request back to its place in the queue. Nothing fails merely for waiting its turn,
        up to --admit-timeout."""
        self._check_fits(spec)
        if self.num_queued >= self.config.max_queued_requests:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise ClusterError(f"the gateway's queue is full (--max-queued-requests "
                               f"{self.config.max_queued_requests}); retry later", 429, 1,
                               rejected=True)
        deadline = time.monotonic() + self.config.admit_timeout_s
        if flight.arrival is None:
            flight.arrival = next(self._seq)
        entry = _Waiting(spec.priority, flight.arrival, spec, None)
        while True:
            entry.pair = asyncio.get_running_loop().create_future()
            heapq.heappush(self._queue, entry)
            self._num_waiting += 1
            self._capacity.set()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    decode, prefill = await entry.pair
            except TimeoutError:
                self.metrics.rejected.labels(reason="admit_timeout").inc()
                raise ClusterError(f"no prefill+decode capacity within --admit-timeout "
                                   f"{self.config.admit_timeout_s} s", 503, 1,
                                   rejected=True) from None
            finally:
                entry.pair.cancel()
                if entry.pair.cancelled():  # still queued (it timed out or its client left)
                    self._unqueue()
            params = replace(spec.params, prompt_logprobs=None)  # (prefill scores the prompt)
            self._send(decode.worker_id, Admit(spec.request_id, spec.prompt_token_ids, params,
                                               spec.priority))
            reply = await self._next(flight, AdmitReply)
            if reply.ok:
                return decode, prefill, reply
            self._leave(flight, decode, spec.request_id)
            self._leave(flight, prefill, spec.request_id)
            if not reply.retryable:
                raise ClusterError(reply.error, 400)
            decode.full_until = time.monotonic() + FULL_BACKOFF_S

    def _unqueue(self) -> None:
        """A queued request stopped waiting (timed out, its client left): it holds no place
        in the queue (clients leaving behind a head that waits for room would otherwise fill
        it, and new requests get 429s). Its entry leaves the heap at the head, or with all
        such entries once they are half the heap (O(1) a request, amortized). (Several that
        leave at once, as the choices of one request do, are all cancelled before the first
        comes here: one pass may drop the entries of others still on their way here.)"""
        self._num_waiting -= 1
        if 2 * (len(self._queue) - self._num_waiting) > len(self._queue):
            self._queue[:] = [e for e in self._queue if not e.pair.done()]
            heapq.heapify(self._queue)
        self.metrics.queued.set(self.num_queued)

    def not_ready(self) -> str:
        """Why no request can be served now ("" if one can): /health's status, by generate's
        rule: requests go to the prefill and decode pools where both have workers, and serve
        only with a pair that can hand KV over (another --kv-cache-dtype or --transfer-backend:
        every request a 503, colocated workers or not); else to colocated workers."""
        if not (self.pool("prefill") and self.pool("decode")):
            return "" if self.pool("colocated") else "no workers"
        why = self._pair_problem()
        return why and f"no prefill worker can send KV to any decode worker: {why}"

    def _pair_problem(self) -> str:
        """"" if some prefill worker can hand KV to some decode worker, else why not (the first
        pair's reason)."""
        first = ""
        for p in self.pool("prefill"):
            for d in self.pool("decode"):
                if not (why := pair_error(p.status, d.status)):
                    return ""
                first = first or why
        return first or "no prefill or decode worker"

    def _check_fits(self, spec) -> None:
        """A prompt that no decode or prefill pool could ever hold is a 400 now, not a wait;
        with no pair that can hand KV over at all, a 503."""
        if self._pair_problem():
            raise ClusterError("no prefill worker can send KV to any decode worker (the gateway's "
                               "log says why)", 503, self.config.worker_timeout_s)
        for role in ("decode", "prefill"):
            pools = [w.status for w in self.pool(role) if w.status.layout]
            if not pools:
                raise ClusterError(f"no {role} worker is registered and taking requests (not "
                                   "draining)", 503, self.config.worker_timeout_s)
            need = max(pages_for(len(spec.prompt_token_ids) + 1, s.layout["page_size"]) for s in pools)
            most = max(s.num_pages for s in pools)
            if need > most:
                raise ClusterError(f"the prompt ({len(spec.prompt_token_ids)} tokens) needs {need} KV "
                                   f"pages; the largest {role} pool holds {most}", 400)

    async def _dispatch(self) -> None:
        """Hand queued requests, best first, a (decode, prefill) pair while pairs have room.
        The head waits for room (strict order); woken by every change of capacity, and
        every DISPATCH_TICK_S (back-offs end, worker statuses come in)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DISPATCH_TICK_S):
                    await self._capacity.wait()
            self._capacity.clear()
            self.metrics.queued.set(self.num_queued)
            while self._queue:
                head = self._queue[0]
                if head.pair.done():  # timed out or its client left (_unqueue)
                    heapq.heappop(self._queue)
                    continue
                pair = self._pick_pair(head.spec)
                if pair is None:
                    break
                heapq.heappop(self._queue)
                head.pair.set_result(pair)
                self._num_waiting -= 1
                # On the pair from now on (so the next pick sees its load, and its end, even
                # before its coroutine runs again, takes it off both).
                spec, (decode, prefill) = head.spec, pair
                flight = self._flights[spec.request_id]
                self._enlist(flight, decode, spec.request_id,
                             len(spec.prompt_token_ids) + spec.params.max_tokens)
                self._enlist(flight, prefill, spec.request_id, len(spec.prompt_token_ids))

    def _pick_pair(self, spec) -> tuple[WorkerState, WorkerState] | None:
        now = time.monotonic()
        decodes = [d for d in self.pool("decode")
                   if d.full_until <= now and len(d.inflight) < d.status.max_running_requests]
        prefills = [p for p in self.pool("prefill") if p.prefill_has_room(len(spec.prompt_token_ids))]
        # Pairs whose transfer failed lately are passed over while any other pair exists (it
        # may only lack room now); with none, they are tried again.
        rest = False
        if self._failed_pairs:
            self._failed_pairs = {k: t for k, t in self._failed_pairs.items() if t > now}
            rest = not all(self._rests(p, d) for p in self.pool("prefill") for d in self.pool("decode")
                           if not pair_error(p.status, d.status))
            if rest:
                decodes = [d for d in decodes if any(not self._rests(p, d) for p in prefills)]
        for decode in ([self.routers["decode"].pick(decodes, spec.prompt_token_ids)] if decodes else []):
            ok = [p for p in prefills if not pair_error(p.status, decode.status)
                  and not (rest and self._rests(p, decode))]
            if ok:
                return decode, self.routers["prefill"].pick(ok, spec.prompt_token_ids)
        return None

    def _rests(self, prefill: WorkerState, decode: WorkerState) -> bool:
        """The pair's last transfer failed less than TRANSFER_BACKOFF_S ago (_pick_pair drops
        the entries past it)."""
        return (prefill.worker_id, decode.worker_id) in self._failed_pairs

    async def _stream(self, flight, timer) -> AsyncIterator[TokenEvent]:
        while True:
            row = await self._next(flight, TokenDelta)
            if row.token_ids:
                timer.tokens(len(row.token_ids))
            if row.error:
                raise ClusterError(row.error)
            if row.cached_tokens:  # colocated: token 1's row
                timer.prefill_timings["cached_tokens"] = row.cached_tokens
            yield TokenEvent(row.token_ids, row.logprobs, row.finished, row.finish_reason,
                             cached_tokens=row.cached_tokens, prompt_logprobs=row.prompt_logprobs)
            if row.finished:
                return

    async def _next(self, flight: _Flight, kind):
        """The request's next message of `kind`; a worker failure arrives as an exception, and
        so does a worker whose loop has been silent for --step-timeout (a request may wait its
        turn longer on a worker that steps on). A message of another kind that carries an
        error (a worker of the request failed it) raises too. (asyncio.timeout, not wait_for:
        3.11's wait_for can swallow a cancellation that comes as the message does, which left
        a departed client's request parked forever.)"""
        timeout = self.config.step_timeout_s
        while True:
            if flight.error is not None:
                raise flight.error
            try:
                async with asyncio.timeout(min(timeout, SILENCE_CHECK_S)):
                    msg = await flight.queue.get()
            except TimeoutError:
                if flight.error is not None:  # (its wake-up came with the timeout)
                    raise flight.error from None
                cutoff = self._heard_until() - timeout
                silent = [w for w in flight.workers
                          if w not in self.workers or self.workers[w].last_progress < cutoff]
                if silent or not flight.workers:
                    raise ClusterError(f"no answer from {', '.join(silent or ['any worker'])} "
                                       f"within --step-timeout {timeout} s") from None
                continue
            if isinstance(msg, kind):
                return msg
            error = getattr(msg, "error", "")
            if error:  # another phase's failure (e.g. decode failed it during prefill)
                raise ClusterError(error)

    def _enlist(self, flight: _Flight, worker: WorkerState, rid: str, tokens: int) -> None:
        flight.workers.append(worker.worker_id)
        worker.inflight[rid] = tokens

    def _leave(self, flight: _Flight, worker: WorkerState, rid: str) -> None:
        """The worker holds nothing of the request any more."""
        worker.inflight.pop(rid, None)
        if worker.worker_id in flight.workers:
            flight.workers.remove(worker.worker_id)
        self._capacity.set()

    # ---- control socket ----------------------------------------------------------------------
    def _send(self, worker_id: str, msg) -> None:
        """Send without waiting, on the worker's control connection (a worker no longer
        registered gets nothing). An asyncio socket reports a failed send (an unroutable
        connection: the worker is gone) on the future it returns, never by raising."""
        state = self.workers.get(worker_id)
        if state is None:
            return
        sent = self._sock.send_multipart([state.route, self.codec.encode(msg)], flags=zmq.NOBLOCK)
        sent.add_done_callback(lambda future: self._sent(worker_id, future))

    def _sent(self, worker_id: str, future: asyncio.Future) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            logger.warning("cannot reach %s: %s", worker_id, error)
            self._drop(worker_id, f"worker {worker_id} unreachable")

    def _heard_until(self) -> float:
        """Up to when the workers' messages have been read: now while the receive loop waits on
        an empty control socket, else when it last began to. A silence is judged against this,
        so a gateway held up (a paused process, a starved VM) or working through a backlog
        does not take its workers' unread messages for silence."""
        # (get, not getsockopt: the asyncio socket's get re-arms its wake-up after reading
        # EVENTS, which zmq signals on an edge)
        if self._idle and not self._sock.get(zmq.EVENTS) & zmq.POLLIN:
            return time.monotonic()
        return self._drained_at

    async def _receive(self) -> None:
        while True:
            if not self._sock.get(zmq.EVENTS) & zmq.POLLIN:
                self._drained_at, self._idle = time.monotonic(), True
            frames = await self._sock.recv_multipart()
            self._idle = False
            if len(frames) != 2:
                protocol.refused("control", f"a message of {len(frames)} frames")
                continue
            route, data = frames
            decode = functools.partial(self.codec.receive, data, "control", f"connection {route.hex()}")
            try:  # (a message decoded in a thread holds up the next one's receive: order holds)
                msg = await asyncio.to_thread(decode) if len(data) > THREAD_DECODE_BYTES else decode()
                if msg is not None:
                    self._on_message(route, msg)
            except Exception as e:  # a message we failed to handle must not stop the rest
                logger.exception("control socket: a message broke its handler")
                protocol.refused("control", f"a message whose handling failed: {e!r}")

    def _on_message(self, route: bytes, msg) -> None:
        """One message from a worker. Which worker it speaks for comes from the message
        (authenticated by the cluster key) or, for replies that carry no worker id, from the
        connection it registered on: the ROUTER's routing ids are its own, per connection, so
        a peer cannot squat a worker id and keep the worker out. A registration from another
        connection moves the worker there (a reconnect, or a restart under the same id), and
        ends the requests it held (what was on the old connection may be lost)."""
        state = self._worker_on(route)
        worker_id = getattr(msg, "worker_id", None) or (state.worker_id if state else None)
        if worker_id is None:
            protocol.refused("control", f"a {type(msg).__name__} from a connection no worker "
                                        "registered on")
            return
        if state is not None and state.worker_id != worker_id:
            protocol.refused("control", f"{type(msg).__name__} of {worker_id!r} on the "
                                        f"connection of {state.worker_id!r}")
            return
        state = self.workers.get(worker_id)
        incarnation = getattr(msg, "incarnation", None)
        if incarnation is not None and incarnation in self._superseded.get(worker_id, ()):
            protocol.refused("control", f"{type(msg).__name__} of {worker_id!r} from an "
                                        "incarnation a newer process replaced")
            if isinstance(msg, WorkerStatus):  # its main loop's connection: it exits
                sent = self._sock.send_multipart(
                    [route, self.codec.encode(Replaced(worker_id, incarnation))], flags=zmq.NOBLOCK)
                sent.add_done_callback(lambda future: future.cancelled() or future.exception())
            return
        if state is not None and incarnation is not None and incarnation != state.status.incarnation:
            if not isinstance(msg, WorkerStatus):  # (a restart shows itself by registering)
                return
            self._superseded.setdefault(worker_id, set()).add(state.status.incarnation)
            # (the queue waits: the new process registers below, in this same call)
            self._drop(worker_id, f"worker {worker_id} restarted", fail_queued=False)
            state = None
        if (state is not None and not isinstance(msg, (Heartbeat, WorkerStatus))
                and route != state.route):
            protocol.refused("control", f"a {type(msg).__name__} of {worker_id!r} from a "
                                        "connection other than its own")
            return
        if isinstance(msg, WorkerStatus):
            if state is not None and msg.seq <= state.status.seq:
                protocol.refused("control", f"a status of {worker_id!r} no newer than the last "
                                            "(one sent again)")
                return
            if state is not None and route != state.route:
                # Its control connection broke and zmq connected it again: what was in flight
                # on the old one, either way (a request's last tokens, an Admit), may be lost,
                # and nothing else would tell (its statuses keep it looking alive). Its requests
                # end as on a restart (those no client saw output of go again); it registers
                # on the new connection below.
                self._drop(worker_id, f"worker {worker_id} reconnected (what was in flight on "
                                      "its old connection may be lost)", fail_queued=False)
                state = None
            if state is None:
                if error := status_error(msg):
                    protocol.refused("control", f"registration of {worker_id}: {error}")
                    if not (self.pool("prefill") and self.pool("decode")):  # (after a restart)
                        self._fail_queued(f"{worker_id} restarted and was refused: {error}")
                    return
                previous = self._incarnations.get(worker_id)
                if previous is not None and previous != msg.incarnation:  # (dropped since)
                    self._superseded.setdefault(worker_id, set()).add(previous)
                self._incarnations[worker_id] = msg.incarnation
                logger.info("registered %s worker %s (tp %d)", msg.role, worker_id, msg.tp)
                self.workers[worker_id] = state = WorkerState(msg, route=route)
                self._routes[route] = worker_id
                self._check_pairs(msg)
            elif msg.role != state.status.role or msg.layout != state.status.layout:
                self._drop(worker_id, f"worker {worker_id} changed its role or KV layout")
                return
            elif msg.draining and not state.status.draining:
                logger.info("worker %s is draining: no new requests go to it", worker_id)
            state.status = msg
            self._capacity.set()
        if state is None:
            return
        if isinstance(msg, WorkerExit):
            self._drop(worker_id, f"worker {worker_id} exited ({msg.reason})")
            return
        if isinstance(msg, Heartbeat):
            if msg.seq <= state.beat_seq:
                protocol.refused("control", f"a heartbeat of {worker_id!r} no newer than the "
                                            "last (one sent again)")
                return
            state.beat_seq = msg.seq
        state.last_seen = time.monotonic()
        if not isinstance(msg, Heartbeat):
            state.last_progress = state.last_seen
        if isinstance(msg, TokenBatch):
            for row in msg.items:
                self._deliver(row.request_id, row, worker_id)
        elif isinstance(msg, (AdmitReply, PrefillDone)):
            self._deliver(msg.request_id, msg, worker_id)

    def _worker_on(self, route: bytes) -> WorkerState | None:
        """The registered worker whose control connection this is, if any."""
        state = self.workers.get(self._routes.get(route, ""))
        return state if state is not None and state.route == route else None

    def _check_pairs(self, status: WorkerStatus) -> None:
        """At registration: say which workers of the other phase this one cannot pair with."""
        other = {"prefill": "decode", "decode": "prefill"}.get(status.role)
        for peer in self.pool(other) if other else []:
            pair = (status, peer.status) if status.role == "prefill" else (peer.status, status)
            if error := pair_error(*pair):
                logger.error("prefill %s cannot send KV to decode %s: %s", pair[0].worker_id,
                             pair[1].worker_id, error)

    def _deliver(self, rid: str, msg, worker_id: str) -> None:
        """Into the request's mailbox, if the request is on that worker."""
        flight = self._flights.get(rid)
        if flight is None or worker_id not in flight.workers:
            return
        try:
            flight.queue.put_nowait(msg)
        except asyncio.QueueFull:
            logger.warning("request %s: mailbox full, dropping a message", rid)
        if isinstance(msg, PrefillDone) or (isinstance(msg, TokenDelta) and msg.finished):
            # The worker holds nothing of it now: its slot is free at once, not when the
            # client has read the answer (a client that never reads holds only its socket),
            # and its exit (a drained prefill worker's comes right after its last answer)
            # fails nothing it has answered.
            self._leave(flight, self.workers[worker_id], rid)

    async def _reap(self) -> None:
        """Drop silent workers, end flights whose consumer is gone, and ping every worker with
        the requests it should hold."""
        interval = min(0.5, self.config.worker_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            cutoff = self._heard_until() - self.config.worker_timeout_s
            for worker_id in [w for w, s in self.workers.items() if s.last_seen < cutoff]:
                self._drop(worker_id, f"worker {worker_id} stopped responding")
            for rid, flight in list(self._flights.items()):
                if flight.task is not None and flight.task.done():
                    logger.warning("request %s: its consumer ended without closing it", rid)
                    self._end(rid, flight, abort=True)
            for worker_id, state in list(self.workers.items()):
                self._send(worker_id, GatewayPing(self.gateway_id, list(state.inflight),
                                                  self.config.worker_timeout_s))

    def _drop(self, worker_id: str, reason: str, fail_queued: bool = True) -> None:
        state = self.workers.pop(worker_id, None)
        if state is None:
            return
        self._routes.pop(state.route, None)
        logger.warning("%s; failing its %d requests", reason, len(state.inflight))
        for rid in state.inflight:
            flight = self._flights.get(rid)
            if flight is not None:
                if worker_id in flight.workers:
                    flight.workers.remove(worker_id)
                flight.fail(ClusterError(reason, worker_lost=True))
        if fail_queued and not (self.pool("prefill") and self.pool("decode")):
            self._fail_queued(reason)
        self._capacity.set()

    def _fail_queued(self, reason: str) -> None:
        """No prefill+decode pair is left to serve the queue (`reason`): every queued request
        goes again to the colocated workers if there are any (generate's retry), else gets a 503."""
        error = ClusterError(f"no prefill+decode pair is left ({reason})", 503,
                             self.config.worker_timeout_s, worker_lost=bool(self.pool("colocated")))
        for entry in self._queue:
            if not entry.pair.done():
                entry.pair.set_exception(error)
                self._num_waiting -= 1
        self._queue.clear()
