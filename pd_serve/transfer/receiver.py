"""The decode side of KV transfer: accepts senders, writes their chunks into reserved pages.

Invariant: a chunk is written only into the pages that expect() reserved for its request id;
a chunk for any other id (never reserved, cancelled, timed out) is consumed and refused. And a
request's pages are handed back to the caller (its result, or cancel() returning) only once no
write into them is still queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from pd_serve import protocol
from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.protocol import (KVChunk, KVChunks, TransferAbort, TransferAcks, TransferHello,
                               TransferWelcome)
from pd_serve.transfer.backends import make_receiver_plane
from pd_serve.transfer.base import (TRACE, Deadlines, TransferResult, TransferStats,
                                    layout_mismatch, now, trace)

logger = logging.getLogger(__name__)


@dataclass
class _Incoming:
    page_ids: list[int]
    deadline: float
    started: float = field(default_factory=now)
    num_bytes: int = 0  # > 0: writes queued
    next_page: dict[str, int] = field(default_factory=dict)  # per sender: where its next chunk starts
    parts: int = 0  # senders that each send part of the KV heads (their chunks say; 0: none yet)
    landed: int = 0  # parts whose last chunk's writes have landed


@dataclass
class _Landing:
    """Last chunks whose writes were queued before `event` (None: already done)."""
    event: torch.cuda.Event | None
    requests: list[tuple[bytes, str]]  # (sender identity, request id)
    marked: float  # when the event was recorded


class KVReceiver:
    """Listens on `address`; expect() a request's pages, then poll() for its TransferResult.

    Every expected request ends in exactly one result: ok, refused, aborted by the sender, or
    timed out. After a failed result the caller frees the pages; nothing else touches them.
    A request may come in parts from several senders (prefill ranks of another TP size, each
    with some of the KV heads; their chunks say how many): it is ok once every part has landed,
    each sender acknowledged for its own part.

    The I/O thread takes one message at a time and queues the writes of its chunks together
    (the plane may merge them into one copy; while QUEUED_BATCHES such batches are still
    landing, new chunks wait and join the next, so batches grow when the device is the
    bottleneck), and acknowledges a request once the writes of its last chunk have landed,
    checked without blocking between messages, so acknowledgements go out while later messages
    wait. (Taking every message waiting, up to 64, before queueing and acknowledging any made
    the pair take turns: KVSender's MESSAGE_DEPTH has the figures.) While writes are landing it
    busy-polls; between the chunks of a request too for up to `spin_s` after a chunk (default 0:
    never; a spinning thread holds the GIL that the process's other threads, a decode engine's,
    need).
    """

    QUEUED_BATCHES = 2  # batches of writes queued on the device at a time

    def __init__(self, pool: KVPool, backend: str = "tcp", host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 30.0, stats: TransferStats | None = None,
                 spin_s: float = 0.0, model_layout: KVLayout | None = None):
        """model_layout: the layout senders must announce, with every KV head of the model (a
        tensor-parallel rank's pool holds some of them); default: the pool's."""
        self.pool = pool
        self.model_layout = model_layout or pool.layout
        self.spin_s = spin_s
        self._spin_until = 0.0
        self.backend = backend
        self.timeout_s = timeout_s
        self.stats = stats or TransferStats("recv", backend)
        self.plane = make_receiver_plane(backend, pool, timeout_s, host)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._lock = threading.Lock()
        self._expected: dict[str, _Incoming] = {}
        self._deadlines = Deadlines()  # of the _expected records
        self._results: list[TransferResult] = []
        self._landing: deque[_Landing] = deque()  # I/O thread only
        self._batch: list[tuple[str, str]] = []  # (sender id, request id): writes not yet queued
        self._batch_last: list[tuple[bytes, str]] = []  # (sender identity, request id)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) -------------------------------------------------------
    def expect(self, request_id: str, page_ids: list[int], timeout_s: float | None = None) -> None:
        """The request's pages are reserved: its KV may now be written into them."""
        with self._lock:
            if request_id in self._expected:
                raise ValueError(f"request {request_id!r} is already expected")
            incoming = _Incoming(list(page_ids), now() + (timeout_s or self.timeout_s))
            self._expected[request_id] = incoming
            self._deadlines.add(request_id, incoming, incoming.deadline)

    def cancel(self, request_id: str) -> None:
        """Stop expecting (the request was aborted here); late data is refused. No result.
        On return nothing writes into its pages any more: the caller may free them."""
        with self._lock:
            incoming = self._expected.pop(request_id, None)
            if incoming is not None and incoming.num_bytes:
                self._settle()

    def poll(self) -> list[TransferResult]:
        with self._lock:
            self._expire()
            results, self._results = self._results, []
        return results

    @property
    def num_expected(self) -> int:
        with self._lock:
            return len(self._expected)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.plane.close()

    # ---- I/O thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        if self.pool.buffer.is_cuda:
            torch.cuda.set_device(self.pool.buffer.device)
        next_expiry = 0.0
        try:
            while not self._stop.is_set():
                busy = bool(self._landing) or now() < self._spin_until
                if self._sock.poll(0 if busy else 20, zmq.POLLIN):
                    self._take_message()
                elif self._landing:
                    time.sleep(0)  # let other threads of the process run while we wait
                self._land()
                self._queue_batch()
                if now() >= next_expiry:
                    next_expiry = now() + 0.005
                    with self._lock:
                        self._expire()
        finally:
            self._sock.close()

    def _take_message(self) -> None:
        """Handle one waiting message (if any); its chunks' writes join the pending batch."""
        try:
            identity, header, *frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        arrived = now()
        identity = bytes(identity)
        sender_id = identity.decode(errors="replace")
        try:
            msg = protocol.decode(header.bytes)
            chunks = self._split(msg, frames) if isinstance(msg, KVChunks) else []
        except (ValueError, TypeError) as e:  # a broken sender: its requests time out
            logger.warning("dropped a message from %s: %s", sender_id, e)
            return
        if isinstance(msg, TransferHello):
            self._welcome(identity, sender_id, msg)
        elif isinstance(msg, KVChunks):
            refused = []
            for chunk, chunk_frames in chunks:
                if self._on_chunk(sender_id, chunk, chunk_frames, arrived, refused):
                    self._batch.append((sender_id, chunk.request_id))
                    if chunk.last:
                        self._batch_last.append((identity, chunk.request_id))
            if refused:
                self._send(identity, TransferAcks(refused))
        elif isinstance(msg, TransferAbort):
            self._fail(msg.request_id, f"sender aborted: {msg.reason}")

    def _queue_batch(self) -> None:
        """Queue the pending batch's writes together (the plane may merge them into one copy);
        its last chunks then wait in `_landing` for their writes. Only while fewer than
        QUEUED_BATCHES batches are landing: chunks that come meanwhile join the batch, so when
        the GPU is the bottleneck the copies grow instead of queueing up one per message (each
        copy costs a launch and a ramp of the link)."""
        if not self._batch or len(self._landing) >= self.QUEUED_BATCHES:
            return
        batch, last_chunks = self._batch, self._batch_last
        self._batch, self._batch_last = [], []
        taken = now()
        with self._lock:
            try:
                self.plane.flush()
                flushed = now()
                event = self.plane.mark()
            except Exception as e:  # the writes did not go out: fail every request they serve
                logger.warning("queueing KV writes failed: %s", e)
                for sender_id, request_id in batch:
                    self.plane.drop_sender(sender_id)
                    self._fail_locked(request_id, f"receive failed: {e}")
                return
        if TRACE:
            trace("batch", f"{len(batch)}-chunks", taken, flushed=flushed, marked=now())
        if last_chunks:
            self._landing.append(_Landing(event, last_chunks, now()))

    def _land(self) -> None:
        """Acknowledge the last chunks whose writes have landed, oldest first."""
        while self._landing and (self._landing[0].event is None or self._landing[0].event.query()):
            landing = self._landing.popleft()
            landed = now()
            acks: dict[bytes, list[list]] = {}  # one message per sender
            with self._lock:
                done = []
                for identity, request_id in landing.requests:
                    incoming = self._expected.get(request_id)
                    if incoming is not None:
                        incoming.landed += 1
                        if incoming.landed == incoming.parts:
                            done.append(self._result(request_id, ok=True))
                    # not expected: cancelled or timed out here while landing
                    acks.setdefault(identity, []).append(
                        [request_id, True, ""] if incoming is not None
                        else [request_id, False, "cancelled by the receiver"])
                self._publish(done)
            for identity, triples in acks.items():
                self._send(identity, TransferAcks(triples))
            if TRACE:
                for _, request_id in landing.requests:
                    trace("land", request_id, landing.marked, landed=landed, acked=now())

    def _welcome(self, sender: bytes, sender_id: str, hello: TransferHello) -> None:
        error = ""
        if hello.backend != self.backend:
            error = f"backend mismatch: sender uses {hello.backend!r}, receiver {self.backend!r}"
        elif diff := layout_mismatch(self.model_layout, hello.layout):
            error = f"KV layout mismatch (sender vs receiver): {diff}"
        else:
            error = self.plane.peer_error(hello.info)
        info = {} if error else self.plane.welcome_info(sender_id, hello.info)
        self._send(sender, TransferWelcome(ok=not error, error=error, info=info))
        if error:
            logger.warning("refused sender %s: %s", sender_id, error)
            return
        try:
            self.plane.after_welcome(sender_id, hello.info)
        except Exception as e:  # the sender died while pairing, or its group timed out
            logger.warning("pairing with %s failed: %s", sender_id, e)
            self.plane.drop_sender(sender_id)

    @staticmethod
    def _split(msg: KVChunks, frames: list) -> list[tuple[KVChunk, list]]:
        """The message's chunks, each with its own data frames."""
        if len(msg.chunks) != len(msg.frames) or sum(msg.frames) != len(frames):
            raise ValueError(f"KVChunks names {len(msg.chunks)} chunks with frame counts "
                             f"{msg.frames} but carries {len(frames)} frames")
        out, start = [], 0
        for fields, count in zip(msg.chunks, msg.frames):
            out.append((KVChunk(**fields), frames[start:start + count]))
            start += count
        return out

    def _on_chunk(self, sender_id: str, chunk: KVChunk, frames: list, arrived: float,
                  refused: list[list]) -> bool:
        """Check the chunk and queue its writes; True when they were queued. A refused chunk
        is consumed and its request (if expected) fails; its ack goes into `refused`."""
        # The lock spans check and queueing, so cancel() cannot free the pages in between.
        with self._lock:
            checked = now()
            incoming = self._expected.get(chunk.request_id)
            error = self._check(incoming, chunk, sender_id, self.pool.layout.num_kv_heads)
            try:
                self.plane.receive(sender_id, chunk, frames, None if error else chunk.dst_page_ids)
            except Exception as e:  # the data did not arrive: the pair is broken
                self.plane.drop_sender(sender_id)
                error = f"receive failed: {e}"
            queued = now()
            if incoming is not None and not error:
                incoming.num_bytes += chunk.nbytes
            if incoming is not None and error:
                self._fail_locked(chunk.request_id, error)
        if error:
            refused.append([chunk.request_id, False, error])
        elif not chunk.last:
            self._spin_until = now() + self.spin_s  # the next chunk is on its way
        if TRACE:
            trace("recv", chunk.request_id, arrived, checked=checked, queued=queued)
        return not error

    @staticmethod
    def _check(incoming: _Incoming | None, chunk: KVChunk, sender_id: str, num_heads: int) -> str:
        """'' when the chunk may be written: its request is expected, its heads are ours, and
        its destination pages are the next run of the reserved pages in its sender's part (a
        request's pages may come in several chunks, in order, for each layer group); else why
        not. Advances the sender's position."""
        if incoming is None:
            return "not expected here (never reserved, cancelled or timed out)"
        if chunk.dst_heads and not 0 <= chunk.dst_heads[0] < chunk.dst_heads[1] <= num_heads:
            return f"KV heads {chunk.dst_heads} outside this pool's {num_heads}"
        if chunk.parts != (incoming.parts or chunk.parts) or chunk.parts < 1:
            return f"chunk says {chunk.parts} parts, an earlier one {incoming.parts}"
        incoming.parts = chunk.parts
        if len(incoming.next_page) == incoming.parts and sender_id not in incoming.next_page:
            return f"a part from one sender too many (expected {incoming.parts})"
        start = incoming.next_page.get(sender_id, 0)
        end = start + len(chunk.dst_page_ids)
        if chunk.dst_page_ids != incoming.page_ids[start:end]:
            return "destination pages differ from the pages reserved for it"
        incoming.next_page[sender_id] = 0 if end == len(incoming.page_ids) else end
        if chunk.last and incoming.next_page[sender_id]:
            return "the last chunk leaves reserved pages unwritten"
        return ""

    def _send(self, identity: bytes, msg) -> None:
        self._sock.send_multipart([identity, protocol.encode(msg)])

    # ---- bookkeeping (lock held) ----------------------------------------------------------
    def _fail(self, request_id: str, error: str) -> None:
        with self._lock:
            self._fail_locked(request_id, error)

    def _fail_locked(self, request_id: str, error: str) -> None:
        incoming = self._expected.get(request_id)
        if incoming is None:
            return
        if incoming.num_bytes:
            self._settle()
        self._finish(request_id, ok=False, error=error)

    def _expire(self) -> None:
        t = now()
        for request_id in self._deadlines.expired(t, self._expected):
            self._fail_locked(request_id, "timed out waiting for KV")

    def _settle(self) -> None:
        """Every write queued so far has landed (before pages go back to the caller)."""
        try:
            self.plane.flush()
        except Exception as e:  # what failed to queue never lands
            logger.warning("queueing KV writes failed: %s", e)
        self.plane.synchronize()

    def _finish(self, request_id: str, ok: bool, error: str = "") -> None:
        self._publish([self._result(request_id, ok, error)])

    def _result(self, request_id: str, ok: bool, error: str = "") -> TransferResult:
        incoming = self._expected.pop(request_id)
        return TransferResult(request_id, ok, error, incoming.num_bytes, now() - incoming.started)

    def _publish(self, results: list[TransferResult]) -> None:
        if results:
            self.stats.record(results)
            self._results.extend(results)
