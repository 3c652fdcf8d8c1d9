"""ipc: same host, CUDA IPC. The receiver maps the sender's pool and copies the pages itself.

The sender exports its KV pool once per pair (a CUDA IPC description as plain msgpack fields,
never a pickle). On each chunk header the receiver, holding the reservation for that request,
gathers the source pages from the mapped pool over NVLink and writes them into its reserved
pages. Pulling rather than pushing means nothing ever writes into the decode pool except the
decode process itself, under the lock that checks the reservation.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import reduce_tensor

from kernels.kv_copy import gather_pages
from pd_serve.protocol import KVChunk
from pd_serve.transfer.base import ReceiverPlane, SenderPlane, page_index

# The only classes a description may name when it is rebuilt.
_CLASSES = {c.__module__ + "." + c.__qualname__: c for c in
            (torch.Tensor, torch.nn.Parameter, torch.UntypedStorage, torch.TypedStorage)}


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


def import_cuda_tensor(description: list) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

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
    return rebuild_cuda_tensor(*args)


class IpcSenderPlane(SenderPlane):
    def __init__(self, pool, timeout_s: float):
        super().__init__(pool, timeout_s)
        if not pool.buffer.is_cuda:
            raise ValueError("--transfer-backend ipc needs a CUDA KV pool; use tcp or torch on CPU")

    def hello_info(self) -> dict:
        return {"pool": export_cuda_tensor(self.pool.buffer),
                "device_uuid": str(torch.cuda.get_device_properties(self.pool.buffer.device).uuid)}

    def prepare(self, peer: str, chunk: KVChunk, src_page_ids: list[int]) -> list:
        return []  # the receiver reads the pages in place; they stay allocated until its ack


class IpcReceiverPlane(ReceiverPlane):
    def __init__(self, pool, timeout_s: float, host: str):
        super().__init__(pool, timeout_s)
        if not pool.buffer.is_cuda:
            raise ValueError("--transfer-backend ipc needs a CUDA KV pool; use tcp or torch on CPU")
        self._remote: dict[str, torch.Tensor] = {}

    def after_welcome(self, sender_id: str, hello_info: dict) -> None:
        self._remote[sender_id] = import_cuda_tensor(hello_info["pool"])

    def receive(self, sender_id: str, chunk: KVChunk, frames: list) -> torch.Tensor:
        remote = self._remote.get(sender_id)
        if remote is None:
            raise RuntimeError(f"no mapped pool of {sender_id}")
        # Gather on the GPU that owns the source pool, then one peer-to-peer copy to ours.
        with torch.cuda.device(remote.device):
            index = page_index(chunk.src_page_ids, remote.device)
            staging = gather_pages(remote, index, chunk.layer_start, chunk.layer_end)
        return staging.to(self.pool.buffer.device)

    def drop_sender(self, sender_id: str) -> None:
        self._remote.pop(sender_id, None)
