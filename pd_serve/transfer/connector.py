"""The KV connector: a prefill or decode worker's KV hand-off, over every rank of its TP group.

A TP worker's ranks each keep the KV heads they compute in their own pool (the same page ids on
every rank). So every rank of a prefill worker has a sender, every rank of a decode worker a
receiver, and each prefill rank sends the heads a decode rank needs straight to that rank
(transfer/heads.py: routes), in the same batched chunks as without TP; equal TP sizes pair rank
i with rank i, all heads.

The worker (rank 0) holds one KVConnector (`connector()`); each follower holds a FollowerIO
(`follower_io()`, built in its process from the same TransferConfig). Rank 0 drives the
followers through the TP group (engine/tp_group.py): prefill followers send a plan's KV sends
from inside their forward, like rank 0; decode followers expect and cancel when rank 0 does.
Followers report their transfers' results to rank 0 on the group's queue; rank 0 counts a
request's parts (one per head route and receiver, or per decode rank) and reports the request once.

Expert parallelism over replicated attention (--tp 1 --ep-size N) gives a worker N ranks that
each hold every KV head: N copies of one attention rank. Routes run between attention ranks
(rank r is attention rank r % tp, heads.py), so only the first copy of a prefill worker sends
(its followers compute the same KV, and sending it again would only double the bytes) and every
copy of a decode worker receives the pages into its own pool, from the prefill rank straight to
it: no collective in the decode loop, and nothing to change in the gateway or the messages. A
decode worker advertises one address per attention rank, as under TP, so everything that counts
its TP ranks stays right; a replicated rank's address lists its copies' receivers, comma-separated
(replica_addresses() reads it back).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

from pd_serve.config import TransferConfig
from pd_serve.engine import tp_group
from pd_serve.engine.plan import KVSend
from pd_serve.transfer.base import TransferResult
from pd_serve.transfer.heads import head_routes

logger = logging.getLogger(__name__)

PUT_TIMEOUT_S = 30.0  # a follower waits this long for room on the queue (rank 0 drains it every tick)
ADDRESS_TIMEOUT_S = 600  # decode followers report their receivers' addresses once their engines are up
DRAIN_LIMIT = 4096  # follower results taken per poll


class KVConnector(ABC):
    """A worker's KV hand-off over all its TP ranks, as rank 0 (the worker) sees it.

    Invariants:
    * send_layers(sends, layer) (prefill) runs on every rank as its forward finishes `layer`;
      at the end of a layer group each rank queues its own KV heads of every KVSend for the
      decode ranks that hold them. Nothing is sent before the forward has computed it.
    * expect(request_id, page_ids) (decode) returns once every rank expects the pages: no KV
      reaches a rank that does not expect it. Only pages expected are ever written.
    * cancel(request_id): decode: on return no rank writes into the request's pages (they may
      be freed). Prefill: its sends are aborted on every rank, and its result still comes (the
      pages may be read until then).
    * poll() gives each request's result once, combined over its parts (ok if every part is).
      A failed part cancels the other parts first; a decode request's failure is reported at
      once, a prefill request's once every part has answered (then no rank reads its pages).
    * close() stops this rank's I/O (the followers' stop with their processes).
    """

    stats = None  # TransferStats: every rank's parts (Prometheus registry)

    @abstractmethod
    def poll(self) -> list[TransferResult]: ...

    @abstractmethod
    def cancel(self, request_id: str) -> None: ...

    def send_layers(self, sends: list[KVSend], layer: int) -> None:
        raise NotImplementedError("send_layers is a prefill connector's")

    def expect(self, request_id: str, page_ids: list[int]) -> None:
        raise NotImplementedError("expect is a decode connector's")

    @property
    @abstractmethod
    def alive(self) -> bool:
        """Whether this rank's I/O thread runs (`error` says why not)."""

    @abstractmethod
    def close(self) -> None: ...


def model_layout(core):
    """The pool's layout with every KV head of the model: what TP ranks announce and match on."""
    return replace(core.kv_pool.layout, num_kv_heads=core.model_config.num_kv_heads)


def join_replicas(addresses: list[str], tp: int) -> list[str]:
    """A decode worker's receivers (one per rank) -> one address per attention rank (--tp of
    them): rank r's receiver joins those of the ranks with the same attention rank r % tp."""
    return [",".join(addresses[r::tp]) for r in range(tp)]


def replica_addresses(address: str) -> list[str]:
    """The receivers of an advertised decode address: one, or every copy of a replicated
    attention rank (join_replicas)."""
    return address.split(",")


def group_ends(num_layers: int, groups: int) -> dict[int, int]:
    """Layer index after which each layer group is complete (e.g. 32 layers, 4 groups:
    7, 15, 23, 31) -> group number."""
    groups = min(groups, num_layers)
    return {round(num_layers * (g + 1) / groups) - 1: g for g in range(groups)}


# ---- one rank's part ---------------------------------------------------------------------------
class _RankPart:
    """What both ranks' parts share: `io`, their sender or receiver, polled and closed alike."""

    io = None

    def poll(self) -> list[TransferResult]:
        return self.io.poll()

    def close(self) -> None:
        self.io.close()


