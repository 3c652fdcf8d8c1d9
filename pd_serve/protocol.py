"""Every message that crosses a process boundary, and the one msgpack codec for them.

Each message is a dataclass of plain fields (ints, floats, strings, lists, dicts, bytes) and
rows: typed dataclasses inside a message (a TokenBatch's TokenDeltas, a KVChunks' KVChunks, a
request's SamplingParams). On the wire: msgpack of [type name, field dict], each row a
positional list of its fields. Never pickle, never tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import operator
import types
import typing
from dataclasses import dataclass, field

import msgpack
import zmq
from zmq.utils import z85
from prometheus_client import CollectorRegistry, Counter

from pd_serve.config import MAX_WORKER_TIMEOUT_S
from pd_serve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# ---- KV transfer: sender (prefill) <-> receiver (decode) ------------------------------


@dataclass
class TransferHello:
    """Sender -> receiver, once per pair: who I am and what my KV pool looks like."""

    sender_id: str
    backend: str
    layout: dict  # KVLayout fields
    info: dict = field(default_factory=dict)  # backend-specific (device, ...)
    connection: str = ""  # its socket's identity (KVChunks says why)


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
    connection: str = ""


@dataclass
class KVChunks:
    """Sender -> receiver: every chunk the sender had queued for this receiver, in one message.
    Chunk i's data frames, `frames[i]` of them (tcp: 1), follow the header in order.

    connection (in every sender message): the identity of the socket it was sent on. Under a
    cluster key it is signed with the message, and the receiver refuses a message that comes on
    another connection: one recorded off the wire and sent again by a peer without the key
    (which cannot take the sender's identity while it is connected) changes nothing."""

    chunks: list[KVChunk]
    frames: list[int]
    connection: str = ""


@dataclass
class TransferAck:
    """A request whose KV is in place (ok) or was refused / failed (travels inside TransferAcks)."""

    request_id: str
    ok: bool
    error: str = ""


@dataclass
class TransferAcks:
    """Receiver -> sender: what became of requests' KV."""

    acks: list[TransferAck]


# ---- control plane: workers <-> gateway ---------------------------------------------------


@dataclass
class Logprob:
    """The sampled token's logprob and its top alternatives as (token_id, logprob) pairs: the
    wire form of engine.request.TokenLogprob (`of` and `to_engine` convert, one way each)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 0  # a prompt token's rank in the vocabulary (1: the likeliest); 0: not computed

    @classmethod
    def of(cls, lp) -> Logprob:
        """From an engine TokenLogprob."""
        return cls(lp.token_id, lp.logprob, list(lp.top), lp.rank)

    def to_engine(self):
        from pd_serve.engine.request import TokenLogprob  # (torch: the gateway never needs it)
        return TokenLogprob(self.token_id, self.logprob, list(self.top), self.rank)


@dataclass
class TokenDelta:
    """One request's row in a TokenBatch: its new tokens (with a Logprob each when it asked for
    them); on its last row finished, with a reason ("stop" | "length" | "abort"), or an error."""

    request_id: str
    token_ids: list[int]
    logprobs: list[Logprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str = ""
    cached_tokens: int = 0  # with token 1: prompt tokens whose KV this worker's cache held
    # with token 1, when the request asked for them: prompt token i + 1's logprob at entry i
    prompt_logprobs: list[Logprob] | None = None


@dataclass
class WorkerStatus:
    """Worker -> gateway, at start and every heartbeat: registers (again, after a gateway
    restart) and reports load. `metrics` is the worker's Prometheus text."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    model: str
    incarnation: str = ""  # random per process: a restart under the same worker id is a new one
    transfer_backend: str = ""
    transfer_addresses: list[str] = field(default_factory=list)  # decode: one KV receiver per TP rank
    layout: dict = field(default_factory=dict)  # the model's KV layout (every KV head)
    tp: int = 1
    num_pages: int = 0
    num_free_pages: int = 0
    num_running: int = 0
    num_waiting: int = 0
    max_running_requests: int = 0
    max_prefill_tokens: int = 0  # prompt tokens one step takes (--chunked-prefill-size)
    long_prefill_token_threshold: int = 0  # most of a step one prompt takes while others wait
    schedule_policy: str = ""  # --schedule-policy: "priority" lets requests carry a priority
    max_model_len: int = 0
    draining: bool = False  # after SIGTERM: finishing what it holds; the gateway sends it no more
    metrics: str = ""
    # counts up with each status of an incarnation: the gateway takes only a newer one, so a
    # status recorded off the wire and sent again (from another connection) moves nothing
    seq: int = 0


