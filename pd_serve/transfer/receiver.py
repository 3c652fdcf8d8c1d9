"""The decode side of KV transfer: accepts senders, writes their chunks into reserved pages.

Invariant: a chunk is written only into the pages that expect() reserved for its request id;
a chunk for any other id (never reserved, cancelled, timed out) is consumed and refused. And a
request's pages are handed back to the caller (its result, or cancel() returning) only once no
write into them is still queued.

Every message is input from the network: one that is not ours (undecodable, ill-typed, without
the cluster key's tag, frames that do not add up, pages, layers or heads out of range) is
dropped, counted in pd_serve:protocol_errors_total{socket="kv-receiver"} and logged, and the
I/O thread goes on. If the thread dies anyway (a bug), `alive` turns false and `error` says why.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from pd_serve import protocol
from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.ports import bind_zmq
from pd_serve.protocol import (KVChunk, KVChunks, TransferAbort, TransferAck, TransferAcks,
                               TransferHello, TransferWelcome)
from pd_serve.transfer.backends import make_receiver_plane
from pd_serve.transfer.base import (TRACE, Deadlines, TransferResult, TransferStats,
                                    enter_io_thread, head_range, layout_mismatch, now, trace)

logger = logging.getLogger(__name__)

SOCKET = "kv-receiver"  # the protocol-error counter's label
# zmq drops a peer that sends a frame larger than the pool's bytes plus this (room for a header
# frame): no chunk's data can be larger than the pages it fills.
HEADER_SLACK_BYTES = 2**20
MAX_ERROR_CHARS = 300  # of a peer's error text kept in a result
HELLO_MAX_BYTES = 2**16  # a TransferHello is a few hundred bytes: longer headers are never one


@dataclass
class _Incoming:
    page_ids: list[int]
    deadline: float  # for the first chunk, then (from each) for the next
    timeout_s: float  # how long the transfer may go without a chunk, from its first on
    started: float = field(default_factory=now)
    num_bytes: int = 0  # > 0: writes queued
    # per sender: (layer_start, layer_end, next page) of the layer group it is sending; a group
    # is done when the next page is 0 again
    position: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    parts: int = 0  # senders that each send part of the KV heads (their chunks say; 0: none yet)
    landed: int = 0  # parts whose last chunk's writes have landed


@dataclass
class _Landing:
    """Last chunks whose writes were queued before `event` (None: already done)."""
    event: torch.cuda.Event | None  # (or the plane's own mark with a query())
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
    wait. (Taking every waiting message before queueing and acknowledging any would make the
    pair take turns; KVSender's MESSAGE_DEPTH says why.) While writes are landing it
    busy-polls; between the chunks of a request too for up to `spin_s` after a chunk (default 0:
    never; a spinning thread holds the GIL that the process's other threads, a decode engine's,
    need).

    With a cluster `key`, every message must carry its tag: a peer without the key gets no
    welcome and writes nothing (its hello is answered with a refusal it cannot verify, so it
    fails at once rather than at its timeout).
    """

    QUEUED_BATCHES = 2  # batches of writes queued on the device at a time

    def __init__(self, pool: KVPool, backend: str = "tcp", host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 30.0, stats: TransferStats | None = None,
                 spin_s: float = 0.0, model_layout: KVLayout | None = None, key: bytes = b"",
                 advertise_host: str | None = None):
        """model_layout: the layout senders must announce, with every KV head of the model (a
        tensor-parallel rank's pool holds some of them); default: the pool's. key: the cluster
        key (b"": messages are not authenticated). host: where the socket binds (0.0.0.0: every
        interface); advertise_host: where senders reach it, in `address` (default: host)."""
        self.pool = pool
        self.codec = protocol.Codec(key)
        self.error = ""  # why the I/O thread died ("" while it has not)
        self.model_layout = model_layout or pool.layout
        self.spin_s = spin_s
        self._spin_until = 0.0
        self.backend = backend
        self.timeout_s = timeout_s
        self.stats = stats or TransferStats("recv", backend)
        reachable = advertise_host or host
        self.plane = make_receiver_plane(backend, pool, timeout_s, reachable)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, pool.num_bytes + HEADER_SLACK_BYTES)
        port = bind_zmq(self._sock, host, port, what="the KV receiver ")
        self.address = f"tcp://{reachable}:{port}"
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
    def expect(self, request_id: str, page_ids: list[int], timeout_s: float | None = None,
               wait_s: float | None = None) -> None:
        """The request's pages are reserved: its KV may now be written into them.

        timeout_s: how long the transfer may go without a chunk, from its first chunk on (a
        prefill sends a prompt's layer groups as its forward computes them; default: the
        receiver's); wait_s: how long its first chunk may take to come (default: timeout_s;
        math.inf: no limit here, because the caller bounds the reservation itself, as a decode
        worker does: the prompt may wait its turn on prefill, and the gateway's pings keep or
        drop it)."""
        timeout_s = timeout_s or self.timeout_s
        with self._lock:
            if request_id in self._expected:
                raise ValueError(f"request {request_id!r} is already expected")
            incoming = _Incoming(list(page_ids), now() + (timeout_s if wait_s is None else wait_s),
                                 timeout_s)
            self._expected[request_id] = incoming
            if math.isfinite(incoming.deadline):
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
    def alive(self) -> bool:
        """The I/O thread is running: not closed, not crashed (then `error` says why)."""
        return self._thread.is_alive() and not self.error

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
        next_expiry = 0.0
        try:
            enter_io_thread(self.pool.buffer.device)
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
        except BaseException as e:  # a bug, not input: say so, so the worker exits (alive)
            self.error = f"{type(e).__name__}: {e}"
            logger.exception("the KV receiver's I/O thread died")
        finally:
            self._sock.close()

    def _take_message(self) -> None:
        """Handle one waiting message (if any); its chunks' writes join the pending batch. One
        that is not ours is dropped, counted and logged: never the thread."""
        try:
            identity, header, *frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        identity = bytes(identity)
        text = identity.decode(errors="replace")
        if not text.isprintable():  # a peer that set no identity: ZMQ's binary one, in hex
            text = identity.hex()
        sender_id = text.rpartition("/")[0] or text  # "<sender id>/<random>" (sender.py)
        try:
            self._handle(identity, text, sender_id, header.bytes, frames)
        except Exception as e:  # what no check foresaw
            protocol.refused(SOCKET, f"a message from {sender_id} ({type(e).__name__}: {e})")
            logger.debug("the refused message's handling", exc_info=True)

    def _handle(self, identity: bytes, connection: str, sender_id: str, header: bytes,
                frames: list) -> None:
        """Dispatch one message by type; what the codec refuses goes no further, nor (under a
        cluster key) a message signed for another connection (protocol.KVChunks)."""
        arrived = now()
        msg = self.codec.receive(header, SOCKET, sender_id)
        if msg is None:
            if not frames:
                self._answer_unverified(identity, header)
        elif self.codec.key and getattr(msg, "connection", connection) != connection:
            protocol.refused(SOCKET, f"a {type(msg).__name__} on connection {connection!r} "
                                     f"signed for {msg.connection!r} (replayed)")
        elif isinstance(msg, KVChunks):
            self._on_chunks(identity, sender_id, msg, frames, arrived)
        elif frames:
            protocol.refused(SOCKET, f"a {type(msg).__name__} from {sender_id} with "
                                     f"{len(frames)} frames after it")
        elif isinstance(msg, TransferHello):
            self._welcome(identity, sender_id, msg)
        elif isinstance(msg, TransferAbort):
            self._on_abort(sender_id, msg)
        else:
            protocol.refused(SOCKET, f"a {type(msg).__name__} from {sender_id}: not for a receiver")

    def _on_chunks(self, identity: bytes, sender_id: str, msg: KVChunks, frames: list,
                   arrived: float) -> None:
        """Queue the writes of every chunk that passes its checks; ack the refused ones."""
        try:
            chunks = self._split(msg, frames)
        except ValueError as e:  # the chunks' data cannot be told apart: refuse them all
            protocol.refused(SOCKET, f"a message from {sender_id}: {e}")
            with self._lock:
                self.plane.drop_sender(sender_id)  # (out of step with it)
                for chunk in msg.chunks:
                    self._fail_locked(chunk.request_id, str(e))
            self._send(identity, TransferAcks([TransferAck(rid, False, str(e)) for rid in
                                               dict.fromkeys(c.request_id for c in msg.chunks)]))
            return
        refused = []
        for chunk, chunk_frames in chunks:
            if self._on_chunk(sender_id, chunk, chunk_frames, arrived, refused):
                self._batch.append((sender_id, chunk.request_id))
                if chunk.last:
                    self._batch_last.append((identity, chunk.request_id))
        if refused:
            self._send(identity, TransferAcks(refused))

    def _on_abort(self, sender_id: str, msg: TransferAbort) -> None:
        """Only a sender that sent part of the request may abort it."""
        with self._lock:
            incoming = self._expected.get(msg.request_id)
            if incoming is not None and sender_id in incoming.position:
                self._fail_locked(msg.request_id,
                                  f"sender aborted: {msg.reason[:MAX_ERROR_CHARS]}")

    def _answer_unverified(self, identity: bytes, header: bytes) -> None:
        """A hello refused for its key (none, or another) still gets an answer, one its sender
        cannot verify either, so it fails at once with a clear error instead of at its
        timeout. Anything else refused gets none; a header too long for a hello is not decoded
        (it costs its sender nothing and the receiver's I/O thread a full msgpack decode)."""
        if len(header) > HELLO_MAX_BYTES:
            return
        for body in (header, header[protocol.TAG_BYTES:]):
            try:
                if isinstance(protocol.decode(body), TransferHello):
                    self._send(identity, TransferWelcome(ok=False, error="cluster key mismatch"))
                    return
            except protocol.ProtocolError:
                pass

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
            acks: dict[bytes, list[TransferAck]] = {}  # one message per sender
            with self._lock:
                failed = self.plane.failed()  # those requests are no longer expected below
                for request_id, error in failed.items():
                    self._fail_locked(request_id, error)
                done = []
                for identity, request_id in landing.requests:
                    incoming = self._expected.get(request_id)
                    if incoming is not None:
                        incoming.landed += 1
                        if incoming.landed == incoming.parts:
                            done.append(self._result(request_id, ok=True))
                    # not expected: cancelled or timed out here while landing
                    acks.setdefault(identity, []).append(
                        TransferAck(request_id, True) if incoming is not None
                        else TransferAck(request_id, False,
                                         failed.get(request_id, "cancelled by the receiver")))
                self._publish(done)
            for identity, rows in acks.items():
                self._send(identity, TransferAcks(rows))
            if TRACE:
                for _, request_id in landing.requests:
                    trace("land", request_id, landing.marked, landed=landed, acked=now())

    def _welcome(self, sender: bytes, sender_id: str, hello: TransferHello) -> None:
        error = ""
        if hello.backend != self.backend:
            error = f"backend mismatch: sender uses {hello.backend!r}, receiver {self.backend!r}"
        elif error := layout_error(hello.layout):
            error = f"malformed hello: {error}"
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
        """The message's chunks, each with its own data frames (the codec checked that there
        is a count per chunk, none negative)."""
        if sum(msg.frames) != len(frames):
            raise ValueError(f"KVChunks names {len(msg.chunks)} chunks with frame counts "
                             f"{msg.frames[:16]} but carries {len(frames)} frames")
        out, start = [], 0
        for chunk, count in zip(msg.chunks, msg.frames):
            out.append((chunk, frames[start:start + count]))
            start += count
        return out

    def _on_chunk(self, sender_id: str, chunk: KVChunk, frames: list, arrived: float,
                  refused: list[TransferAck]) -> bool:
        """Check the chunk and queue its writes; True when they were queued. A refused chunk
        is consumed and its request (if expected) fails; its ack goes into `refused`."""
        # The lock spans check and queueing, so cancel() cannot free the pages in between.
        with self._lock:
            checked = now()
            incoming = self._expected.get(chunk.request_id)
            error = self._shape_error(chunk)
            if error:  # not a chunk any sender of this model makes
                protocol.refused(SOCKET, f"a chunk of {chunk.request_id!r} from {sender_id}: "
                                         f"{error}")
            else:
                error = self._check(incoming, chunk, sender_id)
            try:
                self.plane.receive(sender_id, chunk, frames, None if error else chunk.dst_page_ids)
            except Exception as e:  # the data did not arrive: the pair is broken
                self.plane.drop_sender(sender_id)
                error = f"receive failed: {e}"
            queued = now()
            if incoming is not None and not error:
                began = not incoming.num_bytes
                incoming.deadline = queued + incoming.timeout_s  # each chunk restarts the clock
                if began:  # (later ones: _expire re-arms the entry it finds early)
                    self._deadlines.add(chunk.request_id, incoming, incoming.deadline)
                incoming.num_bytes += chunk.nbytes
            if incoming is not None and error:
                self._fail_locked(chunk.request_id, error)
        if error:
            refused.append(TransferAck(chunk.request_id, False, error))
        elif not chunk.last:
            self._spin_until = now() + self.spin_s  # the next chunk is on its way
        if TRACE:
            trace("recv", chunk.request_id, arrived, checked=checked, queued=queued)
        return not error

    def _shape_error(self, chunk: KVChunk) -> str:
        """'' when the chunk's layers, heads, parts and size fit this pool, else why not."""
        layout = self.pool.layout
        heads = head_range(chunk.dst_heads) or (0, layout.num_kv_heads)
        if chunk.layer_end > layout.num_layers:
            return (f"layers [{chunk.layer_start}, {chunk.layer_end}) outside this pool's "
                    f"{layout.num_layers}")
        if not 0 <= heads[0] < heads[1] <= layout.num_kv_heads:
            return f"KV heads {chunk.dst_heads} outside this pool's {layout.num_kv_heads}"
        if chunk.parts > layout.num_kv_heads:  # a part carries at least one of our heads
            return f"{chunk.parts} parts for {layout.num_kv_heads} KV heads"
        # bytes of a page's K and V, of one layer and one head
        per_page = layout.bytes_per_page // (layout.num_layers * layout.num_kv_heads)
        nbytes = (len(chunk.dst_page_ids) * (chunk.layer_end - chunk.layer_start)
                  * (heads[1] - heads[0]) * per_page)
        if chunk.nbytes != nbytes:
            return f"{chunk.nbytes} bytes where its pages, layers and heads hold {nbytes}"
        return ""

    def _check(self, incoming: _Incoming | None, chunk: KVChunk, sender_id: str) -> str:
        """'' when the chunk may be written, else why not: its request is expected, and it
        continues its sender's part in order: layer group after layer group, each over the
        reserved pages in order (in one chunk or several). Advances the sender's position."""
        if incoming is None:
            return "not expected here (never reserved, cancelled or timed out)"
        if chunk.parts != (incoming.parts or chunk.parts):
            return f"chunk says {chunk.parts} parts, an earlier one {incoming.parts}"
        incoming.parts = chunk.parts
        if len(incoming.position) == incoming.parts and sender_id not in incoming.position:
            return f"a part from one sender too many (expected {incoming.parts})"
        group_start, group_end, start = incoming.position.get(sender_id, (0, 0, 0))
        if start == 0 and chunk.layer_start != group_end:
            return (f"layers [{chunk.layer_start}, {chunk.layer_end}) do not follow layer "
                    f"{group_end}")
        if start and (chunk.layer_start, chunk.layer_end) != (group_start, group_end):
            return (f"layers [{chunk.layer_start}, {chunk.layer_end}) in the middle of layer group "
                    f"[{group_start}, {group_end})")
        end = start + len(chunk.dst_page_ids)
        empty = start == end and incoming.page_ids  # a chunk without pages, for a request with some
        if chunk.dst_page_ids != incoming.page_ids[start:end] or empty:
            return "destination pages differ from the pages reserved for it"
        next_page = 0 if end == len(incoming.page_ids) else end
        incoming.position[sender_id] = (chunk.layer_start, chunk.layer_end, next_page)
        if chunk.last and next_page:
            return "the last chunk leaves reserved pages unwritten"
        num_layers = self.pool.layout.num_layers
        if chunk.last and chunk.layer_end != num_layers:
            return f"the last chunk leaves layers [{chunk.layer_end}, {num_layers}) unwritten"
        return ""

    def _send(self, identity: bytes, msg) -> None:
        self._sock.send_multipart([identity, self.codec.encode(msg)])

    # ---- bookkeeping (lock held) ----------------------------------------------------------
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
            incoming = self._expected.get(request_id)  # (a re-armed one may come up twice)
            if incoming is None:
                continue
            if incoming.deadline >= t:  # a chunk came since: the clock restarted then
                self._deadlines.add(request_id, incoming, incoming.deadline)
            else:
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


_LAYOUT_FIELDS = [f.name for f in dataclasses.fields(KVLayout)]


def layout_error(layout: dict) -> str:
    """Why a hello's layout is not a KVLayout's fields with their types ('' if it is), so that
    comparing it with ours cannot fail."""
    if set(layout) != set(_LAYOUT_FIELDS):
        return f"layout fields {sorted(map(str, layout))[:16]} are not {_LAYOUT_FIELDS}"
    for name, value in layout.items():
        if name == "dtype":
            ok = isinstance(value, str)
        elif name in ("k_scales", "v_scales"):
            ok = isinstance(value, list) and all(_is_number(v) for v in value)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok:
            return f"layout field {name} is {type(value).__name__}"
    return ""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