class PrefillRank(_RankPart):
    """One prefill rank's sender, and the routes from this rank to each decode TP size.
    core: what it reads of an engine (kv_pool, model_config): an EngineCore or an Executor.
    tp: the pool's attention ranks (--tp); ranks from tp on are copies and send nothing."""

    def __init__(self, core, config: TransferConfig, rank: int, tp: int):
        from pd_serve.transfer.sender import KVSender
        self.rank, self.tp = rank, tp
        self.num_kv_heads = core.model_config.num_kv_heads
        self.local_heads = core.kv_pool.layout.num_kv_heads
        sender_id = config.worker_id if rank == 0 else f"{config.worker_id}/tp{rank}"
        self.sender = KVSender(core.kv_pool, config.backend, sender_id=sender_id,
                               timeout_s=config.timeout_s, model_layout=model_layout(core),
                               key=config.cluster_key)
        self.io = self.sender
        self.group_ends = group_ends(core.kv_pool.layout.num_layers, config.layer_groups)

    def routes(self, decode_tp: int) -> tuple:
        return head_routes(self.tp, decode_tp, self.num_kv_heads)

    def num_parts(self, addresses: list[str]) -> int:
        """A prompt's transfers to a decode worker's `addresses`, over all prefill ranks: one
        per head route and receiver."""
        return sum(len(replica_addresses(addresses[route.dst_rank]))
                   for route in self.routes(len(addresses)))

    def send_layers(self, sends: list[KVSend], layer: int) -> None:
        """Called as the forward finishes `layer`: at a group's last layer, queue that group's KV
        of every prompt in `sends`, this rank's heads to the decode ranks that need them."""
        if layer not in self.group_ends:
            return
        ends = sorted(self.group_ends)
        start = 0 if layer == ends[0] else ends[ends.index(layer) - 1] + 1
        last = layer == ends[-1]
        ready = self.sender.ready_mark() if sends else None  # one mark for the group's sends
        for send in sends:
            routes = self.routes(len(send.addresses))
            dst_heads = max(1, self.num_kv_heads // len(send.addresses))
            for route in routes:
                if route.src_rank != self.rank:
                    continue
                heads = (route.src_head, route.dst_head, route.num_heads)
                if route.num_heads == self.local_heads == dst_heads:
                    heads = None  # every head on both sides: the plain whole-page path
                parts = sum(r.dst_rank == route.dst_rank for r in routes)
                for address in replica_addresses(send.addresses[route.dst_rank]):
                    self.sender.send(send.request_id, address, send.src_page_ids,
                                     send.dst_page_ids, start, layer + 1, last, heads, parts, ready)

    def cancel(self, request_id: str) -> None:
        self.sender.abort(request_id)


class DecodeRank(_RankPart):
    """One decode rank's receiver (rank 0's binds the worker's --port; followers' any port)."""

    def __init__(self, core, config: TransferConfig, rank: int, port: int = 0):
        from pd_serve.transfer.receiver import KVReceiver
        self.receiver = KVReceiver(core.kv_pool, config.backend, host=config.host, port=port,
                                   timeout_s=config.timeout_s, model_layout=model_layout(core),
                                   key=config.cluster_key, advertise_host=config.advertise_host)
        self.io = self.receiver

    def expect(self, request_id: str, page_ids: list[int]) -> None:
        # No deadline until the KV starts to arrive: the prompt may wait its turn on prefill.
        self.receiver.expect(request_id, page_ids, wait_s=math.inf)

    def cancel(self, request_id: str) -> None:
        self.receiver.cancel(request_id)


def _rank_part(core, config: TransferConfig, rank: int):
    if config.role == "prefill":
        return PrefillRank(core, config, rank, core.config.tp)
    return DecodeRank(core, config, rank, config.port if rank == 0 else 0)


# ---- rank 0: the worker's connector ------------------------------------------------------------
@dataclass
class _Parts:
    """A request's parts without a result yet, and what the answered ones said."""

    left: int
    errors: list[str] = field(default_factory=list)
    num_bytes: int = 0
    seconds: float = 0.0


class TPConnector(KVConnector):
    """Rank 0's part, and its followers' through the TP group (none without TP or EP)."""

    def __init__(self, config: TransferConfig, core):
        self.config = config
        self.tp, self.reports = core.tp, core.tp_reports
        self.tp_size = self.tp.size if self.tp is not None else 1  # every rank, copies included
        self.part = _rank_part(core, config, 0)
        self.stats = self.part.io.stats
        self._parts: dict[str, _Parts] = {}
        if config.role == "decode":  # one per attention rank (module docstring)
            self.addresses = join_replicas([self.part.receiver.address]
                                           + self._follower_addresses(), core.config.tp)

    def routes(self, decode_tp: int) -> tuple:
        """Prefill: the head routes to a decode worker of decode_tp ranks (ValueError if its
        TP size does not divide the model's KV heads)."""
        return self.part.routes(decode_tp)

    def send_layers(self, sends: list[KVSend], layer: int) -> None:
        for send in sends:
            if send.request_id not in self._parts:
                self._parts[send.request_id] = _Parts(self.part.num_parts(send.addresses))
        self.part.send_layers(sends, layer)

    def expect(self, request_id: str, page_ids: list[int]) -> None:
        self.part.expect(request_id, page_ids)
        if self.tp is not None:  # before the caller tells anyone: no KV reaches a follower unexpected
            tp_group.call(self.tp, "expect", request_id, page_ids)
        self._parts[request_id] = _Parts(self.tp_size)

    def cancel(self, request_id: str) -> None:
        self.part.cancel(request_id)
        if self.tp is not None:
            tp_group.call(self.tp, "cancel", request_id)
        if self.config.role == "decode":
            self._parts.pop(request_id, None)

    def poll(self) -> list[TransferResult]:
        out = []
        for result in self.part.poll() + self._drain():
            parts = self._parts.get(result.request_id)
            if parts is None:
                continue
            parts.left -= 1
            parts.num_bytes += result.num_bytes
            parts.seconds = max(parts.seconds, result.seconds)
            if not result.ok:
                if not parts.errors:
                    self.cancel(result.request_id)  # the other parts (decode: forgets it)
                parts.errors.append(result.error)
            if parts.left == 0 or (parts.errors and self.config.role == "decode"):
                self._parts.pop(result.request_id, None)
                out.append(TransferResult(result.request_id, not parts.errors,
                                          parts.errors[0] if parts.errors else "",
                                          parts.num_bytes, parts.seconds))
        return out

    def _drain(self) -> list[TransferResult]:
        """The followers' results since the last poll (without waiting), counted in `stats`."""
        out = []
        while self.reports is not None and len(out) < DRAIN_LIMIT:
            try:
                _, _, *fields = self.reports.get_nowait()
            except queue.Empty:
                break
            out.append(TransferResult(*fields))
            self.stats.record([out[-1]])
        return out

    def _follower_addresses(self) -> list[str]:
        """The followers' receiver addresses, in rank order (they come first on the queue)."""
        if self.tp is None:
            return []
        addresses, deadline = {}, time.monotonic() + ADDRESS_TIMEOUT_S
        while len(addresses) < self.tp_size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"TP followers reported {len(addresses)} of {self.tp_size - 1} KV "
                                   f"receiver addresses within {ADDRESS_TIMEOUT_S} s")
            _, rank, address = self.reports.get(timeout=remaining)
            addresses[rank] = address
        return [addresses[r] for r in range(1, self.tp_size)]

    @property
    def alive(self) -> bool:
        return self.part.io.alive

    @property
    def error(self):
        return self.part.io.error

    def close(self) -> None:
        self.part.close()