@dataclass
class WorkerExit:
    """Worker -> gateway, as the worker exits: fail what it still holds now, not after
    --worker-timeout of silence."""

    worker_id: str
    incarnation: str
    reason: str


@dataclass
class Heartbeat:
    """Worker -> gateway from the worker's own heartbeat thread: alive, even mid-step. seq counts
    up per process: a beat no newer than the last one heard is one sent again (refused), so a
    recorded beat cannot keep a hung worker registered."""

    worker_id: str
    incarnation: str = ""
    seq: int = 0


@dataclass
class Admit:
    """Gateway -> decode: reserve pages for this prompt (DESIGN step 3)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
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
    # Leading prompt tokens whose KV decode's prefix cache holds already (whole pages, at least
    # one page short of the prompt): dst_page_ids are the pages after them, the only ones sent.
    cached_tokens: int = 0


@dataclass
class Prefill:
    """Gateway -> prefill: compute the prompt's KV, sample token 1, send the KV to decode."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    decode_addresses: list[str]  # the decode worker's KV receivers, one per TP rank
    dst_page_ids: list[int]  # for the prompt's pages after dst_cached_tokens
    priority: int = 0
    dst_cached_tokens: int = 0  # AdmitReply.cached_tokens: decode holds their KV, not sent


@dataclass
class PrefillDone:
    """Prefill -> gateway: the KV is in decode's pages (ok) and this is token 1; or an error."""

    request_id: str
    ok: bool
    first_token_id: int = -1
    logprob: Logprob | None = None
    error: str = ""
    timings: dict = field(default_factory=dict)
    prompt_logprobs: list[Logprob] | None = None  # as TokenDelta's
    # the KV did not reach decode (the transfer failed): the request may go to another pair
    retryable: bool = False


@dataclass
class StartDecode:
    """Gateway -> decode: the KV has arrived; continue from token 1."""

    request_id: str
    first_token_id: int
    logprob: Logprob | None = None


@dataclass
class Generate:
    """Gateway -> colocated worker: run the whole request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0


@dataclass
class TokenBatch:
    """Decode/colocated -> gateway, once per step: a row for every request with news."""

    worker_id: str
    items: list[TokenDelta]


@dataclass
class AbortRequest:
    """Gateway -> worker: drop the request wherever it is and free its pages."""

    request_id: str


@dataclass
class GatewayPing:
    """Gateway -> worker, every heartbeat: the gateway's incarnation and every request it has
    on this worker. The worker drops whatever else it holds (a lost abort, a restarted
    gateway), and drops everything once no ping has come for `timeout_s` (a dead gateway)."""

    gateway_id: str
    request_ids: list[str]
    timeout_s: float


@dataclass
class Replaced:
    """Gateway -> worker, in answer to a status of a process that a newer one registered under
    the same worker id replaced (the old one hung, then woke): it exits, instead of sending
    statuses the gateway refuses for as long as it lives."""

    worker_id: str
    incarnation: str


MESSAGES = {cls.__name__: cls for cls in (
    TransferHello, TransferWelcome, KVChunks, TransferAbort, TransferAcks, WorkerStatus, WorkerExit, Heartbeat,
    Admit,
    AdmitReply, Prefill, PrefillDone, StartDecode, Generate, TokenBatch, AbortRequest, GatewayPing,
    Replaced)}

# Counted wherever a received message is refused (undecodable, ill-typed, or its cluster-key tag
# does not verify); every process exposes it beside its own metrics.
ERRORS_REGISTRY = CollectorRegistry()
PROTOCOL_ERRORS = Counter("pd_serve:protocol_errors", "received messages refused, by socket",
                          ["socket"], registry=ERRORS_REGISTRY)
TAG_BYTES = 16  # HMAC-SHA256, truncated


class ProtocolError(ValueError):
    """A received message that is not one of ours: undecodable, ill-typed or unauthenticated."""


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _names(cls) -> tuple[str, ...]:
    """Field names, looked up once per class: this runs per KV chunk on the transfer path."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def fields_of(msg) -> dict:
    """A shallow field dict: asdict's deep copy of long page-id lists costs more than the send."""
    return {name: getattr(msg, name) for name in _names(type(msg))}


_WRITERS: dict[type, list] = {}


def wire_fields(msg) -> dict:
    """The message's field dict as it goes on the wire: its rows as the lists of their fields."""
    writers = _WRITERS.get(type(msg))
    if writers is None:
        writers = _WRITERS[type(msg)] = [(name, _writer(hint)) for name, hint
                                         in typing.get_type_hints(type(msg)).items()]
    return {name: getattr(msg, name) if write is None else write(getattr(msg, name))
            for name, write in writers}


