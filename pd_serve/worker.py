"""A worker process: one role's scheduler (role.py) over an EngineCore, the control socket to
the gateway, heartbeats, the loop.

The worker registers with the gateway by sending its WorkerStatus (again every heartbeat, so a
restarted gateway learns it within one interval), hands the gateway's messages and its KV
transfers' results to its role's scheduler between steps, steps while there is work, and sends
back whatever messages those calls return.

SIGTERM drains (--drain-timeout, as a Kubernetes pod's stop sends it): the status says
`draining`, so the gateway routes new requests elsewhere, and the worker serves what it holds
until nothing is left or the timeout passes, then ends the rest and exits. Its last message,
WorkerExit, has the gateway fail whatever the worker still held at once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import secrets
import signal
import socket
import threading
import time

import torch
import zmq
from prometheus_client import generate_latest

from pd_serve import protocol
from pd_serve.config import TransferConfig, WorkerConfig
from pd_serve.decode.scheduler import DecodeScheduler
from pd_serve.engine.core import EngineCore
from pd_serve.prefill.scheduler import PrefillScheduler
from pd_serve.protocol import (ERRORS_REGISTRY, AbortRequest, GatewayPing, Heartbeat, Replaced,
                               WorkerExit, WorkerStatus)
from pd_serve.role import ColocatedScheduler, WorkerMetrics
from pd_serve.transfer import connector
from pd_serve.transfer.connector import model_layout

logger = logging.getLogger(__name__)
CONTROL_MAX_BYTES = 64 * 2**20  # largest message taken from the gateway
PING_GRACE = 1.5  # no gateway ping for this many of its timeouts: the gateway is gone
SEND_TIMEOUT_S = 15.0  # a send the gateway's full queue holds this long: the gateway is stuck
UNHEARD_WARN_S = 10.0  # no word from the gateway since the start: a warning this often
ROLE_SCHEDULERS = {"colocated": ColocatedScheduler, "prefill": PrefillScheduler, "decode": DecodeScheduler}


def failure_reason(error: Exception) -> str:
    """What a worker that fails tells the gateway: the error's first line, and for a GPU out
    of memory the flags that make a step smaller or leave it more room."""
    lines = str(error).strip().splitlines()
    reason = f"failed: {type(error).__name__}: {lines[0][:200] if lines else ''}"
    if isinstance(error, torch.OutOfMemoryError):
        reason += ("; lower --mem-fraction-static, --max-running-requests or "
                   "--chunked-prefill-size")
    return reason


class Worker:
    def __init__(self, config: WorkerConfig, role: str):
        self.config = config
        self.role = role
        self.worker_id = config.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        self.incarnation = secrets.token_hex(8)  # a restart under the same id is a new worker
        self._status_seq = 0  # WorkerStatus.seq of the last status sent
        self.codec = protocol.Codec(config.cluster_key)
        transfer = self.transfer_config()
        self.core = EngineCore(config.engine, tp_follower_io=None if transfer is None
                               else functools.partial(connector.follower_io, transfer))
        self.core.warmup()
        # prefill and decode: the KV hand-off over every TP rank
        self.connector = None if transfer is None else connector.connector(transfer, self.core)
        self.metrics = WorkerMetrics()
        self.scheduler = ROLE_SCHEDULERS[role](self.core, self.worker_id, self.connector, self.metrics)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)  # (its routing id: the gateway's to pick)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
        protocol.secure_control(self._sock, config.cluster_key, server=False)
        self._sock.connect(config.gateway)
        self._link = GatewayLink(self._sock, SEND_TIMEOUT_S, self._gateway_stuck)
        self._unheard = UnheardGateway(config.gateway, time.monotonic())
        self._next_heartbeat = 0.0
        self._gateway_deadline = float("inf")  # no gateway ping by then: the gateway is gone
        self._ping_timeout_s = 0.0
        self._stop = False
        self._drain_deadline: float | None = None  # set by SIGTERM
        self._exit_reason = "stopped"
        self._aborted: set[str] = set()  # requests reconcile has aborted (their ends may lag)
        # requests dropped while the gateway was silent, and why: failed at its next ping, if it
        # still has them (a paused gateway comes back waiting for them)
        self._dropped: set[str] = set()
        self._dropped_why = ""

    @property
    def transfer_backend(self) -> str:
        """--transfer-backend; auto: tcp on CPU, torch on GPU."""
        backend, device = self.config.transfer_backend, self.config.engine.device
        if backend != "auto":
            return backend
        on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        return "tcp" if on_cpu else "torch"

    def transfer_config(self) -> TransferConfig | None:
        """This worker's KV hand-off (None: none, colocated)."""
        if self.role == "colocated":
            return None
        c = self.config
        return TransferConfig(self.role, self.transfer_backend, c.transfer_timeout_s, self.worker_id,
                              host=c.host, port=c.port, advertise_host=c.advertise_host,
                              layer_groups=c.transfer_layer_groups, cluster_key=c.cluster_key)

    # ---- loop -----------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        logger.info("%s %s: model %s, gateway %s", self.role, self.worker_id, self.core.model_dir,
                    self.config.gateway)
        try:
            while not self._stop:
                if self._sock.poll(self.poll_ms(), zmq.POLLIN):
                    while self._sock.poll(0, zmq.POLLIN):
                        msg = self.codec.receive(self._sock.recv(), "control", "the gateway")
                        self._link.heard()
                        self._unheard = None
                        if isinstance(msg, GatewayPing):
                            self._reconcile(msg)
                        elif isinstance(msg, Replaced):
                            self._replaced(msg)
                        elif msg is not None:
                            self.send_all(self.scheduler.handle(msg))
                if time.monotonic() > self._gateway_deadline:
                    self._gateway_gone()
                if self._unheard is not None and (warning := self._unheard.due(time.monotonic())):
                    logger.warning(warning)
                self.tick()
                if self._drain_deadline is not None:
                    self._drain()
                if time.monotonic() >= self._next_heartbeat:
                    self.send(self.status())
                    self._next_heartbeat = time.monotonic() + self.config.heartbeat_s
        except Exception as e:  # the gateway logs why its requests here failed
            self._exit_reason = failure_reason(e)
            raise
        finally:
            self._stop = True  # (the heartbeat thread stops watching the TP followers)
            self._say_exit()
            if self.connector is not None:
                # The KV I/O threads stop and their sockets close before the interpreter goes:
                # a send still in flight then referenced freed memory and libzmq aborted
                self.connector.close()
            self.core.close()  # a TP group's followers

    def _on_sigterm(self, *_) -> None:
        """The first SIGTERM starts the drain (with --drain-timeout > 0); a second one stops."""
        if self._drain_deadline is not None or self.config.drain_timeout_s <= 0:
            self._stop, self._exit_reason = True, "stopped by SIGTERM"
            return
        logger.info("SIGTERM: draining for up to %.0f s", self.config.drain_timeout_s)
        self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
        self._next_heartbeat = 0.0  # the gateway learns it at once

    def _drain(self) -> None:
        """Exit once nothing is held; past the deadline, end what is and exit."""
        held = self.scheduler.held_request_ids()
        if not held:
            logger.info("drained: exiting")
            self._stop, self._exit_reason = True, "drained"
        elif time.monotonic() > self._drain_deadline:
            logger.warning("--drain-timeout %.0f s passed: ending %d request(s) and exiting",
                           self.config.drain_timeout_s, len(held))
            for request_id in held:
                self.abort(request_id)
            self._stop = True
            self._exit_reason = f"--drain-timeout {self.config.drain_timeout_s:g} s passed"

    def _say_exit(self) -> None:
        """WorkerExit to the gateway, given a moment to leave (the socket's linger is 0)."""
        try:
            self._sock.setsockopt(zmq.LINGER, 1000)
            send_nowait(self._sock, self.codec.encode(WorkerExit(self.worker_id, self.incarnation,
                                                                 self._exit_reason)))
            self._sock.close()
        except zmq.ZMQError as e:
            logger.warning("could not tell the gateway this worker exits: %s", e)

    def poll_ms(self) -> int:
        return self.scheduler.poll_ms()

    def tick(self) -> None:
        """Take the KV transfers' results, then run one engine step if there is work."""
        if self.connector is not None:
            for result in self.connector.poll():
                self.send_all(self.scheduler.on_transfer(result))
        if self.scheduler.has_work():
            self.send_all(self.scheduler.step())

    def send(self, msg) -> None:
        self._link.send(self.codec.encode(msg))

    def send_all(self, messages: list) -> None:
        for msg in messages:
            self.send(msg)

    def abort(self, request_id: str) -> None:
        self.send_all(self.scheduler.handle(AbortRequest(request_id)))

    def _reconcile(self, ping: GatewayPing) -> None:
        """Drop every request the gateway no longer has here: an abort that never came, or
        a gateway that restarted (a new one has none of the old one's requests)."""
        self._ping_timeout_s = PING_GRACE * ping.timeout_s
        self._gateway_deadline = time.monotonic() + self._ping_timeout_s
        held = self.scheduler.held_request_ids()
        self._aborted &= held
        stale = held - set(ping.request_ids) - self._aborted
        if stale:
            logger.warning("dropping %d request(s) gateway %s no longer has", len(stale), ping.gateway_id)
        for request_id in stale:
            self.abort(request_id)
        self._aborted |= stale
        dropped, self._dropped = self._dropped, set()
        for request_id in sorted(dropped & set(ping.request_ids)):
            self.send_all(self.scheduler.fail(request_id, self._dropped_why))

    def _replaced(self, msg: Replaced) -> None:
        """A newer process registered under this worker id while this one was silent (hung,
        stopped): the gateway has dropped this one's requests and refuses its messages."""
        if msg.worker_id == self.worker_id and msg.incarnation == self.incarnation:
            logger.error("worker %s was replaced by a newer process under its id: exiting",
                         self.worker_id)
            self._stop, self._exit_reason = True, "replaced by a newer process"

    def _gateway_stuck(self) -> None:
        logger.warning("the gateway took no message for %.0f s: dropping its requests, and "
                       "messages until it is heard from", SEND_TIMEOUT_S)
        self._gateway_gone()

    def _gateway_gone(self) -> None:
        held = self.scheduler.held_request_ids()
        why = f"no ping from the gateway for {self._ping_timeout_s:.1f} s"
        logger.warning("%s: dropping its %d request(s)", why, len(held))
        for request_id in held:
            self.abort(request_id)
        self._dropped |= held
        self._dropped_why = f"worker {self.worker_id} dropped the request: {why}"
        self._gateway_deadline = float("inf")  # until the next ping

    def _heartbeat(self) -> None:
        """Liveness on a socket of its own, so a long step never looks like a dead worker.
        (The full WorkerStatus, with load and metrics, goes out between steps.)

        It also watches a TP group's followers and the KV connector's I/O threads: the worker cannot serve without them (on GPU rank 0 would wait inside its next NCCL
        collective until the group's timeout), so when one has died the process ends at once
        (status 1) and the gateway and the prefill side see a dead worker, not a zombie."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        protocol.secure_control(sock, self.config.cluster_key, server=False)
        sock.connect(self.config.gateway)
        seq = itertools.count(1)
        while not self._stop:
            gone = self.core.exited_tp_ranks()
            dead = [] if self.connector is None or self.connector.alive else [self.connector.error or "stopped"]
            if (gone or dead) and not self._stop:
                why = f"tensor-parallel rank(s) {gone} exited" if gone else f"I/O thread died: {dead[0]}"
                logger.error("%s; %s cannot serve without it: exiting", why, self.worker_id)
                logging.shutdown()
                os._exit(1)
            send_nowait(sock, self.codec.encode(Heartbeat(self.worker_id, self.incarnation,
                                                          next(seq))))
            time.sleep(self.config.heartbeat_s)

    def status(self) -> WorkerStatus:
        core, alloc = self.core, self.core.allocator
        running, waiting = self.scheduler.load()
        m = self.metrics
        available = core.scheduler.num_available_pages()
        m.pages_used.set(alloc.num_pages - available)
        m.pages_total.set(alloc.num_pages)
        m.running.set(running)
        m.waiting.set(waiting)
        if core.prefix_cache is not None:
            m.record_cache(core.prefix_cache)
        sched = core.config.scheduler
        transfer = {} if self.connector is None else {"transfer_backend": self.transfer_backend}
        if self.role == "decode":
            transfer["transfer_addresses"] = self.connector.addresses
        self._status_seq += 1
        return WorkerStatus(
            worker_id=self.worker_id, role=self.role, model=str(core.model_dir), seq=self._status_seq,
            incarnation=self.incarnation, layout=dataclasses.asdict(model_layout(core)),
            tp=core.config.tp, num_pages=alloc.num_pages, num_free_pages=available,
            num_running=running, num_waiting=waiting,
            max_running_requests=sched.max_running_requests,
            max_prefill_tokens=sched.chunked_prefill_size if sched.chunked_prefill_size > 0
            else core.max_model_len, max_model_len=core.max_model_len,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            schedule_policy=sched.schedule_policy, draining=self._drain_deadline is not None,
            metrics=self.metrics_text(), **transfer)

    def metrics_text(self) -> str:
        text = generate_latest(self.metrics.registry) + generate_latest(ERRORS_REGISTRY)
        if self.connector is not None:
            text += generate_latest(self.connector.stats.registry)
        return text.decode()


class GatewayLink:
    """The worker's sends on its gateway socket. A send waits while the gateway's queue is full
    (zmq's high-water mark: flow control), for at most `timeout_s`; past that the gateway is
    stuck or unreachable (a plain send would block the worker for good): `on_stuck()` runs once
    (the worker drops the gateway's requests, so no stream goes on with a gap) and later sends
    are dropped at once until the gateway is heard from again (`heard()`)."""

    def __init__(self, sock: zmq.Socket, timeout_s: float, on_stuck):
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.sock, self.on_stuck = sock, on_stuck
        self.stuck = False
        self.dropped = 0

    def send(self, data: bytes) -> bool:
        """Whether `data` was queued (False: dropped)."""
        try:
            self.sock.send(data, zmq.NOBLOCK if self.stuck else 0)
            return True
        except zmq.Again:
            self.dropped += 1
            if not self.stuck:
                self.stuck = True
                self.on_stuck()
            return False

    def heard(self) -> None:
        self.stuck = False


class UnheardGateway:
    """A worker the gateway has never answered (it registers by its first status; the gateway
    pings it back) says so every UNHEARD_WARN_S, with the likely causes: otherwise a wrong
    address or cluster key leaves it waiting without a word (zmq reconnects quietly, also
    after a failed CURVE handshake, which neither side logs)."""

    def __init__(self, gateway: str, start: float):
        self.gateway, self.start, self.next = gateway, start, start + UNHEARD_WARN_S

    def due(self, now: float) -> str | None:
        """The warning to log now, if one is due."""
        if now < self.next:
            return None
        self.next = now + UNHEARD_WARN_S
        host, _, port = self.gateway.removeprefix("tcp://").rpartition(":")
        try:
            socket.getaddrinfo(host.strip("[]"), int(port))
            why = ("is the gateway up at that address, and started with the same "
                   "PD_SERVE_CLUSTER_KEY / --cluster-key-file? (under another key, or none on "
                   "one side, the connection's handshake fails)")
        except (socket.gaierror, ValueError) as e:
            why = f"its host {host!r} does not resolve ({e})"
        return f"no word from the gateway at {self.gateway} for {now - self.start:.0f} s: {why}"


def send_nowait(sock: zmq.Socket, data: bytes) -> bool:
    """Queue `data` without blocking; False when it is dropped (the queue to the gateway is
    full): for heartbeats, and the last word, which nothing must hold up."""
    try:
        sock.send(data, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
