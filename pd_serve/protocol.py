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
    """Layers [layer_start, layer_end) of a request's pages (travels inside KVChunks).

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
    # KV heads [start, end) of the sender's and of the receiver's pool ([]: all of them); set
    # when pools of different TP sizes hand off (transfer/heads.py)
    src_heads: list[int] = field(default_factory=list)
    dst_heads: list[int] = field(default_factory=list)
    parts: int = 1  # senders that each send part of the request's heads to this receiver


@dataclass
class TransferAbort:
    """Sender -> receiver: the request's KV will not arrive."""

    request_id: str
    reason: str = ""


@dataclass
class KVChunks:
    """Sender -> receiver: every chunk the sender had queued for this receiver, in one message.
    `chunks` holds KVChunk field dicts; chunk i's data frames, `frames[i]` of them (tcp: 1),
    follow the header in order."""

    chunks: list[dict]
    frames: list[int]


@dataclass
class TransferAcks:
    """Receiver -> sender: requests whose KV is in place (ok) or was refused / failed, as
    [request_id, ok, error] triples."""

    acks: list[list]


# ---- control plane: workers <-> gateway ---------------------------------------------------


@dataclass
class WorkerStatus:
    """Worker -> gateway, at start and every heartbeat: registers (again, after a gateway
    restart) and reports load. `metrics` is the worker's Prometheus text."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    model: str
    transfer_backend: str = ""
    transfer_addresses: list[str] = field(default_factory=list)  # decode: one KV receiver per TP rank
    layout: dict = field(default_factory=dict)  # the model's KV layout (every KV head)
    tp: int = 1
    num_pages: int = 0
    num_free_pages: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_outstanding_tokens: int = 0
    max_model_len: int = 0
    metrics: str = ""


@dataclass
class Heartbeat:
    """Worker -> gateway from the worker's own heartbeat thread: alive, even mid-step."""

    worker_id: str


@dataclass
class Admit:
    """Gateway -> decode: reserve pages for this prompt (DESIGN step 3)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict
    priority: int = 0


@dataclass
class AdmitReply:
    """Decode -> gateway: the reserved pages, or why not (full: retry later)."""

    request_id: str
    ok: bool
    dst_page_ids: list[int] = field(default_factory=list)
    transfer_addresses: list[str] = field(default_factory=list)  # one per decode TP rank
    error: str = ""
    retryable: bool = False


@dataclass
class Prefill:
    """Gateway -> prefill: compute the prompt's KV, sample token 1, send the KV to decode."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict
    decode_addresses: list[str]  # the decode worker's KV receivers, one per TP rank
    dst_page_ids: list[int]
    priority: int = 0


@dataclass
class PrefillDone:
    """Prefill -> gateway: the KV is in decode's pages (ok) and this is token 1; or an error."""

    request_id: str
    ok: bool
    first_token_id: int = -1
    logprob: dict | None = None
    error: str = ""
    timings: dict = field(default_factory=dict)


@dataclass
class StartDecode:
    """Gateway -> decode: the KV has arrived; continue from token 1."""

    request_id: str
    first_token_id: int
    logprob: dict | None = None


@dataclass
class Generate:
    """Gateway -> colocated worker: run the whole request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict
    priority: int = 0


@dataclass
class TokenBatch:
    """Decode/colocated -> gateway, once per step: every request's new tokens.

    items: [request_id, new_token_ids, logprobs (list of dicts) or None, finished,
    finish_reason or None, error] per request.
    """

    worker_id: str
    items: list[list]


@dataclass
class AbortRequest:
    """Gateway -> worker: drop the request wherever it is and free its pages."""

    request_id: str


MESSAGES = {cls.__name__: cls for cls in (
    TransferHello, TransferWelcome, KVChunks, TransferAbort, TransferAcks, WorkerStatus, Heartbeat, Admit,
    AdmitReply, Prefill, PrefillDone, StartDecode, Generate, TokenBatch, AbortRequest)}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def fields_of(msg) -> dict:
    """A shallow field dict: fields are plain values, and asdict's deep copy of long page-id
    lists costs more than the send. (Field names are looked up once per class: this runs per
    KV chunk on the transfer path.)"""
    names = _FIELD_NAMES.get(type(msg))
    if names is None:
        names = _FIELD_NAMES[type(msg)] = tuple(f.name for f in dataclasses.fields(msg))
    return {name: getattr(msg, name) for name in names}


def encode(msg) -> bytes:
    return msgpack.packb([type(msg).__name__, fields_of(msg)], use_bin_type=True)


def decode(data: bytes):
    """Bytes -> message dataclass. Unknown types or fields raise ValueError."""
    try:
        name, fields = msgpack.unpackb(data, raw=False, strict_map_key=False)  # logit_bias ids
        return MESSAGES[name](**fields)
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"undecodable message ({type(e).__name__}: {e})") from None
