"""Hostile and broken peers, over real sockets: crafted, garbage and fuzzed messages sent to a
KVReceiver by a rogue zmq DEALER, and to a KVSender by a fake receiver (a zmq ROUTER the test
answers from), and peers without the cluster key. After all of it the I/O threads are alive,
the refused messages were counted, nothing was written outside a real transfer, and a real
transfer lands bit-exact."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import types
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import msgpack
import pytest
import torch
import zmq

from pd_serve import protocol
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.protocol import (ERRORS_REGISTRY, KVChunk, KVChunks, Logprob, TransferAbort,
                               TransferAck, TransferAcks, TransferHello, TransferWelcome)
from pd_serve.transfer.base import TransferError
from pd_serve.transfer.receiver import HEADER_SLACK_BYTES, KVReceiver
from pd_serve.transfer.sender import REPLY_MAX_BYTES, KVSender

from peer import LAYOUT, NUM_PAGES, POISON, SEED, poisoned_pool, seeded_pool  # noqa: E402
from test_transfer import bits, wait_results  # noqa: E402

WAIT_S = 60  # generous: the CI box is a loaded 2-core machine
KEY, OTHER_KEY = b"k" * 32, b"o" * 32
PAGE = LAYOUT.bytes_per_page


def errors(socket: str) -> float:
    value = ERRORS_REGISTRY.get_sample_value("pd_serve:protocol_errors_total", {"socket": socket})
    return value or 0.0


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s"
        time.sleep(0.01)


def raw(name: str, **fields) -> bytes:
    """A message framed as the keyless codec frames it, whatever its fields hold (rows, such
    as a KVChunk, as the list of their fields)."""
    return msgpack.packb([name, fields], use_bin_type=True, default=lambda row: [
        getattr(row, f.name) for f in dataclasses.fields(row)])


def dealer(address: str, identity: bytes = b"") -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def receiver(key: bytes = b"") -> KVReceiver:
    return KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=WAIT_S, key=key)


def sender(key: bytes = b"", timeout_s: float = WAIT_S) -> KVSender:
    return KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "tcp", timeout_s=timeout_s, key=key)


def lands(rec: KVReceiver, snd: KVSender, request_id: str, src: list[int], dst: list[int]) -> None:
    """A real transfer from `snd` into `rec` arrives, bit-exact."""
    snd.connect(rec.address)
    rec.expect(request_id, dst)
    snd.send(request_id, rec.address, src, dst)
    (sent,) = wait_results(snd, 1, WAIT_S)
    (received,) = wait_results(rec, 1, WAIT_S)
    assert sent.ok and received.ok, (sent, received)
    expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
    assert torch.equal(bits(rec.pool.buffer[:, :, dst]), bits(expected[:, :, src]))


def chunk(request_id: str = "ghost", pages=(3,), **change) -> KVChunk:
    """A KVChunk of every layer of `pages`, with `change` applied (any value: `raw` sends it)."""
    return dataclasses.replace(KVChunk(request_id, list(pages), 0, LAYOUT.num_layers,
                                       len(pages) * PAGE, True), **change)


def chunks(*rows: KVChunk) -> list[bytes]:
    """A KVChunks message with each chunk's data frame (of its nbytes)."""
    return [raw("KVChunks", chunks=list(rows), frames=[1] * len(rows)),
            *[bytes(c.nbytes) for c in rows]]


# ---- the receiver -------------------------------------------------------------------------

def test_a_peer_squatting_a_senders_id_cannot_stall_its_transfers():
    """A peer without the key connects first under the sender's id as its ZMQ identity (a
    ROUTER refuses a second connection under one identity: the sender's handshake went
    unanswered while the peer stayed); the sender's identity has a random part of its own."""
    rec, snd = receiver(KEY), sender(KEY)
    squatter = dealer(rec.address, snd.sender_id.encode())
    before = errors("kv-receiver")
    try:
        squatter.send(b"junk")
        wait_for(lambda: errors("kv-receiver") > before, "the junk refused")
        lands(rec, snd, "r", [1], [2])
    finally:
        squatter.close()
        rec.close()
        snd.close()


