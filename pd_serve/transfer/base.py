"""What every KV transfer backend shares: results, errors, stats and the data-plane interface.

A transfer moves layers [a, b) of some pages of the sender's (prefill) pool into pages the
receiver (decode) has reserved for that request id. Control messages (handshake, chunk headers,
acks) always travel over the connector's zmq socket; a backend's data plane only moves bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import itertools
import os
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.protocol import KVChunk

BACKENDS = ("torch", "ipc", "tcp", "nixl")
TRACE = os.environ.get("PD_SERVE_TRANSFER_TRACE", "0") not in ("", "0")


def enter_io_thread(device: torch.device) -> None:
    """Set up a transfer I/O thread: its device on CUDA; on CPU, its tensor ops on one thread.

    On CPU the I/O thread's page copies would start an OpenMP team of their own. libgomp,
    then managing more threads than there are CPUs, lets every team's idle threads spin
    100 times instead of 300,000 before sleeping, so the forward's threads sleep between
    its ops and each op waits for a wake-up: a 16-row decode step on 2 cores went from 73
    to 107 ms. A team of one (omp_set_num_threads(1), which holds for the calling thread
    only) starts no threads; the copies are memory-bound and small beside a step."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return
    set_threads = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)  # torch's OpenMP
    if set_threads is not None:
        set_threads(1)


class TransferError(RuntimeError):
    """A pair cannot work (layout mismatch, backend unavailable) or a transfer failed."""


@dataclass
class TransferResult:
    request_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0


