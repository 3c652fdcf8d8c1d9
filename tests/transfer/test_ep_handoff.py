"""KV hand-off with expert parallelism over replicated attention (--tp 1 --ep-size N): a pool's
ranks are copies of one attention rank, so only the first prefill copy sends, and every decode
copy receives the whole pages into its own pool, bit-identical to the prefill pool's."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pd_serve.config import TransferConfig
from pd_serve.engine.plan import KVSend as Send
from pd_serve.transfer.connector import (DecodeRank, PrefillRank, join_replicas,
                                         replica_addresses)

from peer import LAYOUT, NUM_PAGES, POISON, SEED, poisoned_pool, seeded_pool  # noqa: E402
from test_transfer import bits, wait_results  # noqa: E402

SRC, DST = [5, 2, 9, 30], [40, 3, 17, 8]


def _core(pool, tp: int = 1):
    """What the hand-off halves read of an engine core (every KV head: attention replicated)."""
    return SimpleNamespace(kv_pool=pool, model_config=SimpleNamespace(num_kv_heads=2),
                           config=SimpleNamespace(tp=tp))


def test_a_decode_worker_advertises_one_address_per_attention_rank():
    assert join_replicas(["a", "b"], 1) == ["a,b"]  # --tp 1 --ep-size 2
    assert join_replicas(["a", "b"], 2) == ["a", "b"]  # --tp 2 (--ep-size 2)
    assert join_replicas(["a"], 1) == ["a"]
    assert replica_addresses("a,b") == ["a", "b"] and replica_addresses("a") == ["a"]


def test_every_decode_copy_receives_the_pages_from_the_first_prefill_copy():
    prefill_spec = TransferConfig("prefill", "tcp", 60.0, "p")
    decode_spec = TransferConfig("decode", "tcp", 60.0, "d")
    first = PrefillRank(_core(seeded_pool(LAYOUT, NUM_PAGES, SEED)), prefill_spec, 0, 1)
    # the second copy's KV is poison here: were it sent, the decode pools would show it
    copy = PrefillRank(_core(poisoned_pool(LAYOUT, NUM_PAGES)), prefill_spec, 1, 1)
    decode = [DecodeRank(_core(poisoned_pool(LAYOUT, NUM_PAGES)), decode_spec, r) for r in range(2)]
    addresses = join_replicas([d.receiver.address for d in decode], 1)
    try:
        assert first.num_parts(addresses) == 2  # one route, two receivers
        for d in decode:
            d.expect("req", DST)
        for rank in (first, copy):
            rank.send_layers([Send("req", addresses, SRC, DST)], LAYOUT.num_layers - 1)
        assert [r.ok for r in wait_results(first, 2, 60)] == [True, True]
        assert copy.poll() == []
        expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer[:, :, SRC]
        untouched = [p for p in range(NUM_PAGES) if p not in DST]
        for d in decode:
            assert [r.ok for r in wait_results(d, 1, 60)] == [True]
            assert torch.equal(bits(d.receiver.pool.buffer[:, :, DST]), bits(expected))
            assert (d.receiver.pool.buffer[:, :, untouched] == POISON).all()
    finally:
        for part in (first, copy, *decode):
            part.close()