def connector(config: TransferConfig, core) -> TPConnector:
    """The worker's connector, once its EngineCore (and TP followers, built with
    tp_follower_io=functools.partial(follower_io, config)) is up."""
    return TPConnector(config, core)


# ---- a follower's part -------------------------------------------------------------------------
class FollowerIO:
    """A follower rank's part, and a thread forwarding its results to rank 0.

    A follower whose KV I/O thread has died (or whose results cannot reach rank 0) ends its
    process with status 1: rank 0 then sees an exited rank and its worker exits, rather than
    staying registered while this rank's part of every transfer times out."""

    def __init__(self, core, config: TransferConfig, rank: int, results):
        self.rank, self.results = rank, results
        self.part = _rank_part(core, config, rank)
        self.io = self.part.io
        if config.role == "decode":
            results.put(("address", rank, self.part.receiver.address))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._forward, name="tp-results", daemon=True)
        self._thread.start()

    def send_layers(self, sends: list[KVSend], layer: int) -> None:
        """The forward's per-layer hook for a plan's KV sends (prefill)."""
        if isinstance(self.part, PrefillRank):
            self.part.send_layers(sends, layer)

    def call(self, name: str, request_id: str, *args) -> None:
        """What rank 0 runs on every follower: expect (decode) or cancel."""
        if name == "expect":
            self.part.expect(request_id, *args)
        elif name == "cancel":
            self.part.cancel(request_id)

    def _forward(self) -> None:
        try:
            while not self._stop.wait(0.001):
                if not self.io.alive and not self._stop.is_set():
                    raise RuntimeError(f"the KV I/O thread died: {self.io.error}")
                for r in self.part.poll():
                    self.results.put(("result", self.rank, r.request_id, r.ok, r.error,
                                      r.num_bytes, r.seconds), timeout=PUT_TIMEOUT_S)
        except Exception:
            logger.exception("TP rank %d cannot hand off KV: exiting", self.rank)
            logging.shutdown()
            os._exit(1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.part.close()


def follower_io(config: TransferConfig, executor, rank: int, results) -> FollowerIO:
    """A follower rank's part, built in its process (EngineCore's tp_follower_io, bound to a
    config with functools.partial)."""
    return FollowerIO(executor, config, rank, results)