class TransferStats:
    """Counters and a latency histogram, in their own registry (one per connector) so a worker
    can expose them on /metrics."""

    def __init__(self, role: str, backend: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = dict(role=role, backend=backend)
        self.bytes = Counter("pd_serve:kv_transfer_bytes", "KV bytes moved", list(labels),
                             registry=self.registry).labels(**labels)
        self.transfers = Counter("pd_serve:kv_transfers", "KV transfers completed", list(labels),
                                 registry=self.registry).labels(**labels)
        self.failures = Counter("pd_serve:kv_transfer_failures", "KV transfers failed",
                                list(labels), registry=self.registry).labels(**labels)
        self.seconds = Histogram(
            "pd_serve:kv_transfer_seconds", "KV transfer latency per request", list(labels),
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
            registry=self.registry).labels(**labels)

    def record(self, results: list[TransferResult]) -> None:
        ok = [r for r in results if r.ok]
        if ok:
            self.transfers.inc(len(ok))
            self.bytes.inc(sum(r.num_bytes for r in ok))
            for r in ok:
                self.seconds.observe(r.seconds)
        if len(ok) < len(results):
            self.failures.inc(len(results) - len(ok))


_SETTINGS = {"dtype": "the KV cache dtype: start both with the same --kv-cache-dtype (and --dtype)",
             "page_size": "--page-size"}


def layout_mismatch(ours: KVLayout, theirs: dict) -> str:
    """'' when the layouts match, else a sentence naming every differing field (theirs != ours),
    with the setting behind it. Scales are compared only when the dtypes agree."""
    diffs = []
    for key, value in asdict(ours).items():
        other = theirs.get(key)
        other = tuple(other) if isinstance(other, list) else other  # msgpack sends lists
        if other == value:
            continue
        if key in ("k_scales", "v_scales"):
            if theirs.get("dtype") == ours.dtype:
                diffs.append(_scales_mismatch(key, other or (), value))
            continue
        hint = f" ({_SETTINGS[key]})" if key in _SETTINGS else ""
        diffs.append(f"{key} {other!r} != {value!r}{hint}")
    return "; ".join(diffs)


def _scales_mismatch(key: str, theirs: tuple, ours: tuple) -> str:
    where = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
    what = (f"layer {where}: {theirs[where]!r} != {ours[where]!r}" if where is not None
            else f"{len(theirs) or 'no'} scales != {len(ours) or 'no'} scales")
    return (f"{key} differ ({what}; FP8 KV scales come from the checkpoint: serve the same "
            "--model on both)")


class PageIds:
    """Page ids to a device without a host sync and without page-locked memory allocated per
    call (a fresh pinned tensor costs 23-331 us of host time on the H200 host, growing with the
    ids). On CUDA the ids are written into one of `slots` reused page-locked buffers, which a
    non-blocking copy on the current stream reads; a buffer is written again only once that copy
    has run, so at most `slots` uploads are in flight."""

    def __init__(self, device: torch.device, slots: int = 16):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def stage(self, *parts: list[int]) -> torch.Tensor:
        """The parts back to back in a page-locked int32 tensor (CUDA only); call `sent()` once
        the copy that reads it is queued on the current stream."""
        slot = self._next
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # its last copy has run
        size = sum(len(p) for p in parts)
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[slot] = torch.empty(max(size, 1024), dtype=torch.int32,
                                                       pin_memory=True)
        values, start = buffer.numpy(), 0
        for part in parts:
            values[start:start + len(part)] = part
            start += len(part)
        return buffer[:size]

    def sent(self) -> None:
        slot = self._next
        if self._events[slot] is None:
            self._events[slot] = torch.cuda.Event()
        self._events[slot].record(torch.cuda.current_stream(self.device))
        self._next = (slot + 1) % len(self._buffers)

    def to_device(self, page_ids: list[int]) -> torch.Tensor:
        """The ids as a tensor on the device (int32 on CUDA, queued on the current stream;
        int64 on CPU)."""
        if self.device.type != "cuda":
            return torch.tensor(page_ids, dtype=torch.int64)
        out = self.stage(page_ids).to(self.device, non_blocking=True)
        self.sent()
        return out


def on_stream(stream: torch.cuda.Stream | None):
    """`with on_stream(s):` makes s the current stream; a no-op for None (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def staging_shape(layout: KVLayout, num_pages: int, layer_start: int, layer_end: int,
                  heads: tuple[int, int] | None = None) -> tuple:
    num_heads = layout.num_kv_heads if heads is None else heads[1] - heads[0]
    return (layer_end - layer_start, layout.num_planes, num_pages, layout.page_size, num_heads,
            layout.head_dim)


def head_range(heads: list[int]) -> tuple[int, int] | None:
    """A chunk's src_heads / dst_heads as a range; None ([]) is every head."""
    return (heads[0], heads[1]) if heads else None


class ReceiverPlane(ABC):
    """The receiving half of a backend's data plane; called from the receiver's I/O thread.

    GPU work goes on the plane's own streams and is only queued: `receive` returns once the
    writes are enqueued (or held to go out with others at `flush`), `mark` records an event
    after every write queued so far, and `synchronize` waits until they have all landed.
    """

    def __init__(self, pool: KVPool, timeout_s: float):
        self.pool = pool
        self.timeout_s = timeout_s
        self.device = pool.buffer.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.page_ids = PageIds(self.device)

    def peer_error(self, hello_info: dict) -> str:
        """Why this backend cannot pair with the sender that sent hello_info ("" if it can)."""
        return ""

    def welcome_info(self, sender_id: str, hello_info: dict) -> dict:
        """Backend facts the sender needs (sent in TransferWelcome)."""
        return {}

    def after_welcome(self, sender_id: str, hello_info: dict) -> None:
        """Finish pairing once the welcome is sent (e.g. join the pair's process group)."""

    @abstractmethod
    def receive(self, sender_id: str, chunk: KVChunk, frames: list,
                dst_page_ids: list[int] | None) -> None:
        """Move the chunk's data into pages `dst_page_ids` of the pool (layers of the chunk),
        or, when None (the chunk is refused), consume it and write nothing. Must consume the
        data either way, or the pair falls out of step."""

    def flush(self) -> None:
        """Queue the writes `receive` held back (a plane that merges chunks into one copy)."""

    def mark(self) -> torch.cuda.Event | None:
        """An event after every write queued so far; None when they are already done (CPU).
        Any object with an event's `query()` (True once those writes have ended) serves."""
        return self.stream.record_event() if self.stream is not None else None

    def failed(self) -> dict[str, str]:
        """Requests whose queued writes failed since the last call: request id -> why. A write
        fails only where the plane moves data itself after `receive` (nixl reads); once a mark
        has passed, the failures of the writes before it are here."""
        return {}

    def synchronize(self) -> None:
        """Block until every write queued so far (by `receive` and `flush`) is in the pool."""
        if self.stream is not None:
            self.stream.synchronize()

    def drop_sender(self, sender_id: str) -> None:
        """Forget a sender (it failed or left)."""

    def close(self) -> None:
        pass


class SenderPlane(ABC):
    """The sending half of a backend's data plane; called from the sender's I/O thread.

    A chunk goes out as prepare() -> header (with prepare's frames) -> finish(). `ready` is the
    event recorded after the compute that wrote the pages (None on CPU): nothing may read the
    pages before it has passed.
    """

    sends_src_page_ids = False  # does the receiver need the source page ids (ipc)?
    # Must the pages' compute be done before the header goes (ipc: the receiver reads them at
    # once)? Then the sender waits on the host, once a group, and prepare() gets ready=None.
    waits_on_host = False
    chunked = True  # a request goes out in chunks, so moving one overlaps preparing the next

    def __init__(self, pool: KVPool, timeout_s: float):
        self.pool = pool
        self.timeout_s = timeout_s
        self.device = pool.buffer.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.page_ids = PageIds(self.device)

    def hello_info(self) -> dict:
        return {"device_uuid": device_uuid(self.device)}

    def connect(self, peer: str, welcome_info: dict) -> None:
        """Pair with a receiver after its welcome."""

    @abstractmethod
    def prepare(self, peer: str, chunk: KVChunk, src_page_ids: list[int],
                ready: torch.cuda.Event | None) -> list:
        """Before the header is sent: return the frames that travel with it."""

    def finish(self, peer: str, chunk: KVChunk, src_page_ids: list[int],
               ready: torch.cuda.Event | None) -> None:
        """After the header is sent: move the data out of band (torch) if this backend does."""

    def drop_peer(self, peer: str) -> None:
        pass

    def close(self) -> None:
        pass


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID (the same GPU seen from two processes), or "" on CPU."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def now() -> float:
    return time.monotonic()


class Deadlines:
    """Records with deadlines, the expired ones found without a scan of them all (a heap).

    An entry stays until its deadline comes, even once the caller has dropped its record:
    `expired` returns only the keys whose record the caller still holds, the same object."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any, Any]] = []
        self._order = itertools.count()  # equal deadlines: arrival order, keys never compared

    def add(self, key: Any, record: Any, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), key, record))

    def expired(self, t: float, held: dict) -> list:
        """The keys of `held` whose record (as added) has a deadline before t."""
        keys = []
        while self._heap and self._heap[0][0] < t:
            _, _, key, record = heapq.heappop(self._heap)
            if held.get(key) is record:
                keys.append(key)
        return keys

    def __len__(self) -> int:
        return len(self._heap)


def trace(role: str, request_id: str, start: float, **marks: float) -> None:
    """With PD_SERVE_TRANSFER_TRACE=1, one stderr line per chunk: `start` as absolute monotonic
    microseconds (comparable across processes of one host), then each mark's microseconds
    after it, in the order given."""
    if TRACE:
        phases = " ".join(f"{k}={(t - start) * 1e6:.0f}" for k, t in marks.items())
        sys.stderr.write(f"[transfer-trace] {role} {request_id} t0={start * 1e6:.0f} {phases}\n")
