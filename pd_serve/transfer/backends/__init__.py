"""Backend registry: --transfer-backend torch | ipc | tcp | nixl."""

from __future__ import annotations

from pd_serve.cache.pool import KVPool
from pd_serve.transfer.base import BACKENDS, ReceiverPlane, SenderPlane, TransferError


def _planes(backend: str):
    if backend == "tcp":
        from pd_serve.transfer.backends.tcp import TcpReceiverPlane, TcpSenderPlane
        return TcpReceiverPlane, TcpSenderPlane
    if backend == "torch":
        from pd_serve.transfer.backends.torch_dist import TorchReceiverPlane, TorchSenderPlane
        return TorchReceiverPlane, TorchSenderPlane
    if backend == "ipc":
        from pd_serve.transfer.backends.ipc import IpcReceiverPlane, IpcSenderPlane
        return IpcReceiverPlane, IpcSenderPlane
    if backend == "nixl":
        from pd_serve.transfer.backends.nixl import NixlReceiverPlane, NixlSenderPlane, check_nixl
        check_nixl()
        return NixlReceiverPlane, NixlSenderPlane
    raise TransferError(f"--transfer-backend {backend!r} is not one of {', '.join(BACKENDS)}")


def make_receiver_plane(backend: str, pool: KVPool, timeout_s: float, host: str) -> ReceiverPlane:
    return _planes(backend)[0](pool, timeout_s, host)


def make_sender_plane(backend: str, pool: KVPool, timeout_s: float) -> SenderPlane:
    return _planes(backend)[1](pool, timeout_s)
