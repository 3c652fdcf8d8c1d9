"""KV hand-off between pools of different TP sizes (real sender processes, real sockets): each
decode rank receives exactly its KV heads from the prefill ranks that hold them, bit-identical
to what a TP-1 -> TP-1 transfer of the same pages delivers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pd_serve.cache.pool import KVLayout
from pd_serve.model.parallel import kv_heads_of
from pd_serve.transfer.heads import head_routes, tp_error
from pd_serve.transfer.receiver import KVReceiver

from peer import LAYOUT, NUM_PAGES, POISON, poisoned_pool  # noqa: E402
from test_transfer import bits, wait_results  # noqa: E402

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
    decode_tp receivers; returns the receivers' pools (all results ok, pages elsewhere poisoned)."""
    heads = layout.num_kv_heads
    receivers = [KVReceiver(poisoned_pool(replace(layout, num_kv_heads=len(kv_heads_of(d, decode_tp, heads))),
                                          NUM_PAGES), backend, timeout_s=10, model_layout=layout)
                 for d in range(decode_tp)]
    senders = [peers("sender", backend, layout=layout, tp=prefill_tp, tp_rank=r) for r in range(prefill_tp)]
    routes = head_routes(prefill_tp, decode_tp, heads)
    for rec in receivers:
        rec.expect("req", DST)
    for r in routes:
        sender = senders[r.src_rank]
        address = receivers[r.dst_rank].address
        assert sender.call("connect", address=address) == {"ok": True}
        parts = sum(q.dst_rank == r.dst_rank for q in routes)
        assert sender.call("send", request_id="req", address=address, src_page_ids=SRC,
                           dst_page_ids=DST, heads=[r.src_head, r.dst_head, r.num_heads],
                           parts=parts) == {"ok": True}
    for rank, sender in enumerate(senders):
        mine = sum(r.src_rank == rank for r in routes)
        results = sender.call("poll", count=mine, wait=10)["results"]
        assert [r["ok"] for r in results] == [True] * mine, results
    pools = []
    for rec in receivers:
        (result,) = wait_results(rec, 1, 10)
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
                          timeout_s=10, model_layout=LAYOUT4)
    receiver.expect("req", DST)
    senders = [peers("sender", "tcp", layout=LAYOUT4, tp=4, tp_rank=r) for r in range(3)]
    for rank, sender in enumerate(senders):  # three senders, each claiming to be one of two
        sender.call("connect", address=receiver.address)
        sender.call("send", request_id="req", address=receiver.address, src_page_ids=SRC,
                    dst_page_ids=DST, heads=[0, rank % 2, 1], parts=2, layer_start=0,
                    layer_end=1, last=False)  # layer 0 only: the request stays open
    refusal = senders[2].call("poll", count=1, wait=10)["results"]
    assert [r["ok"] for r in refusal] == [False]
    (result,) = wait_results(receiver, 1, 10)
    assert not result.ok and "one sender too many" in result.error
    receiver.close()


def test_a_sender_of_another_model_layout_is_refused_at_the_handshake(peers):
    receiver = KVReceiver(poisoned_pool(replace(LAYOUT4, num_kv_heads=2), NUM_PAGES), "tcp",
                          timeout_s=5, model_layout=LAYOUT4)
    sender = peers("sender", "tcp", layout=LAYOUT, tp=2, tp_rank=0)  # a 2-KV-head model
    reply = sender.call("connect", address=receiver.address)
    assert "num_kv_heads 2 != 4" in reply["error"]
    receiver.close()
