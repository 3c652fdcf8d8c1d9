"""Routing policies and the wire codec."""

import pytest

from pd_serve import protocol
from pd_serve.gateway.router import Router, WorkerState
from pd_serve.protocol import Admit, KVChunk, KVChunks, TokenBatch, WorkerStatus


def workers(n: int) -> list[WorkerState]:
    return [WorkerState(WorkerStatus(worker_id=f"w{i}", role="decode", model="m")) for i in range(n)]


def test_round_robin_cycles():
    pool, router = workers(3), Router("round_robin", "decode")
    assert [router.pick(pool, [1]).worker_id for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_least_load_picks_fewest_outstanding_tokens():
    pool = workers(3)
    pool[0].inflight = {"a": 500}
    pool[1].inflight = {"b": 100, "c": 50}
    pool[2].inflight = {"d": 400}
    assert Router("least_load", "decode").pick(pool, [1]).worker_id == "w1"


def test_prefix_policy_keeps_shared_prefixes_together():
    pool, router = workers(4), Router("prefix", "prefill")
    head = list(range(100, 164))
    picks = {router.pick(pool, head + [i, i + 1]).worker_id for i in range(20)}
    assert len(picks) == 1  # same 64-token head -> same worker
    spread = {router.pick(pool, [i] * 70).worker_id for i in range(40)}
    assert len(spread) > 1  # different heads spread out


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="--decode-policy 'prefix' must be one of round_robin, least_load"):
        Router("prefix", "decode")


def test_codec_round_trips_and_rejects_garbage():
    for msg in (Admit("r1", [1, 2, 3], {"max_tokens": 4}, 2),
                KVChunks([protocol.fields_of(KVChunk("r2", [5, 6], 0, 3, 1024, True, [7, 8]))], [1]),
                TokenBatch("w", [["r1", [9], None, False, None, ""]])):
        assert protocol.decode(protocol.encode(msg)) == msg
    with pytest.raises(ValueError, match="undecodable"):
        protocol.decode(b"\x93garbage")
    with pytest.raises(ValueError, match="undecodable"):
        protocol.decode(protocol.encode(Admit("r", [], {})).replace(b"Admit", b"Evict"))
