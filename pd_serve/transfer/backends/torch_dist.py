"""torch: torch.distributed point-to-point, gloo on CPU and NCCL on GPU.

Pools start independently, so there is no global world: each sender/receiver pair forms its own
two-rank group at run time. The receiver hosts one TCPStore; each pair uses its own prefix.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from kernels.kv_copy import gather_pages
from pd_serve.protocol import KVChunk
from pd_serve.transfer.base import ReceiverPlane, SenderPlane, staging_shape, page_index

SENDER_RANK, RECEIVER_RANK = 0, 1


def _pair_group(store, prefix: str, rank: int, device: torch.device, timeout_s: float):
    store = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


class TorchReceiverPlane(ReceiverPlane):
    def __init__(self, pool, timeout_s: float, host: str):
        super().__init__(pool, timeout_s)
        self.host = host
        self._store: dist.TCPStore | None = None
        self._groups: dict[str, object] = {}
        self._prefixes: dict[str, str] = {}
        self._pair_ids = itertools.count()

    def welcome_info(self, sender_id: str, hello_info: dict) -> dict:
        if self._store is None:
            self._store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=self.timeout_s))
        self._prefixes[sender_id] = f"pair/{sender_id}/{next(self._pair_ids)}/"
        return {"store_host": self.host, "store_port": self._store.port,
                "prefix": self._prefixes[sender_id]}

    def after_welcome(self, sender_id: str, hello_info: dict) -> None:
        self._groups[sender_id] = _pair_group(self._store, self._prefixes[sender_id], RECEIVER_RANK,
                                              self.pool.buffer.device, self.timeout_s)

    def receive(self, sender_id: str, chunk: KVChunk, frames: list) -> torch.Tensor:
        group = self._groups.get(sender_id)
        if group is None:
            raise RuntimeError(f"no process group with {sender_id}")
        shape = staging_shape(self.pool.layout, len(chunk.dst_page_ids), chunk.layer_start,
                              chunk.layer_end)
        staging = torch.empty(shape, dtype=self.pool.buffer.dtype, device=self.pool.buffer.device)
        work = group.recv([staging], SENDER_RANK, 0)
        if staging.is_cuda:
            work.wait()  # the current stream waits; the group's timeout bounds it
        else:
            work.wait(timedelta(seconds=self.timeout_s))
        return staging

    def drop_sender(self, sender_id: str) -> None:
        self._groups.pop(sender_id, None)


class TorchSenderPlane(SenderPlane):
    def __init__(self, pool, timeout_s: float):
        super().__init__(pool, timeout_s)
        self._groups: dict[str, object] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._in_flight: dict[str, list] = {}  # peer -> [(work, staging)] of the current request

    def connect(self, peer: str, welcome_info: dict) -> None:
        store = dist.TCPStore(welcome_info["store_host"], welcome_info["store_port"],
                              is_master=False, timeout=timedelta(seconds=self.timeout_s))
        self._groups[peer] = _pair_group(store, welcome_info["prefix"], SENDER_RANK,
                                         self.pool.buffer.device, self.timeout_s)

    def prepare(self, peer: str, chunk: KVChunk, src_page_ids: list[int]) -> list:
        buf = self.pool.buffer
        index = page_index(src_page_ids, buf.device)
        self._staging[peer] = gather_pages(buf, index, chunk.layer_start, chunk.layer_end)
        return []

    def finish(self, peer: str, chunk: KVChunk) -> None:
        """Sends are waited for at the request's last chunk, so layer groups pipeline."""
        staging = self._staging.pop(peer)
        in_flight = self._in_flight.setdefault(peer, [])
        in_flight.append((self._groups[peer].send([staging], RECEIVER_RANK, 0), staging))
        if not chunk.last:
            return
        for work, _ in in_flight:
            if staging.is_cuda:
                work.wait()
            else:
                work.wait(timedelta(seconds=self.timeout_s))
        if staging.is_cuda:
            torch.cuda.current_stream().synchronize()
        in_flight.clear()

    def drop_peer(self, peer: str) -> None:
        self._groups.pop(peer, None)
        self._staging.pop(peer, None)
        self._in_flight.pop(peer, None)