def _writer(hint):
    """None for a plain field, else a function that turns the rows in a value of type `hint`
    into the tuples of their fields (msgpack packs tuples as lists). A value that is not the
    row it should be is sent as it is: its reader refuses it."""
    if not _has_rows(hint):
        return None
    if dataclasses.is_dataclass(hint):
        names = _names(hint)
        get = operator.attrgetter(*names)  # (of one name: the value itself, not a tuple)
        built = [(i, w) for i, n in enumerate(names)
                 if (w := _writer(typing.get_type_hints(hint)[n])) is not None]

        def write_row(row):
            if type(row) is not hint:
                return row
            values = get(row) if len(names) > 1 else (get(row),)
            if not built:
                return values
            values = list(values)
            for i, write in built:
                values[i] = write(values[i])
            return values
        return write_row
    (inner,) = [w for h in typing.get_args(hint) if (w := _writer(h)) is not None]
    if typing.get_origin(hint) is list:
        return lambda v: [inner(x) for x in v] if type(v) is list else v
    return lambda v: None if v is None else inner(v)  # `row | None`, as _reader allows


def _has_rows(hint) -> bool:
    return dataclasses.is_dataclass(hint) or any(_has_rows(h) for h in typing.get_args(hint))


class Codec:
    """msgpack of [type name, field dict], optionally authenticated by a cluster key.

    With a key every message starts with a TAG_BYTES HMAC-SHA256 tag of its body, and decode
    refuses a message whose tag does not verify, so only holders of the key can register,
    send tokens or move KV. (The tag authenticates; it does not encrypt.) Decoded messages
    are type-checked field by field, rows included (`_read`), so a handler never sees a list
    where it expects a request id."""

    def __init__(self, key: bytes = b""):
        self.key = key

    def encode(self, msg) -> bytes:
        body = msgpack.packb([type(msg).__name__, wire_fields(msg)], use_bin_type=True)
        return self._tag(body) + body if self.key else body

    def decode(self, data: bytes):
        """Bytes -> a checked message dataclass; ProtocolError otherwise."""
        if self.key:
            tag, data = data[:TAG_BYTES], data[TAG_BYTES:]
            if not hmac.compare_digest(tag, self._tag(data)):
                raise ProtocolError("bad or missing cluster-key tag (is the peer started with "
                                    "the same PD_SERVE_CLUSTER_KEY / --cluster-key-file?)")
        try:
            name, fields = msgpack.unpackb(data, raw=False, strict_map_key=False)  # logit_bias ids
            msg = MESSAGES[name](**fields)
        except Exception as e:  # whatever the bytes are, the caller gets a ProtocolError
            raise ProtocolError(f"undecodable message ({type(e).__name__}: {e})") from None
        if error := _read(msg):
            raise ProtocolError(f"{name}: {error}")
        return msg

    def receive(self, data: bytes, socket: str, peer: str = ""):
        """decode(), or None for a refused message: counted and logged (not every one)."""
        try:
            return self.decode(data)
        except ProtocolError as e:
            refused(socket, f"a message from {peer or 'a peer'}: {e}")
            return None

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self.key, body, hashlib.sha256).digest()[:TAG_BYTES]


def secure_control(sock: zmq.Socket, key: bytes, server: bool) -> None:
    """With a cluster key, the control socket (the gateway's, a worker's to it) speaks CURVE
    under a key pair every key holder derives from the key: a peer without it fails the
    handshake, so it cannot make the gateway buffer a byte (zmq takes a whole message of any
    number of frames before a tag can be checked), and prompts cross the wire encrypted. Set
    before bind / connect; without a key, nothing changes. The KV sockets stay plain: CURVE
    moves bulk KV at a fraction of the plain rate."""
    if not key:
        return
    secret = z85.encode(hmac.new(key, b"pd-serve control curve", hashlib.sha256).digest())
    public = zmq.curve_public(secret)
    sock.curve_secretkey, sock.curve_publickey = secret, public
    if server:
        sock.curve_server = True
    else:
        sock.curve_serverkey = public


def refused(socket: str, what: str) -> None:
    """Count a refused message on `socket`; log the first few, then every 1000th."""
    PROTOCOL_ERRORS.labels(socket=socket).inc()
    count = _REFUSED[socket] = _REFUSED.get(socket, 0) + 1
    if count <= 10 or count % 1000 == 0:
        logger.warning("%s socket: refused %s (%d refused so far)", socket, what, count)


_REFUSED: dict[str, int] = {}
_PLAIN = Codec()
encode, decode = _PLAIN.encode, _PLAIN.decode