def test_crafted_messages_are_refused_and_the_receiver_keeps_serving():
    rec = receiver()
    rec.expect("bait", [3])  # a chunk for other pages fails it
    rec.expect("framed", [5])  # a message whose frames do not add up fails it
    rec.expect("kept", [6])  # an abort from a peer that sent none of it is ignored
    hello = protocol.encode(TransferHello("rogue", "tcp", asdict(LAYOUT)))
    garbage = random.Random(1).randbytes(8)
    counted = [  # each is refused and counted
        [garbage], [garbage, garbage], [garbage, garbage, garbage],
        [raw("TransferAbort", request_id=["kept"], reason="")],
        [raw("TransferHello", sender_id="rogue", backend="tcp", layout=5, info={})],
        [raw("KVChunks", chunks=[chunk(request_id=["kept"])], frames=[1]), bytes(PAGE)],
        [raw("KVChunks", chunks=[chunk(), chunk()], frames=[1]), bytes(PAGE)],
        [raw("NoSuchMessage")],
        [hello, b"a frame after it"],
        [protocol.encode(TransferAcks([TransferAck("kept", True)]))],  # not a receiver's message
        chunks(chunk(layer_end=99)),  # layers, heads, parts and size outside the pool
        chunks(chunk(dst_heads=[1, 5], nbytes=4 * PAGE // 2)),
        chunks(chunk(parts=9)),
        chunks(chunk(nbytes=PAGE - 1)),
        [protocol.encode(KVChunks([chunk("framed", [5])], [1]))],  # its data frame missing
        [*chunks(chunk("framed", [5])), bytes(PAGE)],  # a frame too many
    ]
    before = errors("kv-receiver")
    rogue = dealer(rec.address, b"rogue")
    for frames in counted:
        rogue.send_multipart(frames)
    rogue.send_multipart(chunks(chunk("bait", [4])))  # pages not reserved for it
    rogue.send_multipart(chunks(chunk("ghost", [7])))  # never reserved
    rogue.send(protocol.encode(TransferAbort("kept", "not yours")))
    rogue.send(garbage)  # counted once all before it are taken
    wait_for(lambda: errors("kv-receiver") >= before + len(counted) + 1, "count of refused messages")
    failed = {r.request_id: r.error for r in wait_results(rec, 2, WAIT_S)}
    assert "destination pages differ" in failed["bait"] and "frames" in failed["framed"], failed
    assert rec.num_expected == 1  # "kept"
    rec.cancel("kept")
    assert (rec.pool.buffer == POISON).all()
    assert rec.alive and not rec.error
    lands(rec, sender(), "real", [7, 1, 30], [10, 11, 12])
    rogue.close()
    rec.close()


def test_a_frame_over_the_cap_is_dropped_with_its_connection():
    rec = receiver()
    cap = rec.pool.num_bytes + HEADER_SLACK_BYTES  # follows the pool
    assert rec._sock.getsockopt(zmq.MAXMSGSIZE) == cap
    before = errors("kv-receiver")
    rogue = dealer(rec.address)
    rogue.send(bytes(cap + 1))  # never taken: zmq drops the connection (the rogue reconnects)
    rogue.send(b"garbage")
    wait_for(lambda: errors("kv-receiver") >= before + 1, "the garbage refused")
    time.sleep(0.5)
    assert errors("kv-receiver") == before + 1 and rec.alive
    lands(rec, sender(), "real", [7], [10])
    rogue.close()
    rec.close()


@pytest.mark.parametrize("layout", [dict(asdict(LAYOUT), k_scales=5), dict(asdict(LAYOUT), pages=4),
                                    {"num_layers": "4"}, {1: 2}])
def test_a_hello_with_a_malformed_layout_is_answered_with_a_refusal(layout):
    rec = receiver()
    rogue = dealer(rec.address)
    rogue.send(protocol.encode(TransferHello("rogue", "tcp", layout)))
    assert rogue.poll(WAIT_S * 1000)
    welcome = protocol.decode(rogue.recv())
    assert not welcome.ok and "malformed hello" in welcome.error, welcome
    assert rec.alive
    rogue.close()
    rec.close()


def test_chunks_out_of_layer_order_or_short_of_layers_are_refused():
    """A sender's part must cover every layer of every reserved page, group after group: a
    request never completes with layers missing (say, when a message was dropped)."""
    rec = receiver()
    layer = PAGE // LAYOUT.num_layers
    cases = {  # request id: its chunks
        "skips": [chunk("skips", [1, 2], layer_start=1, nbytes=2 * 3 * layer)],
        "short": [chunk("short", [5], layer_end=2, nbytes=2 * layer)],
        "mixed": [chunk("mixed", [20], last=False),
                  chunk("mixed", [21], layer_end=2, nbytes=2 * layer)],
        "empty": [chunk("empty", [], nbytes=0)],
    }
    rogue = dealer(rec.address)
    for request_id, rows in cases.items():
        rec.expect(request_id, [p for c in rows for p in c.dst_page_ids] or [30])
        rogue.send_multipart(chunks(*rows))
    failed = {r.request_id: r.error for r in wait_results(rec, len(cases), WAIT_S)}
    assert "layers [1, 4) do not follow layer 0" in failed["skips"], failed
    assert "leaves layers [2, 4) unwritten" in failed["short"], failed
    assert "in the middle of layer group [0, 4)" in failed["mixed"], failed
    assert "destination pages differ" in failed["empty"], failed
    untouched = [p for p in range(NUM_PAGES) if p != 20]  # the one chunk in order
    assert (rec.pool.buffer[:, :, untouched] == POISON).all()
    rogue.close()
    rec.close()


# A seeded fuzzer over every message type: each field gets a value of its annotated type (small,
# so many messages pass the codec and reach the receiver's own checks) or any msgpack value.
def anything(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 7)
    if kind == 7:
        return [anything(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 8:
        return {rng.choice(["request_id", "x", 1, b"k"]): anything(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    return (lambda: rng.randint(-2**63, 2**63 - 1), lambda: rng.randint(-3, 70), rng.random,
            lambda: rng.random() < 0.5, lambda: None, lambda: rng.choice(["", "req", "x" * 300]),
            lambda: rng.randbytes(rng.randrange(9)))[kind]()


def typed(rng: random.Random, hint):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return typed(rng, rng.choice(typing.get_args(hint)))
    if origin is list:
        (item,) = typing.get_args(hint)
        return [typed(rng, item) for _ in range(rng.randrange(4))]
    if origin is tuple:
        return [typed(rng, h) for h in typing.get_args(hint)]
    if origin is dict:
        key, value = typing.get_args(hint)
        return {typed(rng, key): typed(rng, value) for _ in range(rng.randrange(3))}
    if dataclasses.is_dataclass(hint):
        return row(rng, hint)
    simple = {int: lambda: rng.randint(-1, 8), float: lambda: rng.uniform(-1, 9),
              bool: lambda: rng.random() < 0.5, str: lambda: rng.choice(["", "req", "ghost"]),
              type(None): lambda: None, dict: lambda: {"k": anything(rng, 1)},
              list: lambda: [anything(rng, 1) for _ in range(rng.randrange(3))]}
    return simple[hint]()


def row(rng: random.Random, cls) -> list:
    """A row as it travels, the list of its fields: half the time each of its type, else a
    field may be missing or anything."""
    return list(fields(rng, cls).values())


def plausible_chunk(rng: random.Random) -> KVChunk:
    """A chunk the codec takes: pages of this pool, a consistent size, maybe for "req"."""
    start = rng.randrange(LAYOUT.num_layers)
    end = rng.randrange(start + 1, LAYOUT.num_layers + 1)
    pages = rng.sample(range(NUM_PAGES), rng.randrange(4))
    return chunk(rng.choice(["req", "ghost"]), pages, layer_start=start, layer_end=end,
                 nbytes=len(pages) * (end - start) * PAGE // LAYOUT.num_layers,
                 last=rng.random() < 0.5)


def plausible_sampling(rng: random.Random) -> list:
    """A SamplingParams row the codec takes (most often), or one of random fields."""
    if rng.random() < 0.3:
        return row(rng, SamplingParams)
    params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.7]),
                            seed=rng.choice([None, 3]), logprobs=rng.choice([None, 2]))
    return list(protocol.fields_of(params).values())


def plausible_logprobs(rng: random.Random, delta: dict) -> list | None:
    """A Logprob row per token (or none), as a TokenDelta the codec takes has them."""
    tokens = delta.get("token_ids")
    if rng.random() < 0.3 or not isinstance(tokens, list):
        return typed(rng, list[Logprob] | None)
    return [row(rng, Logprob) for _ in tokens]


SAMPLING = lambda rng, _: plausible_sampling(rng)  # noqa: E731
SPECIAL = {  # (message or row, field) -> a value given the fields so far
    ("Admit", "sampling"): SAMPLING,
    ("Prefill", "sampling"): SAMPLING,
    ("Generate", "sampling"): SAMPLING,
    ("TokenDelta", "logprobs"): plausible_logprobs,
    ("TokenDelta", "finish_reason"): lambda rng, _: rng.choice([None, "stop", "length", "abort", "eos"]),
    ("KVChunks", "chunks"): lambda rng, _: [
        plausible_chunk(rng) if rng.random() < 0.7 else row(rng, KVChunk)
        for _ in range(rng.randrange(4))],
    ("KVChunks", "frames"): lambda rng, msg: ([1] * len(msg["chunks"]) if rng.random() < 0.8 and
                                              isinstance(msg.get("chunks"), list)
                                              else typed(rng, list[int])),
    ("TransferAcks", "acks"): lambda rng, _: [row(rng, TransferAck) for _ in range(rng.randrange(3))],
    ("TransferHello", "layout"): lambda rng, _: {**asdict(LAYOUT), **(
        {rng.choice(list(asdict(LAYOUT))): anything(rng)} if rng.random() < 0.5 else {})},
}


def fields(rng: random.Random, cls) -> dict:
    """Half the time every field has its type; else each may be missing or anything."""
    out, mutate = {}, rng.random() < 0.5
    for name, hint in typing.get_type_hints(cls).items():
        if mutate and rng.random() < 0.1:
            continue
        special = SPECIAL.get((cls.__name__, name))
        out[name] = (anything(rng) if mutate and rng.random() < 0.3 else
                     special(rng, out) if special else typed(rng, hint))
    if mutate and rng.random() < 0.1:
        out["unexpected"] = anything(rng)
    return out


def fuzzed_messages(seed: int, per_type: int) -> list[list[bytes]]:
    rng, out = random.Random(seed), []
    for name, cls in protocol.MESSAGES.items():
        for _ in range(per_type):
            msg = fields(rng, cls)
            frames = [raw(name, **msg)]
            counts = msg.get("frames")
            if (isinstance(counts, list) and all(isinstance(c, int) and 0 <= c < 4 for c in counts)
                    and isinstance(msg.get("chunks"), list) and rng.random() < 0.7):
                sizes = [c.nbytes if isinstance(c, KVChunk) else 8 for c in msg["chunks"]]
                sizes = [s if isinstance(s, int) and 0 <= s <= 4 * PAGE else 8 for s in sizes]
                frames += [bytes(size) for size, n in zip(sizes, counts) for _ in range(n)]
            else:
                frames += [rng.randbytes(rng.choice([0, 8, PAGE])) for _ in range(rng.randrange(3))]
            out.append(frames)
    return out


def refused_by_the_codec(messages: list[list[bytes]]) -> int:
    count = 0
    for frames in messages:
        try:
            protocol.decode(frames[0])
        except protocol.ProtocolError:
            count += 1
    return count


def test_fuzzed_messages_of_every_type_leave_the_receiver_serving():
    rec = receiver()
    reserved = [60, 61, 62]
    rec.expect("req", reserved)
    messages = fuzzed_messages(seed=7, per_type=40)
    refused = refused_by_the_codec(messages)
    assert refused > len(messages) // 4  # most types' checks are reached both ways
    before = errors("kv-receiver")
    rogue = dealer(rec.address, b"fuzzer")
    for frames in messages:
        rogue.send_multipart(frames)
    wait_for(lambda: errors("kv-receiver") >= before + refused, "count of refused messages")
    rec.cancel("req")
    rec.poll()
    others = [p for p in range(NUM_PAGES) if p not in reserved]
    assert (rec.pool.buffer[:, :, others] == POISON).all()
    assert rec.alive and not rec.error
    lands(rec, sender(), "real", [7, 1, 30], [10, 11, 12])
    rogue.close()
    rec.close()


# ---- the sender ---------------------------------------------------------------------------

class FakeReceiver:
    """A zmq ROUTER the test answers from."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a sender reconnecting under its id
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def take(self) -> tuple[bytes, list[bytes]]:
        assert self.sock.poll(WAIT_S * 1000), "the sender sent nothing"
        identity, *frames = self.sock.recv_multipart()
        return identity, frames

    def answer_hello(self, snd: KVSender, *frames: bytes):
        """snd.connect() to this receiver, answered with `frames`; returns the connect's future."""
        connecting = ThreadPoolExecutor(1).submit(snd.connect, self.address)
        identity, hello = self.take()
        assert isinstance(protocol.decode(hello[0]), TransferHello)
        self.sock.send_multipart([identity, *frames])
        return identity, connecting

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("welcome", [
    [b"\x93garbage"], [raw("TransferWelcome", ok="yes", error="", info={})],
    [raw("TransferWelcome", ok=True, error="", info=[])], [protocol.encode(TransferAcks([]))],
    [protocol.encode(TransferWelcome(True)), b"a frame after it"],
], ids=["garbage", "ok-a-string", "info-a-list", "acks", "two-frames"])
def test_a_bad_welcome_fails_the_connect_and_the_sender_keeps_serving(welcome):
    fake, snd = FakeReceiver(), sender()
    before = errors("kv-sender")
    _, connecting = fake.answer_hello(snd, *welcome)
    with pytest.raises(TransferError, match="handshake"):
        connecting.result(WAIT_S + 10)
    assert errors("kv-sender") >= before + 1
    assert snd.alive and not snd.error
    rec = receiver()
    lands(rec, snd, "real", [7, 1], [10, 11])
    rec.close()
    snd.close()
    fake.close()


def test_bad_acks_are_refused_requests_still_end_and_a_real_transfer_works():
    fake, snd = FakeReceiver(), sender(timeout_s=8)  # r2, never acknowledged, fails after 8 s
    identity, connecting = fake.answer_hello(snd, protocol.encode(TransferWelcome(True)))
    connecting.result(WAIT_S)
    snd.send("r1", fake.address, [1], [2])
    snd.send("r2", fake.address, [3], [4])
    fake.take()  # the chunks (r2's may come in a second message)
    bad = [[b"garbage"], [b"two", b"frames"], [raw("TransferAcks", acks=[["r1", "yes", ""]])],
           [raw("TransferAcks", acks=[[1, True, ""]])], [raw("TransferAcks", acks=[["r1", True]])],
           [raw("TransferAcks", acks="r1")], [protocol.encode(TransferWelcome(True))],
           *fuzzed_messages(seed=3, per_type=10)]
    refused = 7 + refused_by_the_codec(bad[7:])  # each of the first 7, and the codec's refusals
    before = errors("kv-sender")
    for frames in bad:
        fake.sock.send_multipart([identity, *frames])
    long_error = TransferAcks([TransferAck("r1", False, "no!" * 10**4)])
    fake.sock.send_multipart([identity, protocol.encode(long_error)])
    results = {r.request_id: r for r in wait_results(snd, 2, WAIT_S)}
    assert results["r1"].error.startswith("no!no!") and len(results["r1"].error) < 1000
    assert not results["r2"].ok and "no acknowledgement" in results["r2"].error
    assert errors("kv-sender") - before >= refused
    fake.sock.send_multipart([identity, bytes(REPLY_MAX_BYTES + 1)])  # over the cap: dropped
    rec = receiver()
    lands(rec, snd, "real", [7, 1], [10, 11])
    assert snd.alive and not snd.error
    rec.close()
    snd.close()
    fake.close()


# ---- the cluster key ----------------------------------------------------------------------

def test_sender_and_receiver_with_the_same_key_transfer():
    rec, snd = receiver(KEY), sender(KEY)
    lands(rec, snd, "req", [5, 9], [1, 2])
    snd.close()
    rec.close()


@pytest.mark.parametrize("sender_key,receiver_key", [(KEY, OTHER_KEY), (b"", KEY), (KEY, b"")],
                         ids=["different", "sender-keyless", "receiver-keyless"])
def test_a_key_mismatch_fails_the_handshake_clearly_and_writes_nothing(sender_key, receiver_key):
    rec, snd = receiver(receiver_key), sender(sender_key)
    before = errors("kv-receiver"), errors("kv-sender")
    with pytest.raises(TransferError, match="cluster key"):
        snd.connect(rec.address)
    assert errors("kv-receiver") > before[0] and errors("kv-sender") > before[1]
    assert (rec.pool.buffer == POISON).all() and snd.alive and rec.alive
    snd.close()
    rec.close()


@pytest.mark.parametrize("rogue_key", [b"", OTHER_KEY], ids=["keyless", "other-key"])
def test_a_peer_without_the_key_gets_nothing_written(rogue_key):
    rec = receiver(KEY)
    rec.expect("req", [3, 4])
    codec, before = protocol.Codec(rogue_key), errors("kv-receiver")
    rogue = dealer(rec.address, b"rogue")
    rogue.send(codec.encode(TransferHello("rogue", "tcp", asdict(LAYOUT))))
    rogue.send_multipart([codec.encode(KVChunks([chunk("req", [3, 4])], [1])), bytes(2 * PAGE)])
    rogue.send(codec.encode(TransferAbort("req", "")))
    assert rogue.poll(WAIT_S * 1000)  # the hello's answer: a refusal it cannot verify
    with pytest.raises(protocol.ProtocolError):
        codec.decode(rogue.recv())
    wait_for(lambda: errors("kv-receiver") >= before + 3, "count of refused messages")
    assert (rec.pool.buffer == POISON).all() and rec.num_expected == 1
    rec.cancel("req")
    snd = sender(KEY)
    lands(rec, snd, "req", [5, 9], [3, 4])
    snd.close()
    rogue.close()
    rec.close()


def test_signed_messages_replayed_on_another_connection_change_nothing(monkeypatch):
    """Messages a key holder signed (recorded off the wire) sent again by a peer without the
    key, under the sender's id and a header naming the sender's connection: refused and
    counted, the expected request neither failed, aborted nor written; its real transfer
    lands after. A KV header too long for a hello is not decoded at all."""
    rec, snd = receiver(KEY), sender(KEY)
    snd.connect(rec.address)
    rec.expect("req", [3, 4])
    signed, before = protocol.Codec(KEY), errors("kv-receiver")
    victim = next(iter(snd._socks.values())).getsockopt(zmq.IDENTITY).decode()  # what they name
    rogue = dealer(rec.address, f"{snd.sender_id}/{'0' * 16}".encode())
    rogue.send(signed.encode(TransferHello(snd.sender_id, "tcp", asdict(LAYOUT), {}, victim)))
    rogue.send_multipart([signed.encode(KVChunks([chunk("req", [3, 4])], [1], victim)), bytes(2 * PAGE)])
    rogue.send(signed.encode(TransferAbort("req", "replayed", victim)))
    decoded = []  # the lengths of unverified headers decoded in search of a hello
    monkeypatch.setattr(protocol, "decode", lambda body: decoded.append(len(body)) or
                        protocol.Codec().decode(body))
    rogue.send(b"\xdd" + (2**19).to_bytes(4, "big") + b"\x90" * 2**19)  # 512K empty lists
    wait_for(lambda: errors("kv-receiver") >= before + 4, "count of refused messages")
    assert decoded == []
    assert (rec.pool.buffer == POISON).all() and rec.num_expected == 1 and not rec.poll()
    snd.send("req", rec.address, [5, 9], [3, 4])
    (sent,) = wait_results(snd, 1, WAIT_S)
    (received,) = wait_results(rec, 1, WAIT_S)
    assert sent.ok and received.ok, (sent, received)
    expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
    assert torch.equal(bits(rec.pool.buffer[:, :, [3, 4]]), bits(expected[:, :, [5, 9]]))
    snd.close()
    rogue.close()
    rec.close()


# ---- a crash (a bug) is visible -----------------------------------------------------------

def boom(*args):
    raise RuntimeError("boom")


def test_a_receiver_whose_io_thread_dies_says_so(caplog):
    rec = receiver()
    with caplog.at_level(logging.ERROR):
        rec._land = boom
        wait_for(lambda: not rec.alive, "the thread's death")
        wait_for(lambda: any(r.exc_info for r in caplog.records), "the traceback logged")
    assert rec.error == "RuntimeError: boom"
    rec.close()


def test_a_sender_whose_io_thread_dies_fails_its_requests_and_says_so():
    fake, snd = FakeReceiver(), sender()
    identity, connecting = fake.answer_hello(snd, protocol.encode(TransferWelcome(True)))
    connecting.result(WAIT_S)
    snd.send("r1", fake.address, [1], [2])
    fake.take()
    snd._expire = boom
    (result,) = wait_results(snd, 1, WAIT_S)
    assert not result.ok and "I/O thread died: RuntimeError: boom" in result.error
    assert not snd.alive and snd.error == "RuntimeError: boom"
    with pytest.raises(TransferError, match="not running"):
        snd.send("r2", fake.address, [1], [2])
    snd.close()
    fake.close()
