"""torch: torch.distributed point-to-point, gloo on CPU and NCCL on GPU.

Pools start independently, so there is no global world: each sender/receiver pair forms its own
two-rank group at run time. The receiver hosts one TCPStore; each pair uses its own prefix.
Across hosts, gloo ranks listen on the address their peer reaches: the receiver's advertised
host, and on the sender the local address of its route to that host.

A chunk is gathered into a staging tensor, sent, received into another and scattered. On the
GPU nothing here waits on the host: the sender gathers on its stream, from which the send's
NCCL stream waits; the receiver posts receives from one stream (which only waits for staging
memory to be free) and scatters on another (which waits for each receive), so the receive of
chunk i+1 overlaps the scatter of chunk i, and the gather of i+1 overlaps the send of i, also
across requests. At most NUM_STAGING staging tensors per side are in flight; reusing one waits
on the GPU for its last use.
"""

from __future__ import annotations

import itertools
import math
import socket
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from kernels.kv_copy import gather_pages, scatter_pages
from pd_serve.protocol import KVChunk
from pd_serve.transfer.base import (ReceiverPlane, SenderPlane, device_uuid, head_range,
                                    on_stream, staging_shape)

SENDER_RANK, RECEIVER_RANK = 0, 1
NUM_STAGING = 4  # staging tensors in flight per side


def _pair_group(store, prefix: str, rank: int, device: torch.device, timeout_s: float, host: str):
    """host: the address this rank's gloo pair listens on (its peer must reach it there)."""
    store = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # gloo's default device is the one the machine's hostname resolves to, or loopback: neither
    # need be reachable from the peer (another network namespace or host).
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _local_address_to(host: str, port: int) -> str:
    """This host's address on the route to host:port (no packet is sent)."""
    family, kind, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as s:
        s.connect(addr)
        return s.getsockname()[0]


def _wait(work, stream: torch.cuda.Stream | None, timeout_s: float) -> None:
    """GPU: make `stream` wait for the work (the host does not). CPU: wait, bounded."""
    if stream is not None:
        with torch.cuda.stream(stream):
            work.wait()
    else:
        work.wait(timedelta(seconds=timeout_s))


class TorchReceiverPlane(ReceiverPlane):
    def __init__(self, pool, timeout_s: float, host: str):
        super().__init__(pool, timeout_s)  # self.stream: scatters
        self.host = host  # where senders reach this worker
        self._store: dist.TCPStore | None = None
        self._groups: dict[str, object] = {}
        self._prefixes: dict[str, str] = {}
        self._pair_ids = itertools.count()
        self._post_stream = torch.cuda.Stream(self.device) if self.stream is not None else None
        self._in_flight: deque = deque()  # (staging, event after its scatter)

    def peer_error(self, hello_info: dict) -> str:
        uuid = device_uuid(self.device)
        if uuid and hello_info.get("device_uuid") == uuid:
            return (f"sender and receiver use the same GPU ({uuid}); NCCL cannot pair two ranks "
                    "on one GPU: use --transfer-backend ipc (or put the workers on different GPUs)")
        return ""

    def welcome_info(self, sender_id: str, hello_info: dict) -> dict:
        if self._store is None:
            self._store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=self.timeout_s))
        self._prefixes[sender_id] = f"pair/{sender_id}/{next(self._pair_ids)}/"
        return {"store_host": self.host, "store_port": self._store.port,
                "prefix": self._prefixes[sender_id]}

    def after_welcome(self, sender_id: str, hello_info: dict) -> None:
        self._groups[sender_id] = _pair_group(self._store, self._prefixes[sender_id], RECEIVER_RANK,
                                              self.device, self.timeout_s, self.host)

    def receive(self, sender_id: str, chunk: KVChunk, frames: list,
                dst_page_ids: list[int] | None) -> None:
        group = self._groups.get(sender_id)
        if group is None:
            raise RuntimeError(f"no process group with {sender_id}")
        heads = head_range(chunk.dst_heads)
        shape = staging_shape(self.pool.layout, len(chunk.dst_page_ids), chunk.layer_start,
                              chunk.layer_end, heads)
        if math.prod(shape) * self.pool.buffer.element_size() > self.pool.num_bytes:
            # (a refused chunk is received too: its size comes from the sender's header)
            raise ValueError(f"chunk of {chunk.request_id} is larger than the whole pool")
        with on_stream(self._post_stream):
            if len(self._in_flight) >= NUM_STAGING:  # its memory may come back to this stream
                _, scattered = self._in_flight.popleft()
                if scattered is not None:
                    self._post_stream.wait_event(scattered)
            staging = torch.empty(shape, dtype=self.pool.buffer.dtype, device=self.device)
            work = group.recv([staging], SENDER_RANK, 0)
        _wait(work, self.stream, self.timeout_s)
        scattered = None
        with on_stream(self.stream):
            if dst_page_ids is not None:
                scatter_pages(self.pool.buffer, self.page_ids.to_device(dst_page_ids), staging,
                              chunk.layer_start, chunk.layer_end, heads)
            if self.stream is not None:
                scattered = self.stream.record_event()
        self._in_flight.append((staging, scattered))

    def drop_sender(self, sender_id: str) -> None:
        self._groups.pop(sender_id, None)


class TorchSenderPlane(SenderPlane):
    def __init__(self, pool, timeout_s: float):
        super().__init__(pool, timeout_s)  # self.stream: gathers; sends wait for it
        self._groups: dict[str, object] = {}
        self._in_flight: deque = deque()  # (staging, send work)

    def connect(self, peer: str, welcome_info: dict) -> None:
        store_host, store_port = welcome_info["store_host"], welcome_info["store_port"]
        store = dist.TCPStore(store_host, store_port, is_master=False,
                              timeout=timedelta(seconds=self.timeout_s))
        self._groups[peer] = _pair_group(store, welcome_info["prefix"], SENDER_RANK, self.device,
                                         self.timeout_s, _local_address_to(store_host, store_port))

    def prepare(self, peer: str, chunk: KVChunk, src_page_ids: list[int],
                ready: torch.cuda.Event | None) -> list:
        return []  # the header goes first, so the receiver posts its receive while we gather

    def finish(self, peer: str, chunk: KVChunk, src_page_ids: list[int],
               ready: torch.cuda.Event | None) -> None:
        buf = self.pool.buffer
        with on_stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            if len(self._in_flight) >= NUM_STAGING:  # its memory may come back to this stream
                _, work = self._in_flight.popleft()
                _wait(work, self.stream, self.timeout_s)
            staging = gather_pages(buf, self.page_ids.to_device(src_page_ids), chunk.layer_start,
                                   chunk.layer_end, heads=head_range(chunk.src_heads))
            work = self._groups[peer].send([staging], RECEIVER_RANK, 0)
        if self.stream is None:
            work.wait(timedelta(seconds=self.timeout_s))  # gloo: bounded, and the tensor is free
        else:
            self._in_flight.append((staging, work))

    def drop_peer(self, peer: str) -> None:
        self._groups.pop(peer, None)
