"""Rows inside messages (TokenDelta, Logprob, KVChunk, TransferAck, SamplingParams): they round-trip
through the codec as typed dataclasses, travel as positional lists, and a bad row refuses its
whole message, counted."""

import msgpack
import pytest

from pd_serve import protocol
from pd_serve.engine.request import FinishReason, TokenLogprob
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.protocol import (Admit, Generate, KVChunk, KVChunks, Logprob, Prefill, PrefillDone,
                               StartDecode, TokenBatch, TokenDelta, TransferAck, TransferAcks)

SOCKET = "test-rows"
LOGPROB = Logprob(5, -0.25, [(5, -0.25), (9, -1.5)])


def raw(name: str, **fields) -> bytes:
    """A message framed as the codec frames it, whatever its fields hold."""
    return msgpack.packb([name, fields], use_bin_type=True)


def refused_count() -> float:
    return protocol.PROTOCOL_ERRORS.labels(socket=SOCKET)._value.get()


def assert_refused(data: bytes, match: str = "") -> None:
    """The codec refuses it with a ProtocolError (never another exception), and receive()
    counts it."""
    with pytest.raises(protocol.ProtocolError, match=match):
        protocol.decode(data)
    before = refused_count()
    assert protocol.Codec().receive(data, SOCKET) is None
    assert refused_count() == before + 1


@pytest.mark.parametrize("msg", [
    TokenBatch("w", [TokenDelta("r1", [9], None, False, None, ""),
                     TokenDelta("r2", [3, 4], [LOGPROB, Logprob(4, 0.0, [])], True, "stop"),
                     TokenDelta("r3", [], None, True, None, "KV transfer failed")]),
    TokenBatch("w", []),
    PrefillDone("r", True, 5, LOGPROB, timings={"prefill": 0.5}),
    PrefillDone("r", True, 5, None, prompt_logprobs=[LOGPROB, Logprob(2, -3.5, [])]),
    TokenBatch("w", [TokenDelta("r", [9], None, prompt_logprobs=[LOGPROB])]),
    PrefillDone("r", False, error="boom"),
    StartDecode("r", 5, LOGPROB),
    StartDecode("r", 5),
], ids=["deltas", "no-rows", "prefill-done", "prefill-prompt-logprobs", "delta-prompt-logprobs",
        "prefill-failed", "start", "start-no-logprob"])
def test_rows_round_trip_as_typed_dataclasses(msg):
    out = protocol.Codec(b"key").decode(protocol.Codec(b"key").encode(msg))
    assert out == msg
    for row in getattr(out, "items", []):
        assert type(row) is TokenDelta
        assert all(type(lp) is Logprob and all(type(t) is tuple for t in lp.top)
                   for lp in row.logprobs or [])


def test_rows_travel_as_positional_lists():
    data = protocol.encode(TokenBatch("w", [TokenDelta("r", [3], [LOGPROB], True, "length")]))
    assert msgpack.unpackb(data) == [
        "TokenBatch", {"worker_id": "w",
                       "items": [["r", [3], [[5, -0.25, [[5, -0.25], [9, -1.5]], 0]], True, "length", "", 0, None]]}]


def test_a_logprob_converts_to_and_from_the_engine_one():
    lp = TokenLogprob(7, -0.5, [(7, -0.5), (2, -3.0)])
    assert Logprob.of(lp).to_engine() == lp
    assert protocol.decode(protocol.encode(StartDecode("r", 7, Logprob.of(lp)))).logprob.to_engine() == lp


def test_finish_reasons_are_the_engines():
    assert set(protocol.FINISH_REASONS) == {None} | {r.value for r in FinishReason}


def delta(*row) -> bytes:
    """A TokenBatch of this TokenDelta row (without prompt logprobs unless given)."""
    return raw("TokenBatch", worker_id="w", items=[list(row) + [None] * (8 - len(row))])


GOOD = ["r", [1], [[1, -0.5, [[1, -0.5]], 0]], True, "stop", "", 0, None]


