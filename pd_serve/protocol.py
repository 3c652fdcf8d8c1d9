"""Every message that crosses a process boundary, and the one msgpack codec for them.

Each message is a dataclass of plain fields (ints, floats, strings, lists, dicts, bytes).
On the wire: msgpack of [type name, field dict]. Never pickle, never tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack

# ---- KV transfer: sender (prefill) <-> receiver (decode) ------------------------------


@dataclass
class TransferHello:
    """Sender -> receiver, once per pair: who I am and what my KV pool looks like."""

    sender_id: str
    backend: str
    layout: dict  # KVLayout fields
    info: dict = field(default_factory=dict)  # backend-specific (device, ...)


@dataclass
class TransferWelcome:
    """Receiver -> sender: the handshake result; `error` is set when the pair cannot work."""

    ok: bool
    error: str = ""
    info: dict = field(default_factory=dict)  # backend-specific (store port, IPC handles, ...)


@dataclass
class KVChunk:
    """Sender -> receiver: layers [layer_start, layer_end) of a request's pages follow.

    The data goes in the frames after this header (tcp), over the pair's process group (torch),
    or is already in the receiver's pool (ipc). `last` marks the request's final chunk.
    """

    request_id: str
    dst_page_ids: list[int]
    layer_start: int
    layer_end: int
    nbytes: int
    last: bool
    src_page_ids: list[int] = field(default_factory=list)  # ipc: where the receiver reads


@dataclass
class TransferAbort:
    """Sender -> receiver: the request's KV will not arrive."""

    request_id: str
    reason: str = ""


@dataclass
class TransferAck:
    """Receiver -> sender: the request's KV is in place (ok) or was refused / failed."""

    request_id: str
    ok: bool
    error: str = ""


MESSAGES = {cls.__name__: cls for cls in (TransferHello, TransferWelcome, KVChunk, TransferAbort,
                                          TransferAck)}


def encode(msg) -> bytes:
    return msgpack.packb([type(msg).__name__, dataclasses.asdict(msg)], use_bin_type=True)


def decode(data: bytes):
    """Bytes -> message dataclass. Unknown types or fields raise ValueError."""
    try:
        name, fields = msgpack.unpackb(data, raw=False)
        return MESSAGES[name](**fields)
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"undecodable message ({type(e).__name__}: {e})") from None
