"""The decode side of KV transfer: accepts senders, writes their chunks into reserved pages.

Invariant: a chunk is written only into the pages that expect() reserved for its request id;
a chunk for any other id (never reserved, cancelled, timed out) is consumed and refused.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch
import zmq

from pd_serve import protocol
from pd_serve.cache.pool import KVPool
from pd_serve.protocol import KVChunk, TransferAbort, TransferAck, TransferHello, TransferWelcome
from pd_serve.transfer.backends import make_receiver_plane
from pd_serve.transfer.base import TransferResult, TransferStats, layout_mismatch, now, trace

logger = logging.getLogger(__name__)


@dataclass
class _Incoming:
    page_ids: list[int]
    deadline: float
    started: float = field(default_factory=now)
    num_bytes: int = 0
    next_page: int = 0  # where in page_ids the next chunk starts


class KVReceiver:
    """Listens on `address`; expect() a request's pages, then poll() for its TransferResult.

    Every expected request ends in exactly one result: ok, refused, aborted by the sender, or
    timed out. After a failed result the caller frees the pages; nothing else touches them.
    Between the chunks of a request the I/O thread busy-polls for up to `spin_s` (0: never).
    """

    def __init__(self, pool: KVPool, backend: str = "tcp", host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 30.0, stats: TransferStats | None = None,
                 spin_s: float = 0.002):
        self.pool = pool
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
        self._results: list[TransferResult] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) -------------------------------------------------------
    def expect(self, request_id: str, page_ids: list[int], timeout_s: float | None = None) -> None:
        """The request's pages are reserved: its KV may now be written into them."""
        with self._lock:
            if request_id in self._expected:
                raise ValueError(f"request {request_id!r} is already expected")
            self._expected[request_id] = _Incoming(list(page_ids), now() + (timeout_s or self.timeout_s))

    def cancel(self, request_id: str) -> None:
        """Stop expecting (the request was aborted here); late data is refused. No result."""
        with self._lock:
            self._expected.pop(request_id, None)

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
                if self._sock.poll(0 if now() < self._spin_until else 20, zmq.POLLIN):
                    identity, header, *frames = self._sock.recv_multipart(copy=False)
                    arrived = now()
                    self._handle(bytes(identity), protocol.decode(header.bytes), frames, arrived)
                if now() >= next_expiry:
                    next_expiry = now() + 0.005
                    with self._lock:
                        self._expire()
        finally:
            self._sock.close()

    def _handle(self, sender: bytes, msg, frames: list, arrived: float) -> None:
        sender_id = sender.decode()
        if isinstance(msg, TransferHello):
            self._welcome(sender, sender_id, msg)
        elif isinstance(msg, KVChunk):
            self._on_chunk(sender, sender_id, msg, frames, arrived)
        elif isinstance(msg, TransferAbort):
            self._fail(msg.request_id, f"sender aborted: {msg.reason}")

    def _welcome(self, sender: bytes, sender_id: str, hello: TransferHello) -> None:
        error = ""
        if hello.backend != self.backend:
            error = f"backend mismatch: sender uses {hello.backend!r}, receiver {self.backend!r}"
        elif diff := layout_mismatch(self.pool.layout, hello.layout):
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

    def _on_chunk(self, sender: bytes, sender_id: str, chunk: KVChunk, frames: list,
                  arrived: float) -> None:
        # The lock spans check and write (queued, and awaited at the last chunk), so cancel()
        # cannot free the pages in between.
        with self._lock:
            checked = now()
            incoming = self._expected.get(chunk.request_id)
            error = self._check(incoming, chunk)
            try:
                self.plane.receive(sender_id, chunk, frames, None if error else chunk.dst_page_ids)
                queued = now()
                if not error and chunk.last:
                    self.plane.synchronize()  # data in place before we say so
            except Exception as e:  # the data did not arrive: the pair is broken
                self.plane.drop_sender(sender_id)
                error = f"receive failed: {e}"
                queued = now()
            synced = now()
            if incoming is not None and not error:
                incoming.num_bytes += chunk.nbytes
            if incoming is not None and (chunk.last or error):
                self._finish(chunk.request_id, ok=not error, error=error)
        if error or chunk.last:
            self._send(sender, TransferAck(chunk.request_id, ok=not error, error=error))
        else:
            self._spin_until = now() + self.spin_s  # the next chunk is on its way
        trace("recv", chunk.request_id, arrived, checked=checked, queued=queued, synced=synced,
              acked=now())

    @staticmethod
    def _check(incoming: _Incoming | None, chunk: KVChunk) -> str:
        """'' when the chunk may be written: its request is expected and its destination pages
        are the next run of the reserved pages (a request's pages may come in several chunks,
        in order, for each layer group); else why not. Advances the position."""
        if incoming is None:
            return "not expected here (never reserved, cancelled or timed out)"
        start, end = incoming.next_page, incoming.next_page + len(chunk.dst_page_ids)
        if chunk.dst_page_ids != incoming.page_ids[start:end]:
            return "destination pages differ from the pages reserved for it"
        incoming.next_page = 0 if end == len(incoming.page_ids) else end
        if chunk.last and incoming.next_page:
            return "the last chunk leaves reserved pages unwritten"
        return ""

    def _send(self, identity: bytes, msg) -> None:
        self._sock.send_multipart([identity, protocol.encode(msg)])

    # ---- bookkeeping (lock held) ----------------------------------------------------------
    def _fail(self, request_id: str, error: str) -> None:
        with self._lock:
            if request_id in self._expected:
                self._finish(request_id, ok=False, error=error)

    def _expire(self) -> None:
        t = now()
        for request_id in [r for r, inc in self._expected.items() if inc.deadline < t]:
            self._finish(request_id, ok=False, error="timed out waiting for KV")

    def _finish(self, request_id: str, ok: bool, error: str = "") -> None:
        incoming = self._expected.pop(request_id)
        result = TransferResult(request_id, ok, error, incoming.num_bytes, now() - incoming.started)
        self.stats.record(result)
        self._results.append(result)