@pytest.mark.parametrize("data,match", [
    (raw("TokenBatch", worker_id="w", items=[GOOD[:5]]), "TokenDelta row"),  # a field short
    (raw("TokenBatch", worker_id="w", items=[GOOD + [""]]), "TokenDelta row"),  # one too many
    (raw("TokenBatch", worker_id="w", items=[dict(zip("abcdefgh", GOOD))]), "TokenDelta row"),
    (delta(*GOOD[:7], [[2**31, -0.5, [], 0]]), "token id of 2147483648 or more"),
    (delta(*GOOD[:7], [[1, -0.5, [[1, -0.5]] * 21, 0]]), "21 top logprobs"),
    (delta(*GOOD[:7], [1, -0.5, [], 0]), "prompt_logprobs"),
    (raw("PrefillDone", request_id="r", ok=True, first_token_id=3, prompt_logprobs=[[1, "x", [], 0]]),
     "logprob"),
    (raw("TokenBatch", worker_id="w", items="r"), "items"),
    (delta(["r"], *GOOD[1:]), "request_id"),
    (delta("r", [1.0], *GOOD[2:]), "token_ids"),
    (delta("r", [True], *GOOD[2:]), "token_ids"),
    (delta("r", [-1], None, True, "stop", "", 0), "negative token id"),
    (delta("r", [1, 2**32], None, True, "stop", "", 0), "token id of 2147483648 or more"),
    (delta("r", [1], [[2**31, -0.5, [], 0]], True, None, "", 0), "token id of 2147483648 or more"),
    (delta("r", [1], [[1, -0.5, [[-3, -0.5]], 0]], True, None, "", 0), "negative token id"),
    (raw("PrefillDone", request_id="r", ok=True, first_token_id=2**40), "token id of"),
    (raw("PrefillDone", request_id="r", ok=True, first_token_id=-1), "negative token id"),
    (raw("StartDecode", request_id="r", first_token_id=2**63), "token id of"),
    (raw("GatewayPing", gateway_id="g", request_ids=[], timeout_s=-1.0), "timeout"),
    (raw("GatewayPing", gateway_id="g", request_ids=[], timeout_s=float("nan")), "timeout"),
    (raw("GatewayPing", gateway_id="g", request_ids=[], timeout_s=1e9), "timeout"),
    (delta("r", [1], None, 1, "stop", "", 0), "finished"),
    (delta("r", [1], None, True, "eos", "", 0), "finish reason"),
    (delta("r", [1], None, True, None, None, 0), "error"),
    (delta("r", [1], [[1, -0.5, [], 0], [1, -0.5, [], 0]], True, None, "", 0), "2 logprobs for 1 tokens"),
    (delta("r", [1], [{"token_id": 1, "logprob": -0.5, "top": []}], True, None, "", 0), "Logprob row"),
    (delta("r", [1], [[1, "-0.5", [], 0]], True, None, "", 0), "logprob"),
    (delta("r", [1], [[1, -0.5, [[1]], 0]], True, None, "", 0), "top"),
    (delta("r", [1], [[1, -0.5, [[1, -0.5, 2]], 0]], True, None, "", 0), "top"),
    (delta("r", [1], [[1, -0.5, [["1", -0.5]], 0]], True, None, "", 0), "top"),
    (delta("r", [1], [[1, -0.5, [[1, -0.5]] * 21, 0]], True, None, "", 0), "21 top logprobs"),
    (delta("r", [1], [[1, -0.5, [], -1]], True, None, "", 0), "rank -1"),
    (delta("r", [1], [[1, -0.5, [], 1.5]], True, None, "", 0), "rank"),
    (delta("r", [1], [[1, -0.5, [[[[[]]]]], 0]], True, None, "", 0), "top"),  # nested garbage
    (raw("PrefillDone", request_id="r", ok=True, first_token_id=3, logprob=[3, -0.5]), "logprob"),
    (raw("PrefillDone", request_id="r", ok=True, first_token_id=3,
         logprob={"token_id": 3, "logprob": -0.5, "top": []}), "logprob"),
    (raw("StartDecode", request_id="r", first_token_id=3, logprob=[3, None, [], 0]), "logprob"),
])
def test_a_bad_row_refuses_its_message_and_is_counted(data, match):
    assert_refused(data, match)


