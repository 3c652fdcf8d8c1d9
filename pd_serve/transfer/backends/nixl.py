"""nixl: NIXL agents move the pages (UCX: RDMA, CUDA IPC, cross-memory attach or TCP).

Each side has one agent that registers its whole KV pool once. The sender's hello carries its
agent's metadata and where its pool lies; the receiver loads that metadata and, for every batch
of chunks, READs the source pages of all layers into its reserved pages: one descriptor per page
of each layer's K and V (per token slot when only some KV heads move: a tensor-parallel hand-off),
one transfer per sender and batch.

Why the decode side reads rather than the prefill side writes: nothing ever writes into the
decode pool except the decode process itself, under the lock that checks the reservation, so a
request cancelled or timed out there cannot receive a late write into pages already given to
another (ipc pulls for the same reason). Completion is then local (the transfer's state), and
the sender hears of it through the acknowledgement every backend uses, so aborts, timeouts and a
peer's death behave as they do elsewhere; no NIXL notification is needed.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from pd_serve.protocol import KVChunk
from pd_serve.transfer.base import (ReceiverPlane, SenderPlane, TransferError, device_uuid,
                                    head_range, now)

logger = logging.getLogger(__name__)

# The `nixl` meta package imports as nixl; its CUDA builds (nixl-cu12, pd-serve[nixl]) as these.
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_HELLO_FIELDS = {"agent": bytes, "agent_name": str, "address": int, "device_id": int, "mem": str,
                 "shape": list}
POLL_SLEEP_S = 0.0002  # between polls of a transfer the caller waits for


def _import_api():
    """NIXL's Python API, or None when no build of it is installed. Its log lines (and UCX's)
    never go to stdout, which some parents read."""
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    for name in _MODULES:
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        nixl_logger = logging.getLogger("nixl")  # its records go where the process's go
        nixl_logger.handlers.clear()
        nixl_logger.propagate = True
        nixl_logger.setLevel(logging.WARNING)
        return api
    return None


def nixl_available() -> bool:
    """Is a build of NIXL installed? (Found without importing it.)"""
    return any(importlib.util.find_spec(name.split(".")[0]) is not None for name in _MODULES)


def check_nixl():
    api = _import_api()
    if api is None:
        raise TransferError("--transfer-backend nixl needs the 'nixl' package, which is not "
                            "installed (pip install pd-serve[nixl]); use --transfer-backend torch, "
                            "ipc or tcp")
    return api


def _agent(role: str, pool_buffer: torch.Tensor):
    """(agent, its registration) of a new agent with the pool registered."""
    api = check_nixl()
    name = f"pd-serve-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    return agent, agent.register_memory(pool_buffer)


def _mem(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor."""
    return ("VRAM", tensor.device.index or 0) if tensor.is_cuda else ("DRAM", 0)


def block_addresses(address: int, shape: list[int], itemsize: int, layer_start: int,
                    layer_end: int, page_ids: list[int], heads: tuple[int, int] | None,
                    per_slot: bool) -> tuple[np.ndarray, int]:
    """(addresses, bytes each) of the blocks that hold layers [layer_start, layer_end) of the
    pages in a pool of `shape` [L, 2, P, S, H, D] at `address`: one block per (layer, K/V, page),
    ordered so, or with `per_slot` one per token slot of each, holding heads [h0, h1) only.
    A latent pool has one plane ([L, 1, ...]): one block per (layer, page)."""
    _, planes, num_pages, page_size, num_heads, head_dim = shape
    h0, h1 = heads or (0, num_heads)
    slot_bytes = num_heads * head_dim * itemsize
    rows = np.arange(planes * layer_start, planes * layer_end, dtype=np.uint64)  # (layer, K or V)
    pages = np.asarray(page_ids, dtype=np.uint64)
    starts = (rows[:, None] * num_pages + pages[None, :]) * (page_size * slot_bytes)  # [R, N]
    if not per_slot:
        return address + starts.ravel(), page_size * slot_bytes
    slots = np.arange(page_size, dtype=np.uint64) * slot_bytes
    starts = starts[:, :, None] + slots[None, None, :] + h0 * head_dim * itemsize  # [R, N, S]
    return address + starts.ravel(), (h1 - h0) * head_dim * itemsize


