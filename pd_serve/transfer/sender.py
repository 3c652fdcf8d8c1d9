"""The prefill side of KV transfer: pairs with receivers and ships pages to their reserved pages.

All sockets and data-plane calls live on one I/O thread; the caller's methods only queue work
(bounded) and read results, so the engine loop never blocks on the network.

A receiver's answers are input from the network: one that is not ours is dropped, counted in
pd_serve:protocol_errors_total{socket="kv-sender"} and logged, and the I/O thread goes on. If it
dies anyway (a bug), `alive` turns false, `error` says why and every request fails.

A receiver whose connection closes (it exited, or was killed) is dropped with its pairing, so
the next request to its address says hello again: a receiver started again at the same
address (a restarted decode worker) is a new peer, with new process groups (torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import socket
import threading
import uuid
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import zmq

from pd_serve import protocol
from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.protocol import (KVChunk, KVChunks, TransferAbort, TransferAcks, TransferHello,
                               TransferWelcome)
from pd_serve.transfer.backends import make_sender_plane
from pd_serve.transfer.base import (TRACE, Deadlines, TransferError, TransferResult, TransferStats,
                                    enter_io_thread, now, trace)

logger = logging.getLogger(__name__)

SOCKET = "kv-sender"  # the protocol-error counter's label
REPLY_MAX_BYTES = 16 * 2**20  # a receiver only sends welcomes and acks: zmq drops one sending more
MAX_ERROR_CHARS = 300  # of a receiver's error text kept in a result

# A receiver's outstanding requests travel in about this many messages, so that while it takes
# one the sender prepares the next and acknowledgements come back a message at a time; one
# message for everything queued makes the two ends (and a caller that refills as acks come) take
# turns. The depth caps a message at a share of the outstanding requests, it does not fill it:
# messages stay small when the caller refills a few at a time. Two messages a receiver: over ipc
# on one H200, fewer host microseconds a request on each side than four (which in turn take
# about half of one message's).
MESSAGE_DEPTH = 2


@dataclass
class _Outgoing:
    address: str
    deadline: float
    started: float = field(default_factory=now)
    num_bytes: int = 0


@dataclass
class _Handshake:
    """A receiver we said hello to and await the welcome of; the sends queued for it meanwhile,
    and the connect() callers waiting on it."""

    sock: zmq.Socket
    deadline: float
    jobs: list = field(default_factory=list)  # _SendJobs, in order
    futures: list = field(default_factory=list)


@dataclass
class _SendJob:
    request_id: str
    address: str
    src_page_ids: list[int]
    chunk: KVChunk
    ready: torch.cuda.Event | None  # the compute that wrote the pages (GPU)
    stream: int  # the CUDA stream (handle) `ready` was recorded on
    first: bool  # the request's first chunk
    queued: float = field(default_factory=now)


class KVSender:
    """connect() once per receiver; send() a request's pages (whole, or layer group by group);
    poll() for one TransferResult per request and receiver: ok once the receiver acknowledged
    the last chunk, or failed (refused, aborted, receiver gone, timed out). The source pages must
    stay allocated until that result arrives. (A request goes to several receivers when it
    hands off to a decode pool of another TP size: a part of its KV heads to each; `heads`.)

    Each send() goes out as chunks of whole pages (one chunk where the backend does not chunk:
    ipc), in page order: the first of `chunk_bytes`,
    each next one twice the last, up to `max_chunk_bytes`. Moving chunk i overlaps preparing
    chunk i+1 (and, on the receiver, taking its header), small first chunks start the data
    moving early, and large later ones keep the per-chunk host work off the critical path.
    The chunks the I/O thread finds queued for one receiver travel together, in messages of at
    most a MESSAGE_DEPTH-th of the requests outstanding to it (and cut after `chunk_bytes` of
    frame data, so tcp data still moves while later chunks are gathered); the receiver takes a
    message at a time and acknowledges together the requests whose writes landed together.
    While a transfer awaits its ack, the I/O thread may busy-poll for up to `spin_s` after its
    last chunk went out, trading a core for the wake-up latency of a sleeping thread. Default 0
    (never): a spinning thread holds the GIL the caller's thread needs; on 2 x H200, 64 MiB ipc
    transfers with 32 or 128 in flight ran at 71-78 % of the link spinning 2 ms, 85-93 % not.

    With a cluster `key` every message carries its tag and every answer must: a receiver with
    another key (or none) fails connect() with a TransferError that says so.
    """

    def __init__(self, pool: KVPool, backend: str = "tcp", sender_id: str | None = None,
                 timeout_s: float = 30.0, max_queued: int = 4096, stats: TransferStats | None = None,
                 chunk_bytes: int = 64 * 2**20, max_chunk_bytes: int = 512 * 2**20,
                 spin_s: float = 0.0, model_layout: KVLayout | None = None, key: bytes = b""):
        """model_layout: the layout announced to receivers, with every KV head of the model
        (a tensor-parallel rank's pool holds some of them); default: the pool's. key: the
        cluster key (b"": messages are not authenticated)."""
        self.pool = pool
        self.codec = protocol.Codec(key)
        self.error = ""  # why the I/O thread died ("" while it has not)
        self.model_layout = model_layout or pool.layout
        self.chunk_bytes = chunk_bytes
        self.max_chunk_bytes = max(chunk_bytes, max_chunk_bytes)
        self.spin_s = spin_s
        self._spin_until = 0.0
        self.backend = backend
        self.sender_id = sender_id or f"sender-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.stats = stats or TransferStats("send", backend)
        self.plane = make_sender_plane(backend, pool, timeout_s)
        # A context of its own, ended by close(): tcp pages leave as zero-copy frames, and the
        # context's end is what says libzmq no longer reads them (see close).
        self._ctx = zmq.Context()
        self.max_queued = max_queued
        self._jobs: deque = deque()  # appended by callers, taken by the I/O thread
        self._lock = threading.Lock()
        self._has_results = threading.Condition(self._lock)
        self._results: list[TransferResult] = []
        self._outgoing: dict[tuple[str, str], _Outgoing] = {}  # (request id, receiver address)
        self._outstanding: Counter = Counter()  # receiver address -> its records in _outgoing
        self._deadlines = Deadlines()  # of the _outgoing records
        self._socks: dict[str, zmq.Socket] = {}
        self._addresses: dict[zmq.Socket, str] = {}
        self._monitors: dict[str, zmq.Socket] = {}  # address -> its socket's disconnect events
        # Receivers whose welcome we await: the I/O thread never blocks on one (a dead
        # receiver's address would stall every other receiver's transfers for timeout_s)
        self._handshakes: dict[str, _Handshake] = {}
        self._handshake_socks: dict[zmq.Socket, str] = {}
        self._stop = threading.Event()
        # A byte on this socket pair wakes the I/O thread when work is queued while it sleeps
        # (`_sleeping`), so it can sleep in one poll over its peers' sockets and the queue.
        self._sleeping = False
        self._next_expiry = 0.0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._thread = threading.Thread(target=self._serve, name="kv-sender", daemon=True)
        self._thread.start()

    # ---- caller side ----------------------------------------------------------------------
    def connect(self, address: str, timeout_s: float | None = None) -> None:
        """Handshake with a receiver; raises TransferError (layout mismatch, unreachable)."""
        future: Future = Future()
        self._put(("connect", address, future))
        try:
            future.result(timeout=(timeout_s or self.timeout_s) + 5)
        except TimeoutError:
            raise TransferError(f"{address}: no handshake answer") from None

    def ready_mark(self) -> tuple[torch.cuda.Event, int] | None:
        """The point the current CUDA stream has reached (an event recorded there, and the
        stream), for send(ready=...): the pages that the work queued before it writes. One mark
        serves every send queued at that point (a step's requests), instead of each recording
        its own (about 5 us of host time a send on the H200 host). None on a CPU pool."""
        if not self.pool.buffer.is_cuda:
            return None
        # by index: about half the host time of by device
        current = torch.cuda.current_stream(self.pool.buffer.device.index)
        event = torch.cuda.Event()
        event.record(current)
        return event, current.cuda_stream

    def send(self, request_id: str, address: str, src_page_ids: list[int], dst_page_ids: list[int],
             layer_start: int = 0, layer_end: int | None = None, last: bool = True,
             heads: tuple[int, int, int] | None = None, parts: int = 1,
             ready: tuple[torch.cuda.Event, int] | None = None) -> None:
        """Queue layers [layer_start, layer_end) of the pages; `last` on the request's final call
        to this receiver. heads (src_head, dst_head, count): only these KV heads of our pool, into
        those of the receiver's (None: every head, the same on both sides); parts: how many
        senders (this one included) send parts of the request's heads to this receiver; ready:
        a ready_mark() taken after the work that writes the pages was queued (default: one
        taken here)."""
        layout = self.pool.layout
        layer_end = layout.num_layers if layer_end is None else layer_end
        if len(src_page_ids) != len(dst_page_ids):
            raise ValueError(f"{len(src_page_ids)} source pages but {len(dst_page_ids)} destination pages")
        if not 0 <= layer_start < layer_end <= layout.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) outside [0, {layout.num_layers})")
        if ready is None:
            ready = self.ready_mark()
        event, stream = ready if ready is not None else (None, 0)
        src_heads, dst_heads = [], []
        page_bytes = (layer_end - layer_start) * layout.bytes_per_page // layout.num_layers
        if heads is not None:
            src, dst, count = heads
            if not (count > 0 and 0 <= src and src + count <= layout.num_kv_heads and dst >= 0):
                raise ValueError(f"heads {heads} outside the pool's {layout.num_kv_heads} KV heads")
            src_heads, dst_heads = [src, src + count], [dst, dst + count]
            page_bytes = page_bytes * count // layout.num_kv_heads
        num_pages = len(src_page_ids)
        jobs = []
        for start, end in self._chunk_bounds(num_pages, page_bytes):
            src = list(src_page_ids[start:end])
            chunk = KVChunk(request_id, list(dst_page_ids[start:end]), layer_start, layer_end,
                            (end - start) * page_bytes, last and end == num_pages,
                            src if self.plane.sends_src_page_ids else [], src_heads, dst_heads,
                            parts)
            jobs.append(_SendJob(request_id, address, src, chunk, event, stream,
                                 first=layer_start == 0 and start == 0))
        self._put(("send", jobs))

    def _chunk_bounds(self, num_pages: int, page_bytes: int) -> list[tuple[int, int]]:
        """[start, end) page ranges of the chunks; a page larger than a chunk travels alone, and
        a request without pages still sends one (empty) chunk. One chunk when the backend does
        not chunk."""
        if not self.plane.chunked:
            return [(0, num_pages)]
        bounds, start, size = [], 0, self.chunk_bytes
        while True:
            end = min(num_pages, start + max(1, size // max(1, page_bytes)))
            bounds.append((start, end))
            if end >= num_pages:
                return bounds
            start, size = end, min(2 * size, self.max_chunk_bytes)

    def abort(self, request_id: str) -> None:
        """Give up on a request (to every receiver); its results (failed) follow unless they
        are in already."""
        self._put(("abort", request_id, "aborted by the sender"))

    def poll(self, timeout_s: float = 0.0) -> list[TransferResult]:
        """The results since the last poll; waits up to `timeout_s` for one when there are none."""
        with self._has_results:
            if not self._results and timeout_s > 0:
                self._has_results.wait(timeout_s)
            results, self._results = self._results, []
        return results

    @property
    def alive(self) -> bool:
        """The I/O thread is running: not closed, not crashed (then `error` says why)."""
        return self._thread.is_alive() and not self.error

    def close(self) -> None:
        """Stop the I/O thread and end the context. Closing a socket returns before libzmq's
        I/O thread lets go of its queued frames, so a frame could still be in the middle of
        its write when the interpreter, exiting, freed its memory (libzmq then aborted the
        process: "Bad address"). term() returns once every socket is gone."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # its sockets are open: term() would wait for them forever
            logger.warning("the KV sender's I/O thread did not stop within 5 s")
        else:
            self._ctx.term()
        self.plane.close()

    def _put(self, job) -> None:
        if not self.alive:
            raise TransferError("the KV sender's I/O thread is not running: "
                                f"{self.error or 'closed'}")
        if len(self._jobs) >= self.max_queued:
            raise TransferError(f"transfer queue full ({self.max_queued} jobs)")
        self._jobs.append(job)
        if self._sleeping:  # set before the I/O thread last looked at the queue
            # One byte a sleep: the puts after this one are taken by the same wake-up (the
            # byte goes after the flag is cleared, and the I/O thread drains the whole queue).
            self._sleeping = False
            self._wake_w.send(b"\0")

    # ---- I/O thread -----------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        try:
            enter_io_thread(self.pool.buffer.device)
            while not self._stop.is_set():
                timeout = 0 if self._jobs or (self._outgoing and now() < self._spin_until) else 50
                if timeout:
                    self._sleeping = True  # from here on, send() wakes us
                    timeout = 0 if self._jobs else timeout
                for sock, _ in poller.poll(timeout):
                    if isinstance(sock, int):  # the wake-up socket's fd
                        self._drain_wakeups()
                    elif sock in self._addresses:
                        self._take_reply(sock)
                    elif sock in self._handshake_socks:
                        self._on_welcome(sock, poller)
                    else:  # a monitor: the receiver's connection closed
                        self._on_disconnect(sock, poller)
                self._sleeping = False
                sends: list[_SendJob] = []  # queued sends go out together, per receiver
                while self._jobs:
                    job = self._jobs.popleft()
                    if job[0] == "send":
                        sends.extend(job[1])
                    else:  # in order: what was queued before it goes first
                        self._send_chunks(sends, poller)
                        sends = []
                        self._run(job, poller)
                self._send_chunks(sends, poller)
                self._expire(poller)
        except BaseException as e:  # a bug, not input: say so, so the worker exits (alive)
            self.error = f"{type(e).__name__}: {e}"
            logger.exception("the KV sender's I/O thread died")
            self._fail_all(f"the KV sender's I/O thread died: {self.error}")
        finally:
            for address in list(self._socks):
                self._drop_peer(address, poller)
            for address in list(self._handshakes):
                self._end_handshake(address, poller, "the KV sender closed")

    def _fail_all(self, error: str) -> None:
        """After a crash: waiting connects and every request sent or queued fail."""
        results = [self._result(key, False, error) for key in list(self._outgoing)]
        for handshake in self._handshakes.values():
            for future in handshake.futures:
                future.set_exception(TransferError(error))
            handshake.futures.clear()
        while self._jobs:
            job = self._jobs.popleft()
            if job[0] == "connect":
                job[2].set_exception(TransferError(error))
            elif job[0] == "send":
                results += [TransferResult(j.request_id, False, error) for j in job[1] if j.first]
        self._publish(results)

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _run(self, job, poller: zmq.Poller) -> None:
        kind = job[0]
        if kind == "connect":
            _, address, future = job
            if address in self._socks:
                future.set_result(None)
                return
            try:
                self._say_hello(address, poller)
            except Exception as e:
                future.set_exception(TransferError(f"{address}: {e}"))
                return
            self._handshakes[address].futures.append(future)
        elif kind == "abort":
            self._abort(job[1], job[2])

    def _say_hello(self, address: str, poller: zmq.Poller) -> None:
        """Start the handshake with a receiver (once): its welcome is taken by the poll loop
        (_on_welcome), so the I/O thread goes on serving other receivers meanwhile."""
        if address in self._socks or address in self._handshakes:
            return
        sock = self._ctx.socket(zmq.DEALER)
        # "<sender id>/<random>": a receiver knows the sender by the part before the slash, and
        # no peer can take the identity first (a ROUTER refuses a second connection under one
        # identity: a guessable one let a peer without the key stall our transfers)
        identity = f"{self.sender_id}/{secrets.token_hex(8)}"
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, REPLY_MAX_BYTES)
        try:
            sock.connect(address)
            sock.send(self.codec.encode(TransferHello(self.sender_id, self.backend,
                                                      dataclasses.asdict(self.model_layout),
                                                      self.plane.hello_info(), identity)),
                      zmq.NOBLOCK)
        except Exception:
            sock.close()
            raise
        self._handshakes[address] = _Handshake(sock, now() + self.timeout_s)
        self._handshake_socks[sock] = address
        poller.register(sock, zmq.POLLIN)

    def _on_welcome(self, sock: zmq.Socket, poller: zmq.Poller) -> None:
        """A receiver's answer to our hello: paired (the sends queued for it go out), or the
        handshake fails (and so do they)."""
        address = self._handshake_socks[sock]
        try:
            welcome = self._welcome(sock, address)
            self.plane.connect(address, welcome.info)
        except Exception as e:
            error = e if isinstance(e, TransferError) else TransferError(f"{address}: {e}")
            self._end_handshake(address, poller, str(error))
            return
        handshake = self._end_handshake(address, poller, "", keep_socket=True)
        self._socks[address] = sock
        self._addresses[sock] = address
        poller.register(sock, zmq.POLLIN)
        self._monitors[address] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller.register(self._monitors[address], zmq.POLLIN)
        for future in handshake.futures:
            future.set_result(None)
        # (a request aborted or expired meanwhile is no longer outgoing: its chunks stay here)
        jobs = [j for j in handshake.jobs if (j.request_id, address) in self._outgoing]
        if jobs:
            self._send_group(address, jobs, poller)

    def _end_handshake(self, address: str, poller: zmq.Poller, error: str,
                       keep_socket: bool = False) -> _Handshake:
        """The handshake is over; with `error`, its connect() callers and its queued requests
        fail."""
        handshake = self._handshakes.pop(address)
        self._handshake_socks.pop(handshake.sock, None)
        poller.unregister(handshake.sock)
        if not keep_socket:
            handshake.sock.close()
        if error:
            logger.warning("KV receiver %s: %s", address, error)
            for future in handshake.futures:
                future.set_exception(TransferError(error))
            self._fail_jobs(address, handshake.jobs, error)
        return handshake

    def _fail_jobs(self, address: str, jobs: list[_SendJob], error: str) -> None:
        """The requests of these sends to `address` that are still outgoing fail."""
        for request_id in dict.fromkeys(job.request_id for job in jobs):
            if (request_id, address) in self._outgoing:
                self._finish((request_id, address), ok=False, error=f"send failed: {error}")

    def _on_disconnect(self, monitor: zmq.Socket, poller: zmq.Poller) -> None:
        monitor.recv_multipart()
        address = next(a for a, m in self._monitors.items() if m is monitor)
        logger.info("KV receiver %s closed its connection: pairing again on the next send", address)
        self._drop_peer(address, poller)

    def _welcome(self, sock: zmq.Socket, address: str) -> TransferWelcome:
        """The receiver's answer to our hello (waiting on `sock`), if it accepts the pair; else
        TransferError."""
        frames = sock.recv_multipart()
        try:
            if len(frames) != 1:
                raise protocol.ProtocolError(f"{len(frames)} frames")
            welcome = self.codec.decode(frames[0])
        except protocol.ProtocolError as e:
            protocol.refused(SOCKET, f"the handshake answer of {address}: {e}")
            raise TransferError(f"{address}: its handshake answer is refused ({e}); is it a KV "
                                "receiver started with the same cluster key?") from None
        if not isinstance(welcome, TransferWelcome):
            protocol.refused(SOCKET, f"a {type(welcome).__name__} from {address} as its welcome")
            raise TransferError(f"{address} answered the handshake with a {type(welcome).__name__}")
        if not welcome.ok:
            raise TransferError(f"{address} refused the pair: {welcome.error[:MAX_ERROR_CHARS]}")
        return welcome

    def _send_chunks(self, jobs: list[_SendJob], poller: zmq.Poller) -> None:
        """One KVChunks message per receiver for all of `jobs` (in order), each chunk's frames
        after the header; then the out-of-band moves (torch) in the same order."""
        by_address: dict[str, list[_SendJob]] = {}
        for job in jobs:
            by_address.setdefault(job.address, []).append(job)
        for address, group in by_address.items():
            self._send_group(address, group, poller)

    def _send_group(self, address: str, jobs: list[_SendJob], poller: zmq.Poller) -> None:
        picked = now()
        going: list[_SendJob] = []
        for job in jobs:
            key = (job.request_id, address)
            if key not in self._outgoing:
                if not job.first:
                    continue  # an earlier chunk failed or was aborted: drop the rest
                out = _Outgoing(address, now() + self.timeout_s)
                self._outgoing[key] = out
                self._outstanding[address] += 1
                self._deadlines.add(key, out, out.deadline)
            going.append(job)
        if not going:
            return
        if address not in self._socks:  # they go once the receiver welcomes us
            try:
                self._say_hello(address, poller)
            except Exception as e:
                logger.warning("send to %s failed: %s", address, e)
                self._fail_jobs(address, going, str(e))
                return
            self._handshakes[address].jobs.extend(going)
            return
        marks: dict[int, tuple[float, float]] = {}  # id(job) -> (prepared, header sent)
        per_message = max(1, self._outstanding[address] // MESSAGE_DEPTH)
        try:
            if self.plane.waits_on_host:
                # Events of one stream pass in order: waiting for each stream's newest covers
                # the group (one host wait instead of one a chunk).
                newest = {job.stream: job.ready for job in going if job.ready is not None}
                for event in newest.values():
                    event.synchronize()
            message: list[_SendJob] = []
            headers, counts, frames, frame_bytes = [], [], [], 0
            for i, job in enumerate(going):
                chunk_frames = self.plane.prepare(address, job.chunk, job.src_page_ids,
                                                  None if self.plane.waits_on_host else job.ready)
                message.append(job)
                headers.append(job.chunk)
                counts.append(len(chunk_frames))
                frames.extend(chunk_frames)
                frame_bytes += job.chunk.nbytes if chunk_frames else 0
                # Data carried in frames goes once a chunk's worth is ready, so it moves while
                # the next chunks are prepared (tcp).
                if (i + 1 < len(going) and frame_bytes < self.chunk_bytes
                        and len(message) < per_message):
                    continue
                prepared = now()
                try:  # never wait here: every other receiver's transfers would wait too
                    sock = self._socks[address]
                    sock.send_multipart([self.codec.encode(KVChunks(headers, counts, _identity(sock))),
                                         *frames], copy=False, flags=zmq.NOBLOCK)
                except zmq.Again:
                    raise TransferError(f"{address} takes nothing: its send queue is full (the "
                                        "receiver, or the link to it, is stalled)") from None
                sent = now()
                for sent_job in message:
                    self.plane.finish(address, sent_job.chunk, sent_job.src_page_ids, sent_job.ready)
                    marks[id(sent_job)] = (prepared, sent)
                message, headers, counts, frames, frame_bytes = [], [], [], [], 0
        except Exception as e:
            logger.warning("send to %s failed: %s", address, e)
            self._drop_peer(address, poller)
            self._fail_jobs(address, going, str(e))
            return
        went = now()
        for job in going:
            out = self._outgoing[(job.request_id, address)]
            out.num_bytes += job.chunk.nbytes
            out.deadline = went + self.timeout_s  # (_expire re-arms the entry it finds early)
            if TRACE:
                prepared, sent = marks[id(job)]
                trace("send", job.request_id, job.queued, picked=picked, prepared=prepared,
                      header_sent=sent, finished=now())
        self._spin_until = now() + self.spin_s

    def _take_reply(self, sock: zmq.Socket) -> None:
        """Take one message from a receiver: acks for our requests; anything else is dropped,
        counted and logged."""
        address = self._addresses[sock]
        frames = sock.recv_multipart()
        try:
            if len(frames) != 1:
                protocol.refused(SOCKET, f"a message of {len(frames)} frames from {address}")
                return
            msg = self.codec.receive(frames[0], SOCKET, address)
            if msg is not None and not isinstance(msg, TransferAcks):
                protocol.refused(SOCKET, f"a {type(msg).__name__} from {address}, not acks")
            elif msg is not None:
                self._on_acks(address, msg)
        except Exception as e:  # what no check foresaw
            protocol.refused(SOCKET, f"a message from {address} ({type(e).__name__}: {e})")
            logger.debug("the refused message's handling", exc_info=True)

    def _on_acks(self, address: str, msg: TransferAcks) -> None:
        results = []
        for ack in msg.acks:
            key = (ack.request_id, address)
            if key in self._outgoing:
                if TRACE:
                    trace("ack", ack.request_id, self._outgoing[key].started, acked=now())
                results.append(self._result(key, ack.ok, ack.error[:MAX_ERROR_CHARS]))
        self._publish(results)

    def _abort(self, request_id: str, reason: str) -> None:
        for key in [k for k in self._outgoing if k[0] == request_id]:
            self._abort_one(key, reason)

    def _abort_one(self, key: tuple[str, str], reason: str) -> None:
        sock = self._socks.get(key[1])
        if sock is not None:
            # (a full queue: the receiver gets no abort, and hears from its own side instead)
            with contextlib.suppress(zmq.Again):
                sock.send(self.codec.encode(TransferAbort(key[0], reason, _identity(sock))), zmq.NOBLOCK)
        self._finish(key, ok=False, error=reason)

    def _expire(self, poller: zmq.Poller) -> None:
        t = now()
        if t < self._next_expiry:
            return
        self._next_expiry = t + 0.005
        for key in self._deadlines.expired(t, self._outgoing):
            out = self._outgoing[key]
            if out.deadline >= t:  # a chunk went since: the clock restarted then
                self._deadlines.add(key, out, out.deadline)
            else:
                self._abort_one(key, f"no acknowledgement (nor chunk to send) within "
                                      f"{self.timeout_s} s of its last chunk")
        for address in [a for a, h in self._handshakes.items() if h.deadline <= t]:
            self._end_handshake(address, poller, f"{address}: no handshake answer within "
                                f"{self.timeout_s} s (is a KV receiver up there, started with "
                                "the same cluster key?)")

    def _drop_peer(self, address: str, poller: zmq.Poller) -> None:
        sock = self._socks.pop(address, None)
        if sock is not None:
            self._addresses.pop(sock, None)
            poller.unregister(sock)
            monitor = self._monitors.pop(address)
            poller.unregister(monitor)
            sock.disable_monitor()
            monitor.close()
            sock.close()
        self.plane.drop_peer(address)

    def _finish(self, key: tuple[str, str], ok: bool, error: str = "") -> None:
        self._publish([self._result(key, ok, error)])

    def _result(self, key: tuple[str, str], ok: bool, error: str) -> TransferResult:
        out = self._outgoing.pop(key)
        self._outstanding[key[1]] -= 1
        return TransferResult(key[0], ok, error, out.num_bytes, now() - out.started)

    def _publish(self, results: list[TransferResult]) -> None:
        """Results to the caller (one wake-up for all of them) and the stats."""
        if not results:
            return
        self.stats.record(results)
        with self._has_results:
            self._results.extend(results)
            self._has_results.notify_all()


def _identity(sock: zmq.Socket) -> str:
    """The socket's identity, which every message to a receiver names (protocol.KVChunks)."""
    return sock.getsockopt(zmq.IDENTITY).decode()