def test_a_row_of_every_kind_refused_inside_an_otherwise_good_batch():
    good = protocol.encode(TokenBatch("w", [TokenDelta("a", [1]), TokenDelta("b", [2])]))
    assert protocol.decode(good).items[1].token_ids == [2]
    rows = msgpack.unpackb(good)[1]["items"]
    rows[1][1] = [2, "3"]
    assert_refused(raw("TokenBatch", worker_id="w", items=rows), "token_ids")


# ---- transfer rows: KVChunk inside KVChunks, TransferAck inside TransferAcks ------------------

CHUNK = KVChunk("r", [5, 6], 0, 3, 1024, True, [7, 8], [0, 2], [2, 4], 2)


@pytest.mark.parametrize("msg", [
    KVChunks([CHUNK, KVChunk("q", [], 1, 2, 0, False)], [1, 0]),
    KVChunks([], []),
    TransferAcks([TransferAck("r", True), TransferAck("q", False, "no room")]),
    TransferAcks([]),
], ids=["chunks", "no-chunks", "acks", "no-acks"])
def test_transfer_rows_round_trip_as_typed_dataclasses(msg):
    out = protocol.decode(protocol.encode(msg))
    assert out == msg
    rows = out.chunks if isinstance(out, KVChunks) else out.acks
    assert all(type(r) in (KVChunk, TransferAck) for r in rows)


def chunk_row(**change) -> list:
    fields = protocol.fields_of(CHUNK) | change
    return list(fields.values())


@pytest.mark.parametrize("data,match", [
    (raw("KVChunks", chunks=[protocol.fields_of(CHUNK)], frames=[1]), "KVChunk row"),  # a dict
    (raw("KVChunks", chunks=[chunk_row()[:-1]], frames=[1]), "KVChunk row"),
    (raw("KVChunks", chunks=[chunk_row(request_id=None)], frames=[1]), "request_id"),
    (raw("KVChunks", chunks=[chunk_row(dst_page_ids=[1, -2])], frames=[1]), "negative page id"),
    (raw("KVChunks", chunks=[chunk_row(dst_page_ids=[[1]])], frames=[1]), "dst_page_ids"),
    (raw("KVChunks", chunks=[chunk_row(layer_start=3)], frames=[1]), "layers"),
    (raw("KVChunks", chunks=[chunk_row(parts=0)], frames=[1]), "parts"),
    (raw("KVChunks", chunks=[chunk_row(src_heads=[0, 1, 2])], frames=[1]), "heads"),
    (raw("KVChunks", chunks=[chunk_row(last=1)], frames=[1]), "last"),
    (raw("KVChunks", chunks=[chunk_row()], frames=[1, 1]), "frame counts"),
    (raw("KVChunks", chunks=[chunk_row()], frames=[-1]), "frame counts"),
    (raw("TransferAcks", acks=[["r", "yes", ""]]), "ok"),
    (raw("TransferAcks", acks=[["r", True]]), "TransferAck row"),
    (raw("TransferAcks", acks=[["r", True, "", ""]]), "TransferAck row"),
    (raw("TransferAcks", acks=[[["r"], True, ""]]), "request_id"),
    (raw("TransferAcks", acks=[{"request_id": "r", "ok": True, "error": ""}]), "TransferAck row"),
])
def test_a_bad_transfer_row_refuses_its_message_and_is_counted(data, match):
    assert_refused(data, match)


# ---- a request's SamplingParams (Admit, Prefill, Generate) ---------------------------------

SAMPLING = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=["\n"],
                          stop_token_ids=[2], logprobs=4, logit_bias={9: -100, 3: 2.5})


@pytest.mark.parametrize("msg", [
    Admit("r", [1, 2], SAMPLING, 3),
    Prefill("r", [1, 2], SamplingParams(), ["tcp://h:1", "tcp://h:2"], [4, 5]),
    Generate("r", [1], SAMPLING, -1),
], ids=["admit", "prefill", "generate"])
def test_sampling_round_trips_as_sampling_params(msg):
    out = protocol.decode(protocol.encode(msg))
    assert out == msg and type(out.sampling) is SamplingParams


def admit(sampling) -> bytes:
    return raw("Admit", request_id="r", prompt_token_ids=[1], sampling=sampling)


