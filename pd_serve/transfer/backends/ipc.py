"""ipc: same host, CUDA IPC. The receiver maps the sender's pool and copies the pages itself.

The sender exports its KV pool once per pair (a CUDA IPC description as plain msgpack fields,
never a pickle). The receiver maps it into its own device's address space (the driver enables
peer access for it), so its copy kernel reads the source pages over NVLink and writes its
reserved pages in one pass: no gather on the sender's GPU, no staging copy. Pulling rather than
pushing means nothing ever writes into the decode pool except the decode process itself, under
the lock that checks the reservation.
"""

from __future__ import annotations

import inspect

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from kernels.kv_copy import CopyGraph
from pd_serve.protocol import KVChunk
from pd_serve.transfer.base import (TRACE, ReceiverPlane, SenderPlane, head_range, now,
                                    on_stream, trace)

# The only classes a description may name when it is rebuilt.
_CLASSES = {c.__module__ + "." + c.__qualname__: c for c in
            (torch.Tensor, torch.nn.Parameter, torch.UntypedStorage, torch.TypedStorage)}
_REBUILD_ARGS = list(inspect.signature(rebuild_cuda_tensor).parameters)


def export_cuda_tensor(tensor: torch.Tensor) -> list:
    """A CUDA tensor -> msgpack-able description another process can map (owner keeps it alive)."""
    _, args = reduce_tensor(tensor)
    out = []
    for a in args:
        if isinstance(a, type):
            out.append({"class": a.__module__ + "." + a.__qualname__})
        elif isinstance(a, torch.dtype):
            out.append({"dtype": str(a).removeprefix("torch.")})
        elif isinstance(a, tuple):
            out.append({"tuple": list(a)})
        else:
            out.append(a)
    return out


def import_cuda_tensor(description: list, device: torch.device | None = None) -> torch.Tensor:
    """Map an exported tensor. With `device`, the memory is mapped into that device's address
    space (peer access enabled by the driver), so kernels there read it directly; the tensor
    then reports `device` although its memory stays on the owner's GPU."""
    args = []
    for a in description:
        if isinstance(a, dict) and "class" in a:
            if a["class"] not in _CLASSES:
                raise ValueError(f"IPC description names an unexpected class {a['class']!r}")
            args.append(_CLASSES[a["class"]])
        elif isinstance(a, dict) and "dtype" in a:
            args.append(getattr(torch, a["dtype"]))
        elif isinstance(a, dict) and "tuple" in a:
            args.append(tuple(a["tuple"]))
        else:
            args.append(a)
    if device is not None:
        args[_REBUILD_ARGS.index("storage_device")] = device.index
    return rebuild_cuda_tensor(*args)


class IpcSenderPlane(SenderPlane):
    sends_src_page_ids = True
    waits_on_host = True  # the receiver reads the pages as soon as it has the header
    chunked = False  # the receiver reads the pages in place: nothing to overlap here

    def __init__(self, pool, timeout_s: float):
        super().__init__(pool, timeout_s)
        if not pool.buffer.is_cuda:
            raise ValueError("--transfer-backend ipc needs a CUDA KV pool; use tcp or torch on CPU")

    def hello_info(self) -> dict:
        return {"pool": export_cuda_tensor(self.pool.buffer),
                "device_uuid": str(torch.cuda.get_device_properties(self.pool.buffer.device).uuid)}

    def prepare(self, peer: str, chunk: KVChunk, src_page_ids: list[int],
                ready: torch.cuda.Event | None) -> list:
        # The sender waited for `ready` already (waits_on_host). The receiver reads the pages in
        # place; they stay allocated until its ack.
        return []


class IpcReceiverPlane(ReceiverPlane):
    """Chunks taken together are copied together: `receive` collects their page ids per sender,
    layer range and head ranges (a tensor-parallel hand-off), `flush` copies each such group in
    one kernel, replayed from a CUDA graph made for that group's key on its first copy (a
    Triton launch per flush cost more host time than the copy of 8 MiB takes)."""

    def __init__(self, pool, timeout_s: float, host: str):
        super().__init__(pool, timeout_s)
        if not pool.buffer.is_cuda:
            raise ValueError("--transfer-backend ipc needs a CUDA KV pool; use tcp or torch on CPU")
        self._remote: dict[str, torch.Tensor] = {}
        self._held: dict[tuple, tuple[list[int], list[int]]] = {}
        self._graphs: dict[tuple, CopyGraph] = {}

    def after_welcome(self, sender_id: str, hello_info: dict) -> None:
        self.drop_sender(sender_id)  # a sender back under its old id: its graphs read the old pool
        self._remote[sender_id] = import_cuda_tensor(hello_info["pool"], self.device)

    def receive(self, sender_id: str, chunk: KVChunk, frames: list,
                dst_page_ids: list[int] | None) -> None:
        if sender_id not in self._remote:
            raise RuntimeError(f"no mapped pool of {sender_id}")
        if dst_page_ids is None:
            return  # nothing to consume: the data stays in the sender's pool
        if len(chunk.src_page_ids) != len(dst_page_ids):
            raise ValueError(f"chunk of {chunk.request_id} names {len(chunk.src_page_ids)} source "
                             f"pages for {len(dst_page_ids)} destination pages")
        # The copy kernel does not check its indices: pages and heads outside the sender's
        # pool would read memory that is not KV.
        remote = self._remote[sender_id]  # [L, 2, P, S, H, D]
        if any(not 0 <= p < remote.shape[2] for p in chunk.src_page_ids):
            raise ValueError(f"chunk of {chunk.request_id} names source pages outside the "
                             f"sender's {remote.shape[2]}")
        src_heads = head_range(chunk.src_heads) or (0, remote.shape[4])
        dst_heads = head_range(chunk.dst_heads) or (0, self.pool.layout.num_kv_heads)
        if (not 0 <= src_heads[0] < src_heads[1] <= remote.shape[4]
                or src_heads[1] - src_heads[0] != dst_heads[1] - dst_heads[0]):
            raise ValueError(f"chunk of {chunk.request_id} copies KV heads {src_heads} of the "
                             f"sender's {remote.shape[4]} into heads {dst_heads}")
        key = (sender_id, chunk.layer_start, chunk.layer_end, head_range(chunk.src_heads),
               head_range(chunk.dst_heads))
        src, dst = self._held.setdefault(key, ([], []))
        src.extend(chunk.src_page_ids)
        dst.extend(dst_page_ids)

    def flush(self) -> None:
        held, self._held = self._held, {}
        for key, (src, dst) in held.items():
            if not src:
                continue
            with on_stream(self.stream):
                start = now()
                graph = self._graphs.get(key) or self._graph(key)
                ids = self.page_ids.stage([len(src)], src, dst)
                staged = now()
                graph(ids)
                self.page_ids.sent()
            if TRACE:
                trace("flush", f"{len(src)}-pages", start, staged=staged, launched=now())

    def _graph(self, key: tuple) -> CopyGraph:
        sender_id, layer_start, layer_end, src_heads, dst_heads = key
        remote = self._remote.get(sender_id)
        if remote is None:
            raise RuntimeError(f"no mapped pool of {sender_id}")
        graph = self._graphs[key] = CopyGraph(remote, self.pool.buffer, layer_start, layer_end,
                                              src_heads, dst_heads)
        return graph

    def drop_sender(self, sender_id: str) -> None:
        self._remote.pop(sender_id, None)
        for held in (self._held, self._graphs):
            for key in [k for k in held if k[0] == sender_id]:
                del held[key]