# ---- reading: every field's type, rows built from their lists, then each type's own rules ----
class _Bad(Exception):
    """What is wrong with a field's wire value (becomes the ProtocolError's text)."""


_READERS: dict[type, list] = {}


def _read(msg) -> str:
    """'' when every field of a just-decoded `msg` has its annotated type (its rows, built in
    place from their wire lists, included) and the message's own rules hold, else what is wrong."""
    cls = type(msg)
    readers = _READERS.get(cls)
    if readers is None:
        readers = _READERS[cls] = [(name, _reader(hint))
                                   for name, hint in typing.get_type_hints(cls).items()]
    for name, read in readers:
        value = getattr(msg, name)
        try:
            built = read(value)
        except _Bad as e:
            return f"field {name!r} {e}"
        if built is not value:
            setattr(msg, name, built)
    rule = _RULES.get(cls)
    return rule(msg) if rule else ""


def _reader(hint):
    """A function from a wire value of type `hint` to its Python value, raising _Bad; built once
    per field. Plain values are returned as they are, after one predicate (`_checker`); rows are
    built from their positional lists, pairs (tuple hints) from their two-element lists."""
    if not _builds(hint):
        ok = _checker(hint)

        def read_plain(v):
            if ok(v):
                return v
            raise _Bad(f"is not {_name(hint)}: {_short(v)}")
        return read_plain
    if dataclasses.is_dataclass(hint):
        return _row_reader(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [_reader(h) for h in args if h is not type(None)]  # only `row | None` is built
        return lambda v: None if v is None else inner(v)
    if origin is list:
        (item,) = args
        read_item = _reader(item)

        def read_list(v):
            if type(v) is not list:
                raise _Bad(f"is not {_name(hint)}: {_short(v)}")
            return [read_item(x) for x in v]
        return read_list
    if origin is tuple and len(args) == 2 and not any(_builds(h) for h in args):
        first, second = map(_checker, args)

        def read_pair(v):
            if type(v) is list and len(v) == 2 and first(v[0]) and second(v[1]):
                return v[0], v[1]
            raise _Bad(f"is not {_name(hint)}: {_short(v)}")
        return read_pair
    raise TypeError(f"no wire reader for {hint}")


def _builds(hint) -> bool:
    """Whether values of `hint` are built on reading (rows, pairs), not taken as they come."""
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is tuple:
        return True
    return any(_builds(h) for h in typing.get_args(hint))


def _row_reader(cls):
    """A row arrives as the list of its fields, in order, all of them: each field is checked
    (plain ones by a predicate, in place) or built, the row made (a ValueError from its own
    __post_init__, SamplingParams' validation, refuses it), then the row's rule checked. A
    decode step sends a row per running request: this is the codec's hot loop."""
    hints = typing.get_type_hints(cls)
    names = _names(cls)
    plain = [(i, _checker(hints[n])) for i, n in enumerate(names) if not _builds(hints[n])]
    built = [(i, _reader(hints[n])) for i, n in enumerate(names) if _builds(hints[n])]
    size = len(names)

    def read_row(v):
        if type(v) is not list or len(v) != size:
            raise _Bad(f"has a {cls.__name__} row that is not a list of its {size} fields: "
                       f"{_short(v)}")
        for i, ok in plain:
            if not ok(v[i]):
                raise _Bad(f"has a {cls.__name__} whose field {names[i]!r} is not "
                           f"{_name(hints[names[i]])}: {_short(v[i])}")
        for i, read in built:
            try:
                v[i] = read(v[i])  # (v is the decoder's own list)
            except _Bad as e:
                raise _Bad(f"has a {cls.__name__} whose field {names[i]!r} {e}") from None
        try:
            row = cls(*v)
        except (ValueError, TypeError) as e:
            raise _Bad(f"has a {cls.__name__} that is not valid: {e}") from None
        rule = _RULES.get(cls)
        if rule is not None and (error := rule(row)):
            raise _Bad(f"has a {cls.__name__} with {error}")
        return row
    return read_row


def _checker(hint):
    """A predicate for plain values of type `hint`: messages carry long lists of page and token
    ids, so the per-element test is one `type(x) is T`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if len(args) == 2 and type(None) in args:  # the common `X | None`, without a loop
            (ok,) = [_checker(h) for h in args if h is not type(None)]
            return lambda v: v is None or ok(v)
        options = [_checker(h) for h in args]
        return lambda v: any(ok(v) for ok in options)
    if origin is list:
        (item,) = typing.get_args(hint)
        if item in (int, str, bool):  # exact types: True is not an id
            return lambda v: type(v) is list and all(type(x) is item for x in v)
        ok = _checker(item)
        return lambda v: type(v) is list and all(ok(x) for x in v)
    if origin is dict:
        key, value = map(_checker, typing.get_args(hint))
        return lambda v: type(v) is dict and all(key(k) and value(x) for k, x in v.items())
    if hint is type(None):
        return lambda v: v is None
    if hint in (int, str, bool):
        return lambda v: type(v) is hint
    if hint is float:
        return lambda v: type(v) in (int, float)
    return lambda v: isinstance(v, hint)


def _name(hint) -> str:
    return str(hint) if typing.get_args(hint) else getattr(hint, "__name__", None) or str(hint)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_chunks(msg: KVChunks) -> str:
    if len(msg.chunks) != len(msg.frames) or any(n < 0 for n in msg.frames):
        return f"{len(msg.chunks)} chunks with frame counts {_short(msg.frames)}"
    return ""


def _check_chunk(chunk: KVChunk) -> str:
    if not 0 <= chunk.layer_start < chunk.layer_end or chunk.nbytes < 0 or chunk.parts < 1:
        return (f"layers [{chunk.layer_start}, {chunk.layer_end}), nbytes {chunk.nbytes}, parts "
                f"{chunk.parts}")
    if any(len(h) not in (0, 2) for h in (chunk.src_heads, chunk.dst_heads)):
        return "heads neither [] nor [start, end]"
    if any(p < 0 for p in chunk.dst_page_ids) or any(p < 0 for p in chunk.src_page_ids):
        return "a negative page id"
    return ""


def _bad_token_ids(ids) -> str:
    """'' when every id is in [0, MAX_TOKEN_ID): the tokenizer cannot even look up a larger one."""
    if ids and min(ids) < 0:
        return "a negative token id"
    if ids and max(ids) >= MAX_TOKEN_ID:
        return f"a token id of {MAX_TOKEN_ID} or more"
    return ""


def _check_delta(row: TokenDelta) -> str:
    if row.logprobs is not None and len(row.logprobs) != len(row.token_ids):
        return f"{len(row.logprobs)} logprobs for {len(row.token_ids)} tokens"
    if row.finish_reason not in FINISH_REASONS:
        return f"finish reason {_short(row.finish_reason)}"
    return _bad_token_ids(row.token_ids)


def _check_logprob(row: Logprob) -> str:
    if len(row.top) > MAX_TOP_LOGPROBS:
        return f"{len(row.top)} top logprobs (at most {MAX_TOP_LOGPROBS})"
    if not 0 <= row.rank < 2**31:
        return f"rank {row.rank}"
    return _bad_token_ids([row.token_id] + [t for t, _ in row.top])


def _check_first_token(msg: PrefillDone | StartDecode) -> str:
    if isinstance(msg, PrefillDone) and not msg.ok:
        return ""
    return _bad_token_ids([msg.first_token_id])


def _check_ping(msg: GatewayPing) -> str:
    if not 0 < msg.timeout_s <= MAX_WORKER_TIMEOUT_S:  # (NaN fails too)
        return f"timeout {msg.timeout_s} s is not in (0, {MAX_WORKER_TIMEOUT_S}]"
    return ""


def _check_status(msg: WorkerStatus) -> str:
    if msg.role not in ROLES:
        return f"role {_short(msg.role)} is not one of {', '.join(ROLES)}"
    if msg.tp < 1 or msg.num_pages < 0 or msg.num_free_pages < 0 or msg.seq < 0:
        return f"tp {msg.tp}, pages {msg.num_free_pages}/{msg.num_pages}, seq {msg.seq}"
    return ""


def _nonnegative_pages(msg) -> str:
    return "negative page id" if any(p < 0 for p in msg.dst_page_ids) else ""


ROLES = ("prefill", "decode", "colocated")
FINISH_REASONS = (None, "stop", "length", "abort")  # engine.request.FinishReason's values
MAX_TOP_LOGPROBS = 20  # SamplingParams.logprobs' upper bound
MAX_TOKEN_ID = 2**31  # far above any vocabulary; the tokenizer's ids are 32-bit
_RULES = {
    KVChunk: _check_chunk,
    KVChunks: _check_chunks,
    Logprob: _check_logprob,
    TokenDelta: _check_delta,
    WorkerStatus: _check_status,
    PrefillDone: _check_first_token,
    StartDecode: _check_first_token,
    GatewayPing: _check_ping,
    AdmitReply: _nonnegative_pages,
    Prefill: _nonnegative_pages,
}
