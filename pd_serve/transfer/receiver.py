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

from kernels.kv_copy import scatter_pages
from pd_serve import protocol
from pd_serve.cache.pool import KVPool
from pd_serve.protocol import KVChunk, TransferAbort, TransferAck, TransferHello, TransferWelcome
from pd_serve.transfer.backends import make_receiver_plane
from pd_serve.transfer.base import TransferResult, TransferStats, layout_mismatch, now, page_index

logger = logging.getLogger(__name__)


@dataclass
class _Incoming:
    page_ids: list[int]
    deadline: float
    started: float = field(default_factory=now)
    num_bytes: int = 0


class KVReceiver:
    """Listens on `address`; expect() a request's pages, then poll() for its TransferResult.

    Every expected request ends in exactly one result: ok, refused, aborted by the sender, or
    timed out. After a failed result the caller frees the pages; nothing else touches them.
    """

    def __init__(self, pool: KVPool, backend: str = "tcp", host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 30.0, stats: TransferStats | None = None):
        self.pool = pool
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
        try:
            while not self._stop.is_set():
                if self._sock.poll(20, zmq.POLLIN):
                    identity, header, *frames = self._sock.recv_multipart(copy=False)
                    self._handle(bytes(identity), protocol.decode(header.bytes), frames)
                with self._lock:
                    self._expire()
        finally:
            self._sock.close()

    def _handle(self, sender: bytes, msg, frames: list) -> None:
        sender_id = sender.decode()
        if isinstance(msg, TransferHello):
            self._welcome(sender, sender_id, msg)
        elif isinstance(msg, KVChunk):
            self._on_chunk(sender, sender_id, msg, frames)
        elif isinstance(msg, TransferAbort):
            self._fail(msg.request_id, f"sender aborted: {msg.reason}")

    def _welcome(self, sender: bytes, sender_id: str, hello: TransferHello) -> None:
        error = ""
        if hello.backend != self.backend:
            error = f"backend mismatch: sender uses {hello.backend!r}, receiver {self.backend!r}"
        elif diff := layout_mismatch(self.pool.layout, hello.layout):
            error = f"KV layout mismatch (sender vs receiver): {diff}"
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

    def _on_chunk(self, sender: bytes, sender_id: str, chunk: KVChunk, frames: list) -> None:
        try:
            staging = self.plane.receive(sender_id, chunk, frames)
        except Exception as e:  # the data did not arrive: the pair is broken
            self.plane.drop_sender(sender_id)
            self._fail(chunk.request_id, f"receive failed: {e}")
            self._send(sender, TransferAck(chunk.request_id, ok=False, error=str(e)))
            return
        # The lock spans check and write, so cancel() cannot free the pages in between.
        with self._lock:
            incoming = self._expected.get(chunk.request_id)
            error = ""
            if incoming is None:
                error = "not expected here (never reserved, cancelled or timed out)"
            elif chunk.dst_page_ids != incoming.page_ids:
                error = "destination pages differ from the pages reserved for it"
                self._finish(chunk.request_id, ok=False, error=error)
            else:
                if staging is not None:
                    index = page_index(incoming.page_ids, self.pool.buffer.device)
                    scatter_pages(self.pool.buffer, index, staging, chunk.layer_start,
                                  chunk.layer_end)
                if chunk.last and self.pool.buffer.is_cuda:
                    torch.cuda.current_stream().synchronize()  # data in place before we say so
                incoming.num_bytes += chunk.nbytes
                if chunk.last:
                    self._finish(chunk.request_id, ok=True)
        if error:
            self._send(sender, TransferAck(chunk.request_id, ok=False, error=error))
        elif chunk.last:
            self._send(sender, TransferAck(chunk.request_id, ok=True))

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
