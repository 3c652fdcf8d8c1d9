"""KV hand-off between pools of different TP sizes (real sender processes, real sockets): each
decode rank receives exactly its KV heads from the prefill ranks that hold them, bit-identical
to what a TP-1 -> TP-1 transfer of the same pages delivers; and the connector reporting a
request once over all its parts."""

from __future__ import annotations

import queue
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pd_serve.cache.pool import KVLayout
from pd_serve.config import TransferConfig
from pd_serve.engine.plan import KVSend as Send
from pd_serve.model.parallel import kv_heads_of
from pd_serve.transfer import connector
from pd_serve.transfer.base import TransferError, TransferResult
from pd_serve.transfer.connector import DecodeRank, FollowerIO, PrefillRank
from pd_serve.transfer.heads import head_routes, tp_error
from pd_serve.transfer.receiver import KVReceiver

from peer import LAYOUT, NUM_PAGES, POISON, SEED, poisoned_pool, seeded_pool  # noqa: E402
from test_transfer import NIXL, bits, wait_results  # noqa: E402

SRC, DST = [5, 2, 9, 30], [40, 3, 17, 8]  # non-contiguous on both sides
LAYOUT4 = replace(LAYOUT, num_kv_heads=4)


def test_routes_cover_every_decode_head_once_from_a_rank_that_holds_it():
    for heads in (1, 2, 4, 8):
        for a in (1, 2, 4, 8):
            for b in (1, 2, 4, 8):
                if tp_error(a, heads) or tp_error(b, heads):
                    with pytest.raises(ValueError, match="KV heads"):
                        head_routes(a, b, heads)
                    continue
                got = {}
                for r in head_routes(a, b, heads):
                    src = kv_heads_of(r.src_rank, a, heads)
                    dst = kv_heads_of(r.dst_rank, b, heads)
                    for i in range(r.num_heads):
                        model_head = dst.start + r.dst_head + i
                        assert src.start + r.src_head + i == model_head  # the same head
                        assert model_head in src
                        got.setdefault(r.dst_rank, []).append(r.dst_head + i)
                assert got == {d: list(range(len(kv_heads_of(d, b, heads)))) for d in range(b)}
    # equal TP sizes: rank i -> rank i, all heads, one route each
    assert [(r.src_rank, r.dst_rank, r.num_heads) for r in head_routes(2, 2, 8)] == [(0, 0, 4), (1, 1, 4)]


def _hand_off(peers, layout: KVLayout, backend: str, prefill_tp: int, decode_tp: int) -> list:
    """Send pages SRC of a seeded pool, split over prefill_tp sender processes, to pages DST of
    decode_tp receivers; returns the receivers' pools (all results ok, pages elsewhere poisoned).
    The receivers expect the request only once every sender is up and paired: sender processes
    each import torch, which on a loaded 2-core machine takes longer than a receiver's timeout."""
    heads = layout.num_kv_heads
    receivers = [KVReceiver(poisoned_pool(replace(layout, num_kv_heads=len(kv_heads_of(d, decode_tp, heads))),
                                          NUM_PAGES), backend, timeout_s=60, model_layout=layout)
                 for d in range(decode_tp)]
    senders = [peers("sender", backend, layout=layout, tp=prefill_tp, tp_rank=r, timeout=60)
               for r in range(prefill_tp)]
    routes = head_routes(prefill_tp, decode_tp, heads)
    for r in routes:
        assert senders[r.src_rank].call("connect", address=receivers[r.dst_rank].address) == {"ok": True}
    for rec in receivers:
        rec.expect("req", DST)
    for r in routes:
        sender = senders[r.src_rank]
        address = receivers[r.dst_rank].address
        parts = sum(q.dst_rank == r.dst_rank for q in routes)
        assert sender.call("send", request_id="req", address=address, src_page_ids=SRC,
                           dst_page_ids=DST, heads=[r.src_head, r.dst_head, r.num_heads],
                           parts=parts) == {"ok": True}
    for rank, sender in enumerate(senders):
        mine = sum(r.src_rank == rank for r in routes)
        results = sender.call("poll", count=mine, wait=60)["results"]
        assert [r["ok"] for r in results] == [True] * mine, results
    pools = []
    for rec in receivers:
        (result,) = wait_results(rec, 1, 60)
        assert result.ok, result.error
        untouched = [p for p in range(NUM_PAGES) if p not in DST]
        assert (rec.pool.buffer[:, :, untouched] == POISON).all()
        pools.append(rec.pool.buffer.clone())
        rec.close()
    return pools


