"""What every worker process shares: the control socket to the gateway, heartbeats, the loop.

A worker is one process around an EngineCore. It registers with the gateway by sending its
WorkerStatus (again every heartbeat, so a restarted gateway learns it within one interval),
handles the gateway's messages between steps, and steps its engine while it has work.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import signal
import socket
import threading
import time

import torch
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pd_serve import protocol
from pd_serve.config import TransferConfig, WorkerConfig
from pd_serve.engine.core import EngineCore, token_stop_reason
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.protocol import (ERRORS_REGISTRY, AbortRequest, GatewayPing, Generate, Heartbeat,
                               Logprob, TokenBatch, TokenDelta, WorkerStatus)
from pd_serve.transfer import connector
from pd_serve.transfer.connector import model_layout

logger = logging.getLogger(__name__)
CONTROL_MAX_BYTES = 64 * 2**20  # largest message taken from the gateway
PING_GRACE = 1.5  # no gateway ping for this many of its timeouts: the gateway is gone


def make_request(request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 priority: int) -> Request:
    """A Request from wire fields (the codec has checked them)."""
    return Request(list(prompt_token_ids), sampling, request_id=request_id, priority=priority)


def new_token_row(request: Request, reason: FinishReason | None) -> TokenDelta:
    """The gateway's row for a request's newest token, with its logprob when the request asked
    for them; `reason`: the token ended the request."""
    logprobs = None
    if request.sampling_params.logprobs is not None:
        logprobs = [Logprob.of(request.output_logprobs[-1])]
    return TokenDelta(request.request_id, request.output_token_ids[-1:], logprobs, request.finished,
                      None if reason is None else reason.value)


def end_row(request_id: str, reason: FinishReason | None, error: str = "") -> TokenDelta:
    """The gateway's row for a request that ended without a new token: finished for `reason`,
    or failed with `error`."""
    return TokenDelta(request_id, [], None, True, None if reason is None else reason.value, error)


class WorkerMetrics:
    """The worker's own series; the gateway adds a `worker` label when it merges them."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.pages_used = Gauge("pd_serve:kv_pages_used", "KV pages in use", registry=r)
        self.pages_total = Gauge("pd_serve:kv_pages_total", "KV pages in the pool", registry=r)
        self.running = Gauge("pd_serve:num_requests_running", "requests in the batch", registry=r)
        self.waiting = Gauge("pd_serve:num_requests_waiting", "requests queued", registry=r)
        self.prompt_tokens = Counter("pd_serve:prompt_tokens", "prompt tokens computed", registry=r)
        self.generation_tokens = Counter("pd_serve:generation_tokens", "tokens generated", registry=r)