def sampling_row(**change) -> list:
    return list((protocol.fields_of(SAMPLING) | change).values())


@pytest.mark.parametrize("data,match", [
    (admit({"max_tokens": 4}), "SamplingParams row"),  # the field dict is not its wire form
    (admit(sampling_row()[:-1]), "SamplingParams row"),
    (admit(sampling_row(max_tokens=0)), "max_tokens=0 must be >= 1"),  # its own validation
    (admit(sampling_row(max_tokens="4")), "max_tokens"),
    (admit(sampling_row(temperature=float("nan"))), "temperature"),
    (admit(sampling_row(seed=True)), "seed"),
    (admit(sampling_row(stop="\n")), "stop"),
    (admit(sampling_row(stop=[""])), "stop"),
    (admit(sampling_row(stop_token_ids=[-1])), "stop_token_ids"),
    (admit(sampling_row(logprobs=21)), "logprobs"),
    (admit(sampling_row(prompt_logprobs=-1)), "prompt_logprobs"),
    (admit(sampling_row(logit_bias={"9": 1.0})), "logit_bias"),
    (admit(sampling_row(logit_bias={9: [1.0]})), "logit_bias"),
    (admit(sampling_row(logit_bias={9: 101.0})), "logit_bias"),
    (admit(sampling_row(logit_bias=[[9, 1.0]])), "logit_bias"),
])
def test_a_bad_sampling_refuses_its_message_and_is_counted(data, match):
    assert_refused(data, match)


# ---- a seeded fuzz: good messages of every row kind with one value deep inside replaced -----

GARBAGE = [None, True, -1, 2**63, 0.5, float("nan"), "", "x" * 300, b"\x00", [], [[]], {}, {1: [2]},
           [None] * 30]


def mutated(rng, value):
    """`value` with one element, at any depth, replaced by garbage (or a list grown or cut)."""
    if isinstance(value, list) and value and rng.random() < 0.8:
        value = list(value)
        i = rng.randrange(len(value))
        choice = rng.random()
        if choice < 0.1:
            del value[i]
        elif choice < 0.2:
            value.append(value[i])
        else:
            value[i] = mutated(rng, value[i])
        return value
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        return {**value, key: mutated(rng, value[key])}
    return rng.choice(GARBAGE)


def test_fuzzed_rows_are_refused_or_decode_to_typed_rows():
    import random
    rng = random.Random(5)
    good = [TokenBatch("w", [TokenDelta("a", [1, 2], [LOGPROB, LOGPROB], True, "stop")]),
            PrefillDone("r", True, 5, LOGPROB), StartDecode("r", 5, LOGPROB),
            KVChunks([CHUNK], [1]), TransferAcks([TransferAck("r", False, "e")]),
            Admit("r", [1], SAMPLING), Generate("r", [1], SAMPLING)]
    refused = 0
    for msg in good:
        name, fields = msgpack.unpackb(protocol.encode(msg), strict_map_key=False)
        for _ in range(300):
            data = msgpack.packb([name, mutated(rng, fields)])
            try:
                out = protocol.decode(data)
            except protocol.ProtocolError:
                refused += 1
                continue
            assert type(out) is type(msg)
            rows = [*getattr(out, "items", []), *getattr(out, "chunks", []), *getattr(out, "acks", []),
                    *[getattr(out, f) for f in ("logprob", "sampling") if getattr(out, f, None)]]
            assert all(type(r) in (TokenDelta, KVChunk, TransferAck, Logprob, SamplingParams) for r in rows)
            again = protocol.encode(out)  # typed through and through (bytes: NaN != NaN)
            assert protocol.encode(protocol.decode(again)) == again
    assert refused > 300 * len(good) // 2


def test_a_row_of_one_field_and_a_value_that_is_no_row():
    import dataclasses

    @dataclasses.dataclass
    class One:
        token_id: int

    assert protocol._writer(list[One])([One(3), One(4)]) == [(3,), (4,)]
    assert msgpack.unpackb(protocol.encode(TokenBatch("w", [["r"], 5])))[1]["items"] == [["r"], 5]
    with pytest.raises(TypeError):
        protocol.encode(TokenBatch("w", {1}))
