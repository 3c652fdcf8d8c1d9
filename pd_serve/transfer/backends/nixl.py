"""NIXL (RDMA through UCX). Only the availability check exists so far."""

from __future__ import annotations

from pd_serve.transfer.base import TransferError


def check_nixl() -> None:
    try:
        import nixl  # noqa: F401
    except ImportError:
        raise TransferError("--transfer-backend nixl needs the 'nixl' package, which is not "
                            "installed; use --transfer-backend torch, ipc or tcp") from None
    raise TransferError("--transfer-backend nixl: the nixl package imports, but pd-serve's NIXL "
                        "backend is not written yet; use --transfer-backend torch, ipc or tcp")