class Worker:
    role = ""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.worker_id = config.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        self.incarnation = secrets.token_hex(8)  # a restart under the same id is a new worker
        self.codec = protocol.Codec(config.cluster_key)
        transfer = self.transfer_config()
        self.core = EngineCore(config.engine, tp_follower_io=None if transfer is None
                               else functools.partial(connector.follower_io, transfer))
        self.core.warmup()
        # prefill and decode: the KV hand-off over every TP rank
        self.connector = None if transfer is None else connector.connector(transfer, self.core)
        self.metrics = WorkerMetrics()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
        self._sock.connect(config.gateway)
        self._next_heartbeat = 0.0
        self._gateway_deadline = float("inf")  # no gateway ping by then: the gateway is gone
        self._ping_timeout_s = 0.0
        self._stop = False
        self._aborted: set[str] = set()  # requests reconcile has aborted (their ends may lag)

    @property
    def transfer_backend(self) -> str:
        """--transfer-backend; auto: tcp on CPU, torch on GPU."""
        backend, device = self.config.transfer_backend, self.config.engine.device
        if backend != "auto":
            return backend
        on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        return "tcp" if on_cpu else "torch"

    # ---- role hooks -----------------------------------------------------------------------
    def handle(self, msg) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        """Poll transfers and run one engine step if there is work."""
        raise NotImplementedError

    def busy(self) -> bool:
        return self.core.scheduler.has_unfinished()

    def status_fields(self) -> dict:
        return {}

    def transfer_config(self) -> TransferConfig | None:
        """This worker's KV hand-off (None: none, colocated)."""
        return None

    def held_request_ids(self) -> set[str]:
        """Every request this worker holds state for (aborting one frees it: handle())."""
        sched = self.core.scheduler
        return {r.request_id for r in sched.running + sched.waiting}

    def threads(self) -> list:
        """Background I/O (a KV sender or receiver) whose death leaves this worker useless:
        each has `alive` and `error`."""
        return [] if self.connector is None else [self.connector]

    # ---- loop -----------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        logger.info("%s %s: model %s, gateway %s", self.role, self.worker_id, self.core.model_dir,
                    self.config.gateway)
        try:
            while not self._stop:
                if self._sock.poll(self.poll_ms(), zmq.POLLIN):
                    while self._sock.poll(0, zmq.POLLIN):
                        msg = self.codec.receive(self._sock.recv(), "control", "the gateway")
                        if isinstance(msg, GatewayPing):
                            self._reconcile(msg)
                        elif msg is not None:
                            self.handle(msg)
                if time.monotonic() > self._gateway_deadline:
                    self._gateway_gone()
                self.tick()
                if time.monotonic() >= self._next_heartbeat:
                    self.send(self.status())
                    self._next_heartbeat = time.monotonic() + self.config.heartbeat_s
        finally:
            self._stop = True  # (the heartbeat thread stops watching the TP followers)
            self.core.close()  # a TP group's followers

    def poll_ms(self) -> int:
        """How long the loop may wait for a message before its next tick."""
        return 0 if self.busy() else 10

    def send(self, msg) -> None:
        self._sock.send(self.codec.encode(msg))

    def _reconcile(self, ping: GatewayPing) -> None:
        """Drop every request the gateway no longer has here: an abort that never came, or
        a gateway that restarted (a new one has none of the old one's requests)."""
        self._ping_timeout_s = PING_GRACE * ping.timeout_s
        self._gateway_deadline = time.monotonic() + self._ping_timeout_s
        held = self.held_request_ids()
        self._aborted &= held
        stale = held - set(ping.request_ids) - self._aborted
        if stale:
            logger.warning("dropping %d request(s) gateway %s no longer has", len(stale), ping.gateway_id)
        for request_id in stale:
            self.handle(AbortRequest(request_id))
        self._aborted |= stale

    def _gateway_gone(self) -> None:
        held = self.held_request_ids()
        logger.warning("no ping from the gateway for %.1f s: dropping its %d request(s)",
                       self._ping_timeout_s, len(held))
        for request_id in held:
            self.handle(AbortRequest(request_id))
        self._gateway_deadline = float("inf")  # until the next ping

    def _heartbeat(self) -> None:
        """Liveness on a socket of its own, so a long step never looks like a dead worker.
        (The full WorkerStatus, with load and metrics, goes out between steps.)

        It also watches a TP group's followers and the worker's I/O threads (`threads()`): the
        worker cannot serve without them (on GPU rank 0 would wait inside its next NCCL
        collective until the group's timeout), so when one has died the process ends at once
        (status 1) and the gateway and the prefill side see a dead worker, not a zombie."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}/heartbeat".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.gateway)
        beat = self.codec.encode(Heartbeat(self.worker_id, self.incarnation))
        while not self._stop:
            gone = self.core.exited_tp_ranks()
            dead = [t.error or "stopped" for t in self.threads() if not t.alive]
            if (gone or dead) and not self._stop:
                why = f"tensor-parallel rank(s) {gone} exited" if gone else f"I/O thread died: {dead[0]}"
                logger.error("%s; %s cannot serve without it: exiting", why, self.worker_id)
                logging.shutdown()
                os._exit(1)
            sock.send(beat)
            time.sleep(self.config.heartbeat_s)

    def status(self) -> WorkerStatus:
        core, alloc = self.core, self.core.allocator
        m = self.metrics
        m.pages_used.set(alloc.num_used_pages)
        m.pages_total.set(alloc.num_pages)
        m.running.set(len(core.scheduler.running))
        m.waiting.set(len(core.scheduler.waiting))
        sched = core.config.scheduler
        return WorkerStatus(
            worker_id=self.worker_id, role=self.role, model=str(core.model_dir),
            incarnation=self.incarnation, layout=dataclasses.asdict(model_layout(core)),
            tp=core.config.tp, num_pages=alloc.num_pages, num_free_pages=alloc.num_free_pages,
            num_running=len(core.scheduler.running), num_waiting=len(core.scheduler.waiting),
            max_running_requests=sched.max_running_requests,
            max_prefill_tokens=sched.chunked_prefill_size if sched.chunked_prefill_size > 0
            else core.max_model_len, max_model_len=core.max_model_len,
            metrics=self.metrics_text(), **self.status_fields())

    def metrics_text(self) -> str:
        return (generate_latest(self.metrics.registry) + generate_latest(ERRORS_REGISTRY)).decode()

    # ---- shared by decode and colocated: step and stream tokens ------------------------------
    def step_and_stream(self) -> None:
        plan, sampled = self.core.step()
        self.metrics.prompt_tokens.inc(sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1))
        self.metrics.generation_tokens.inc(len(sampled))
        items = []
        for request in sampled:
            reason = token_stop_reason(request, self.core.eos_token_ids, self.core.max_model_len)
            if reason is not None:
                self.core.scheduler.finish(request, reason)
            items.append(new_token_row(request, reason))
        for request in plan.finished:  # ended by the scheduler: more KV than the pool holds
            items.append(end_row(request.request_id, request.finish_reason))
        if items:
            self.send(TokenBatch(self.worker_id, items))

    def abort_in_scheduler(self, request_id: str) -> bool:
        sched = self.core.scheduler
        for request in sched.running + sched.waiting:
            if request.request_id == request_id:
                sched.finish(request, FinishReason.ABORT)
                return True
        return False

    def fail(self, request_id: str, error: str) -> None:
        self.send(TokenBatch(self.worker_id, [end_row(request_id, None, error)]))


class ColocatedWorker(Worker):
    """Both phases in one process: the baseline the disaggregated path is compared against."""

    role = "colocated"

    def handle(self, msg) -> None:
        if isinstance(msg, Generate):
            try:
                request = make_request(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.priority)
                self.core.check_request(request.prompt_token_ids, request.sampling_params)
            except (ValueError, TypeError) as e:
                self.fail(msg.request_id, str(e))
                return
            self.core.scheduler.add(request)
        elif isinstance(msg, AbortRequest):
            self.abort_in_scheduler(msg.request_id)

    def tick(self) -> None:
        if self.core.scheduler.has_unfinished():
            self.step_and_stream()