@pytest.mark.parametrize("layout,backend,prefill_tp,decode_tp", [
    (LAYOUT4, "tcp", 2, 1), (LAYOUT4, "torch", 1, 2), (LAYOUT4, "tcp", 4, 2),
    (LAYOUT, "tcp", 1, 4),  # decode replicates its 2 KV heads over 4 ranks
    (LAYOUT, "torch", 4, 2),  # prefill replicates them
    # nixl reads parts of pages: a block per token slot
    pytest.param(LAYOUT4, "nixl", 2, 1, marks=NIXL.marks),
    pytest.param(LAYOUT, "nixl", 1, 4, marks=NIXL.marks),
], ids=lambda v: v if isinstance(v, (str, int)) else f"{v.num_kv_heads}heads")
def test_heterogeneous_tp_pages_equal_a_homogeneous_run(peers, layout, backend, prefill_tp, decode_tp):
    (whole,) = _hand_off(peers, layout, backend, 1, 1)
    assert not (whole[:, :, DST] == POISON).any()
    parts = _hand_off(peers, layout, backend, prefill_tp, decode_tp)
    for rank, got in enumerate(parts):
        heads = kv_heads_of(rank, decode_tp, layout.num_kv_heads)
        assert torch.equal(bits(got[:, :, DST]), bits(whole[:, :, DST, :, heads.start:heads.stop]))


def test_a_receiver_refuses_more_parts_than_the_chunks_announce(peers):
    receiver = KVReceiver(poisoned_pool(replace(LAYOUT4, num_kv_heads=2), NUM_PAGES), "tcp",
                          timeout_s=60, model_layout=LAYOUT4)
    senders = [peers("sender", "tcp", layout=LAYOUT4, tp=4, tp_rank=r, timeout=60) for r in range(3)]
    for sender in senders:  # (expected once they are up: see _hand_off)
        sender.call("connect", address=receiver.address)
    receiver.expect("req", DST)
    for rank, sender in enumerate(senders):  # three senders, each claiming to be one of two
        sender.call("send", request_id="req", address=receiver.address, src_page_ids=SRC,
                    dst_page_ids=DST, heads=[0, rank % 2, 1], parts=2, layer_start=0,
                    layer_end=1, last=False)  # layer 0 only: the request stays open
    # whichever part comes third (the senders run in parallel) is refused; the others wait
    refusals, deadline = [], time.monotonic() + 60
    while not refusals and time.monotonic() < deadline:
        refusals = [r for sender in senders for r in sender.call("poll")["results"]]
        time.sleep(0.05)
    assert [r["ok"] for r in refusals] == [False] and "one sender too many" in refusals[0]["error"]
    (result,) = wait_results(receiver, 1, 60)
    assert not result.ok and "one sender too many" in result.error
    receiver.close()


def test_a_sender_of_another_model_layout_is_refused_at_the_handshake(peers):
    receiver = KVReceiver(poisoned_pool(replace(LAYOUT4, num_kv_heads=2), NUM_PAGES), "tcp",
                          timeout_s=5, model_layout=LAYOUT4)
    sender = peers("sender", "tcp", layout=LAYOUT, tp=2, tp_rank=0)  # a 2-KV-head model
    reply = sender.call("connect", address=receiver.address)
    assert "num_kv_heads 2 != 4" in reply["error"]
    receiver.close()


def _core(pool):
    """What the hand-off halves read of an engine core."""
    heads = pool.layout.num_kv_heads
    return SimpleNamespace(kv_pool=pool, model_config=SimpleNamespace(num_kv_heads=heads),
                           tp=SimpleNamespace(size=1), config=SimpleNamespace(tp=1))