def coalesce(local: np.ndarray, remote: np.ndarray, nbytes: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of `nbytes` read from `remote` into `local` (block i to block i), as fewer
    (local start, remote start, length) runs: neighbours contiguous on both sides merge (a
    request's consecutive pages, per layer). NIXL's cost grows with the number of descriptors:
    64 MiB in 16 KiB blocks read at a quarter to a half of the rate of 4 MiB ones (DRAM, CPU)."""
    if len(local) == 0:
        return local, remote, np.zeros(0, dtype=np.uint64)
    step = np.uint64(nbytes)
    starts = np.ones(len(local), dtype=bool)
    starts[1:] = (local[1:] != local[:-1] + step) | (remote[1:] != remote[:-1] + step)
    first = np.flatnonzero(starts)
    lengths = np.diff(np.append(first, len(local))).astype(np.uint64) * step
    return local[first], remote[first], lengths


def _descs(addresses: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    out = np.empty((len(addresses), 3), dtype=np.uint64)  # [N, (address, bytes, device)]
    out[:, 0], out[:, 1], out[:, 2] = addresses, lengths, device_id
    return out


class NixlSenderPlane(SenderPlane):
    """Registers the pool and says where it is; the receiver reads the pages itself."""

    sends_src_page_ids = True
    waits_on_host = True  # the receiver reads the pages as soon as it has the header
    chunked = False  # one read for all of a request's pages: nothing here to overlap

    def __init__(self, pool, timeout_s: float):
        super().__init__(pool, timeout_s)
        self.agent, self._registered = _agent("prefill", pool.buffer)

    def hello_info(self) -> dict:
        mem, device_id = _mem(self.pool.buffer)
        return {"agent": self.agent.get_agent_metadata(), "agent_name": self.agent.name,
                "address": self.pool.buffer.data_ptr(), "device_id": device_id, "mem": mem,
                "shape": list(self.pool.buffer.shape), "device_uuid": device_uuid(self.device)}

    def prepare(self, peer: str, chunk: KVChunk, src_page_ids: list[int],
                ready: torch.cuda.Event | None) -> list:
        # The sender waited for `ready` already (waits_on_host). The receiver reads the pages in
        # place; they stay allocated until its ack.
        return []

    def close(self) -> None:
        self.agent.deregister_memory(self._registered)


@dataclass
class _Peer:
    agent: str  # the sender's agent, as loaded
    address: int
    device_id: int
    mem: str
    shape: list[int]


@dataclass
class _Read:
    handle: object
    agent: str
    request_ids: list[str]
    deadline: float


@dataclass
class _Mark:
    """The reads posted up to `seq` (a mark): query() is True once every one has ended."""
    plane: NixlReceiverPlane
    seq: int

    def query(self) -> bool:
        return self.plane.ended(self.seq)


@dataclass
class _Held:
    """One sender's chunks since the last flush: local and remote descriptors, their requests."""
    local: list[np.ndarray] = field(default_factory=list)
    remote: list[np.ndarray] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


class NixlReceiverPlane(ReceiverPlane):
    """`receive` checks a chunk and holds its descriptors; `flush` posts one READ per sender for
    all it holds. Reads are polled (a mark's query, `synchronize`); one that fails or outlives
    the timeout fails its requests (`failed`), and is cancelled. The caller's thread may wait
    (`synchronize`, from cancel()) while the I/O thread polls: one lock serializes the agent."""

    def __init__(self, pool, timeout_s: float, host: str):
        super().__init__(pool, timeout_s)
        self.agent, self._registered = _agent("decode", pool.buffer)
        self._mem, self._device_id = _mem(pool.buffer)
        self._itemsize = pool.buffer.element_size()
        self._lock = threading.RLock()
        self._peers: dict[str, _Peer] = {}
        self._held: dict[str, _Held] = {}
        self._reads: dict[int, _Read] = {}  # by posting order
        self._seq = 0
        self._failed: dict[str, str] = {}
        self._retired: list[str] = []  # agents of dropped senders, removed once not read from

    def peer_error(self, hello_info: dict) -> str:
        for name, kind in _HELLO_FIELDS.items():
            if not isinstance(hello_info.get(name), kind) or isinstance(hello_info[name], bool):
                return f"malformed nixl hello: {name} is not a {kind.__name__}"
        shape, ours = hello_info["shape"], list(self.pool.buffer.shape)
        if (len(shape) != 6 or not all(isinstance(n, int) and n > 0 for n in shape)
                or shape[:2] + shape[3:4] + shape[5:] != ours[:2] + ours[3:4] + ours[5:]):
            return f"the sender's nixl pool has shape {shape[:8]}, not [L, 2, P, S, H, D] of ours {ours}"
        if hello_info["mem"] not in ("DRAM", "VRAM"):
            return f"the sender's nixl pool is in {hello_info['mem'][:16]!r} memory"
        return ""

    def after_welcome(self, sender_id: str, hello_info: dict) -> None:
        with self._lock:
            self.drop_sender(sender_id)  # (a sender back under its old id: maybe a new agent)
            name = hello_info["agent_name"]
            if any(p.agent == name for p in self._peers.values()):
                raise ValueError(f"the nixl agent {name!r} is another sender's")
            loaded = self.agent.add_remote_agent(hello_info["agent"])
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                raise ValueError(f"the nixl metadata is {loaded!r}'s, not {name!r}'s")
            if name in self._retired:  # the same agent paired again: keep it loaded
                self._retired.remove(name)
            self._peers[sender_id] = _Peer(name, hello_info["address"], hello_info["device_id"],
                                           hello_info["mem"], hello_info["shape"])

    def receive(self, sender_id: str, chunk: KVChunk, frames: list,
                dst_page_ids: list[int] | None) -> None:
        with self._lock:
            peer = self._peers.get(sender_id)
            if peer is None:
                raise RuntimeError(f"no nixl agent of {sender_id}")
            if dst_page_ids is None or not dst_page_ids:
                return  # nothing to read: the data stays in the sender's pool
            if len(chunk.src_page_ids) != len(dst_page_ids):
                raise ValueError(f"chunk of {chunk.request_id} names {len(chunk.src_page_ids)} "
                                 f"source pages for {len(dst_page_ids)} destination pages")
            num_pages, num_heads = peer.shape[2], peer.shape[4]
            if any(not 0 <= p < num_pages for p in chunk.src_page_ids):
                raise ValueError(f"chunk of {chunk.request_id} names source pages outside the "
                                 f"sender's {num_pages}")
            ours = self.pool.layout.num_kv_heads
            src_heads = head_range(chunk.src_heads) or (0, num_heads)
            dst_heads = head_range(chunk.dst_heads) or (0, ours)
            if (not 0 <= src_heads[0] < src_heads[1] <= num_heads
                    or src_heads[1] - src_heads[0] != dst_heads[1] - dst_heads[0]):
                raise ValueError(f"chunk of {chunk.request_id} reads KV heads {src_heads} of the "
                                 f"sender's {num_heads} into heads {dst_heads}")
            per_slot = src_heads != (0, num_heads) or dst_heads != (0, ours)
            local, nbytes = block_addresses(self.pool.buffer.data_ptr(),
                                            list(self.pool.buffer.shape), self._itemsize,
                                            chunk.layer_start, chunk.layer_end, dst_page_ids,
                                            dst_heads, per_slot)
            remote, _ = block_addresses(peer.address, peer.shape, self._itemsize,
                                        chunk.layer_start, chunk.layer_end, chunk.src_page_ids,
                                        src_heads, per_slot)
            held = self._held.setdefault(sender_id, _Held())
            local, remote, lengths = coalesce(local, remote, nbytes)
            held.local.append(_descs(local, lengths, self._device_id))
            held.remote.append(_descs(remote, lengths, peer.device_id))
            held.request_ids.append(chunk.request_id)

    def flush(self) -> None:
        with self._lock:
            held, self._held = self._held, {}
            for sender_id, chunks in held.items():
                self._post(self._peers[sender_id], chunks)

    def _post(self, peer: _Peer, chunks: _Held) -> None:
        """One READ of every held block; a read that cannot start fails its requests."""
        request_ids = list(dict.fromkeys(chunks.request_ids))
        try:
            handle = self.agent.initialize_xfer(
                "READ", self.agent.get_xfer_descs(np.concatenate(chunks.local), self._mem),
                self.agent.get_xfer_descs(np.concatenate(chunks.remote), peer.mem), peer.agent)
        except Exception as e:
            self._fail(request_ids, f"receive failed: nixl could not prepare the read: {e}")
            return
        self._seq += 1
        read = self._reads[self._seq] = _Read(handle, peer.agent, request_ids,
                                              now() + self.timeout_s)
        try:
            state = self.agent.transfer(handle)
        except Exception as e:  # e.g. the sender's agent is gone
            state = f"ERR ({type(e).__name__}: {e})"
        if state != "PROC":
            self._end(self._seq, read, state)

    def ended(self, seq: int) -> bool:
        """Have the reads posted up to `seq` ended (done, failed or cancelled)?"""
        with self._lock:
            self._poll()
            return next(iter(self._reads), seq + 1) > seq

    def mark(self) -> _Mark | None:
        with self._lock:
            self._poll()
            return _Mark(self, self._seq) if self._reads else None

    def synchronize(self) -> None:
        """Wait until every posted read has ended; one past its deadline is cancelled."""
        while True:
            with self._lock:
                self._poll()
                if not self._reads:
                    return
            time.sleep(POLL_SLEEP_S)

    def failed(self) -> dict[str, str]:
        with self._lock:
            failed, self._failed = self._failed, {}
            return failed

    def _poll(self) -> None:
        t = now()
        for seq, read in list(self._reads.items()):
            try:
                state = self.agent.check_xfer_state(read.handle)
            except Exception as e:
                state = f"ERR ({type(e).__name__}: {e})"
            if state == "PROC" and t > read.deadline:
                state = f"ERR (not done within {self.timeout_s} s)"
            if state != "PROC":
                self._end(seq, read, state)
        for agent in list(self._retired):
            if not any(r.agent == agent for r in self._reads.values()):
                self._retired.remove(agent)
                try:
                    self.agent.remove_remote_agent(agent)
                except Exception as e:
                    logger.warning("removing the nixl agent %s failed: %s", agent, e)

    def _end(self, seq: int, read: _Read, state: str) -> None:
        """A read ended in `state`: release its handle (cancelling it if still running)."""
        del self._reads[seq]
        if state != "DONE":
            self._fail(read.request_ids, f"receive failed: nixl read {state}")
        try:
            self.agent.release_xfer_handle(read.handle)
        except Exception as e:  # NIXL keeps it and retries when the agent goes
            logger.error("a nixl read could not be cancelled (%s); its pages may still change", e)

    def _fail(self, request_ids: list[str], error: str) -> None:
        logger.warning("%s (requests %s)", error, ", ".join(request_ids[:8]))
        for request_id in request_ids:
            self._failed.setdefault(request_id, error)

    def drop_sender(self, sender_id: str) -> None:
        """Forget a sender; the chunks held from it will not be read, so their requests fail."""
        with self._lock:
            held = self._held.pop(sender_id, None)
            if held is not None:
                self._fail(list(dict.fromkeys(held.request_ids)),
                           f"receive failed: the pair with {sender_id} broke")
            peer = self._peers.pop(sender_id, None)
            if peer is not None:
                self._retired.append(peer.agent)

    def close(self) -> None:
        with self._lock:
            for seq, read in list(self._reads.items()):
                self._end(seq, read, "ERR (receiver closed)")
            self.agent.deregister_memory(self._registered)
