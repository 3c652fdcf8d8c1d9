"""The KV hand-off of tensor-parallel workers: every rank moves its own KV heads.

A TP worker's ranks each keep the KV heads they compute in their own pool (the same page ids on
every rank). So every rank of a prefill worker has a sender, every rank of a decode worker a
receiver, and each prefill rank sends the heads a decode rank needs straight to that rank
(transfer/heads.py: routes), in the same batched chunks as without TP; equal TP sizes pair rank
i with rank i, all heads. Rank 0 (the worker) drives its followers through the TP group
(engine/tp_group.py): prefill followers send a plan's KV sends from inside their forward, like
rank 0; decode followers expect and cancel when rank 0 calls them to. Followers report their transfers' results
to rank 0 on a queue; rank 0 counts a request's parts (one per route) and decides.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass, replace

from pd_serve.engine.plan import KVSend
from pd_serve.transfer.base import TransferResult
from pd_serve.transfer.heads import head_routes

logger = logging.getLogger(__name__)

PUT_TIMEOUT_S = 30.0  # a follower waits this long for room on it (rank 0 drains it every tick)


@dataclass(frozen=True)
class HandoffSpec:
    """What a follower needs to build its half (picklable: it travels to the follower)."""

    role: str  # "prefill" | "decode"
    backend: str
    timeout_s: float
    worker_id: str
    host: str = "127.0.0.1"  # decode: where the receivers bind
    layer_groups: int = 1  # prefill: --transfer-layer-groups
    cluster_key: bytes = b""  # HMAC key of every KV message (b"": none)


def model_layout(core):
    """The pool's layout with every KV head of the model: what TP ranks announce and match on."""
    return replace(core.kv_pool.layout, num_kv_heads=core.model_config.num_kv_heads)


def group_ends(num_layers: int, groups: int) -> dict[int, int]:
    """Layer index after which each layer group is complete (e.g. 32 layers, 4 groups:
    7, 15, 23, 31) -> group number."""
    groups = min(groups, num_layers)
    return {round(num_layers * (g + 1) / groups) - 1: g for g in range(groups)}


class PrefillRank:
    """One prefill rank's sender, and the routes from this rank to each decode TP size."""

    def __init__(self, core, spec: HandoffSpec, rank: int, tp: int):
        from pd_serve.transfer.sender import KVSender
        self.rank, self.tp = rank, tp
        self.num_kv_heads = core.model_config.num_kv_heads
        self.local_heads = core.kv_pool.layout.num_kv_heads
        sender_id = spec.worker_id if rank == 0 else f"{spec.worker_id}/tp{rank}"
        self.sender = KVSender(core.kv_pool, spec.backend, sender_id=sender_id,
                               timeout_s=spec.timeout_s, model_layout=model_layout(core),
                               key=spec.cluster_key)
        self.group_ends = group_ends(core.kv_pool.layout.num_layers, spec.layer_groups)

    def routes(self, decode_tp: int) -> tuple:
        return head_routes(self.tp, decode_tp, self.num_kv_heads)

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
                self.sender.send(send.request_id, send.addresses[route.dst_rank], send.src_page_ids,
                                 send.dst_page_ids, start, layer + 1, last, heads, parts, ready)

    def poll(self) -> list[TransferResult]:
        return self.sender.poll()

    def call(self, name: str, request_id: str, *args) -> None:
        if name == "abort":
            self.sender.abort(request_id)

    def close(self) -> None:
        self.sender.close()


class DecodeRank:
    """One decode rank's receiver (rank 0's binds the worker's --port; followers' any port)."""

    def __init__(self, core, spec: HandoffSpec, rank: int, port: int = 0):
        from pd_serve.transfer.receiver import KVReceiver
        self.receiver = KVReceiver(core.kv_pool, spec.backend, host=spec.host, port=port,
                                   timeout_s=spec.timeout_s, model_layout=model_layout(core),
                                   key=spec.cluster_key)

    def poll(self) -> list[TransferResult]:
        return self.receiver.poll()

    def call(self, name: str, request_id: str, *args) -> None:
        if name == "expect":
            self.receiver.expect(request_id, *args)
        elif name == "cancel":
            self.receiver.cancel(request_id)

    def close(self) -> None:
        self.receiver.close()


class Follower:
    """A follower rank's half, and a thread forwarding its results to rank 0.

    A follower whose KV I/O thread has died (or whose results cannot reach rank 0) ends its
    process with status 1: rank 0 then sees an exited rank and its worker exits, rather than
    staying registered while this rank's part of every transfer times out."""

    def __init__(self, core, spec: HandoffSpec, rank: int, results):
        self.rank, self.results = rank, results
        if spec.role == "prefill":
            self.half = PrefillRank(core, spec, rank, core.tp.size)
            self.io = self.half.sender
        else:
            self.half = DecodeRank(core, spec, rank)
            self.io = self.half.receiver
            results.put(("address", rank, self.half.receiver.address))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._forward, name="tp-results", daemon=True)
        self._thread.start()

    def send_layers(self, sends: list[KVSend], layer: int) -> None:
        """The forward's per-layer hook for a plan's KV sends (prefill)."""
        if isinstance(self.half, PrefillRank):
            self.half.send_layers(sends, layer)

    def call(self, name: str, request_id: str, *args) -> None:
        self.half.call(name, request_id, *args)

    def _forward(self) -> None:
        try:
            while not self._stop.wait(0.001):
                if not self.io.alive and not self._stop.is_set():
                    raise RuntimeError(f"the KV I/O thread died: {self.io.error}")
                for r in self.half.poll():
                    self.results.put(("result", self.rank, r.request_id, r.ok, r.error,
                                      r.num_bytes, r.seconds), timeout=PUT_TIMEOUT_S)
        except Exception:
            logger.exception("TP rank %d cannot hand off KV: exiting", self.rank)
            logging.shutdown()
            os._exit(1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.half.close()


def follower(spec: HandoffSpec, executor, rank: int, results) -> Follower:
    """A follower rank's half, built in its process (EngineCore's tp_follower_io, bound to a
    spec with functools.partial)."""
    return Follower(executor, spec, rank, results)


def drain(results, stats, limit: int = 4096) -> list[tuple[int, TransferResult]]:
    """Rank 0: the (rank, result) of every transfer the followers finished since the last
    call (without waiting); each is also recorded in `stats`, so the followers' parts count in
    the worker's /metrics."""
    out = []
    while len(out) < limit:
        try:
            _, rank, *fields = results.get_nowait()
        except queue.Empty:
            break
        out.append((rank, TransferResult(*fields)))
        stats.record([out[-1][1]])
    return out