@pytest.mark.parametrize("decode_key", [b"k" * 32, b"o" * 32], ids=["same-key", "other-key"])
def test_hand_off_ranks_use_the_spec_cluster_key(decode_key):
    prefill_spec = TransferConfig("prefill", "tcp", 60.0, "p", cluster_key=b"k" * 32)
    decode_spec = replace(prefill_spec, role="decode", worker_id="d", cluster_key=decode_key)
    prefill = PrefillRank(_core(seeded_pool(LAYOUT, NUM_PAGES, SEED)), prefill_spec, 0, 1)
    decode = DecodeRank(_core(poisoned_pool(LAYOUT, NUM_PAGES)), decode_spec, 0)
    address = decode.receiver.address
    if decode_key != prefill_spec.cluster_key:
        with pytest.raises(TransferError, match="cluster key"):
            prefill.sender.connect(address)
    else:
        decode.expect("req", DST)
        prefill.send_layers([Send("req", [address], SRC, DST)], LAYOUT.num_layers - 1)
        assert [r.ok for r in wait_results(decode, 1, 60)] == [True]
        expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
        assert torch.equal(bits(decode.receiver.pool.buffer[:, :, DST]), bits(expected[:, :, SRC]))
    prefill.close()
    decode.close()


def test_a_follower_whose_kv_thread_dies_ends_its_process(monkeypatch):
    exits = []
    monkeypatch.setattr(connector.os, "_exit", exits.append)
    monkeypatch.setattr(connector.logging, "shutdown", lambda: None)
    spec = TransferConfig("decode", "tcp", 60.0, "d")
    follower = FollowerIO(_core(poisoned_pool(LAYOUT, NUM_PAGES)), spec, 1, queue.Queue())
    follower.part.receiver._land = lambda: 1 / 0  # a bug in the I/O thread
    deadline = time.monotonic() + 60
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits == [1]
    follower.close()


def _scripted_connector(monkeypatch, role: str, pool):
    """A rank-0 connector of a 2-rank worker with no follower processes: rank 1's results come
    on the queue by hand, rank 0's part polls what the test gives it, TP calls are recorded."""
    calls, reports = [], queue.Queue()
    monkeypatch.setattr(connector.tp_group, "call", lambda tp, *args: calls.append(args))
    if role == "decode":
        reports.put(("address", 1, "tcp://rank1"))
    core = SimpleNamespace(kv_pool=pool, model_config=SimpleNamespace(num_kv_heads=4),
                           tp=SimpleNamespace(size=2), tp_reports=reports,
                           config=SimpleNamespace(tp=2))
    conn = connector.connector(TransferConfig(role, "tcp", 60.0, "w"), core)
    rank0 = []
    monkeypatch.setattr(conn.part, "poll", lambda: [rank0.pop(0)] if rank0 else [])
    return conn, calls, rank0, reports


def _part(rank, request_id, ok=True, num_bytes=10):
    return ("result", rank, request_id, ok, "" if ok else "boom", num_bytes, 0.5)


def test_a_decode_connector_reports_a_request_once_every_rank_has_its_kv(monkeypatch):
    conn, calls, rank0, reports = _scripted_connector(
        monkeypatch, "decode", poisoned_pool(replace(LAYOUT4, num_kv_heads=2), NUM_PAGES))
    try:
        assert conn.addresses[1] == "tcp://rank1"
        conn.expect("a", DST)
        assert calls == [("expect", "a", DST)]
        rank0.append(TransferResult("a", True, "", 10, 0.5))
        assert conn.poll() == []  # one rank of two
        reports.put(_part(1, "a"))
        assert conn.poll() == [TransferResult("a", True, "", 20, 0.5)]
        conn.expect("b", SRC)
        reports.put(_part(1, "b", ok=False))
        (failed,) = conn.poll()  # at once, and every rank has stopped expecting it
        assert (failed.request_id, failed.ok, failed.error) == ("b", False, "boom")
        assert calls[-1] == ("cancel", "b")
        rank0.append(TransferResult("b", True))
        assert conn.poll() == []  # a late part of a cancelled request
    finally:
        conn.close()


def test_a_prefill_connector_waits_for_every_part_after_a_failure(monkeypatch):
    conn, calls, rank0, reports = _scripted_connector(
        monkeypatch, "prefill", seeded_pool(replace(LAYOUT4, num_kv_heads=2), NUM_PAGES, SEED))
    try:
        monkeypatch.setattr(conn.part, "send_layers", lambda sends, layer: None)
        conn.send_layers([Send("a", ["tcp://d0"], SRC, DST)], 0)  # 2 prefill ranks -> 1: 2 parts
        reports.put(_part(1, "a", ok=False))
        assert conn.poll() == []  # rank 0 may still read the pages
        assert calls == [("cancel", "a")]
        rank0.append(TransferResult("a", True, "", 10, 0.2))
        assert conn.poll() == [TransferResult("a", False, "boom", 20, 0.5)]
    finally:
        conn.close()
