"""The nixl backend's own checks (the shared transfer suite runs over it too): the blocks it reads,
a malformed hello refused at the handshake, and a read that fails failing its request on both
sides while the receiver keeps serving."""

from __future__ import annotations

import pytest
import torch

from pd_serve.transfer.backends.nixl import block_addresses, coalesce, nixl_available
from pd_serve.transfer.base import TransferError
from pd_serve.transfer.receiver import KVReceiver
from pd_serve.transfer.sender import KVSender

from peer import LAYOUT, NUM_PAGES, POISON, SEED, poisoned_pool, seeded_pool  # noqa: E402
from test_transfer import bits, wait_results  # noqa: E402

needs_nixl = pytest.mark.skipif(not nixl_available(),
                                reason="nixl is not installed (pip install pd-serve[nixl])")


def test_blocks_are_whole_pages_or_the_heads_of_each_token_slot():
    pool = torch.zeros(3, 2, 5, 4, 3, 2)  # [L, 2, P, S, H, D]
    base, shape, item = pool.data_ptr(), list(pool.shape), pool.element_size()
    addresses, nbytes = block_addresses(base, shape, item, 1, 3, [4, 0], None, per_slot=False)
    assert nbytes == 4 * 3 * 2 * item
    assert list(addresses) == [pool[layer, kv, page].data_ptr() for layer in (1, 2)
                               for kv in (0, 1) for page in (4, 0)]
    addresses, nbytes = block_addresses(base, shape, item, 0, 1, [2], (1, 3), per_slot=True)
    assert nbytes == 2 * 2 * item
    assert list(addresses) == [pool[0, kv, 2, slot, 1].data_ptr() for kv in (0, 1)
                               for slot in range(4)]


def test_blocks_contiguous_on_both_sides_merge_into_one_read():
    pool = torch.zeros(2, 2, 8, 4, 3, 2)  # [L, 2, P, S, H, D]
    base, shape, item = pool.data_ptr(), list(pool.shape), pool.element_size()
    # pages 2, 3, 4 read into 5, 6, 7 (a run on both sides), then 0 into 1 (a run of its own)
    local, nbytes = block_addresses(base, shape, item, 0, 2, [5, 6, 7, 1], None, per_slot=False)
    remote, _ = block_addresses(base + 10**6, shape, item, 0, 2, [2, 3, 4, 0], None, per_slot=False)
    starts, sources, lengths = coalesce(local, remote, nbytes)
    rows = [(layer, kv) for layer in (0, 1) for kv in (0, 1)]
    assert list(starts) == [pool[r][p].data_ptr() for r in rows for p in (5, 1)]
    assert list(sources) == [base + 10**6 + pool[r][p].data_ptr() - base for r in rows for p in (2, 0)]
    assert list(lengths) == [3 * nbytes, nbytes] * 4
    # every byte is read once, into its own place
    assert sum(lengths) == len(local) * nbytes
    # contiguous here, not there: no merge
    starts, _, lengths = coalesce(local[:3], remote[[0, 2, 1]], nbytes)
    assert list(lengths) == [nbytes] * 3 and list(starts) == list(local[:3])
    assert [len(a) for a in coalesce(local[:0], remote[:0], nbytes)] == [0, 0, 0]


@needs_nixl
@pytest.mark.parametrize("change,error", [
    (dict(agent="not bytes"), "agent is not a bytes"),
    (dict(shape=[4, 2, 64, 8, 2, 8]), "shape"),
    (dict(mem="FILE"), "'FILE' memory"),
])
def test_a_malformed_nixl_hello_is_refused_at_the_handshake(change, error):
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "nixl", timeout_s=5)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "nixl", timeout_s=5)
    info = sender.plane.hello_info()
    sender.plane.hello_info = lambda: {**info, **change}
    with pytest.raises(TransferError, match=f"refused the pair: .*{error}"):
        sender.connect(receiver.address)
    sender.close()
    receiver.close()


@needs_nixl
def test_a_read_that_fails_fails_the_request_on_both_sides_and_the_receiver_serves_on():
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "nixl", timeout_s=5)
    liar = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "nixl", timeout_s=5)
    info = liar.plane.hello_info()  # its pool, announced 1 GiB away from where it is
    liar.plane.hello_info = lambda: {**info, "address": info["address"] + 2**30}
    liar.connect(receiver.address)
    receiver.expect("bad", [1, 2])
    liar.send("bad", receiver.address, [3, 4], [1, 2])
    (received,) = wait_results(receiver, 1, 10)
    (sent,) = wait_results(liar, 1, 10)
    assert not received.ok and "nixl" in received.error
    assert not sent.ok and "nixl" in sent.error
    assert (receiver.pool.buffer == POISON).all()
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "nixl", timeout_s=5)
    sender.connect(receiver.address)
    receiver.expect("good", [1, 2])
    sender.send("good", receiver.address, [3, 4], [1, 2])
    (received,) = wait_results(receiver, 1, 10)
    assert received.ok
    expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
    assert torch.equal(bits(receiver.pool.buffer[:, :, [1, 2]]), bits(expected[:, :, [3, 4]]))
    for node in (liar, sender, receiver):
        node.close()


@needs_nixl
def test_a_sender_paired_again_with_the_same_agent_is_still_read_from():
    """A sender that reconnects (after a failed send) brings the same agent: dropping the old
    pairing must not unload the agent the new one uses."""
    from pd_serve.protocol import KVChunk

    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "nixl", timeout_s=5)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "nixl", timeout_s=5)
    plane, info = receiver.plane, sender.plane.hello_info()
    for _ in range(2):
        plane.after_welcome("prefill-0", info)
    expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
    for rid, src, dst in [("first", [3, 4], [1, 2]), ("second", [5], [6])]:  # polls in between
        chunk = KVChunk(rid, dst, 0, LAYOUT.num_layers, len(dst) * LAYOUT.bytes_per_page, True,
                        src, [], [], 1)
        with receiver._lock:  # as the I/O thread does
            plane.receive("prefill-0", chunk, [], dst)
            plane.flush()
            plane.synchronize()
        assert plane.failed() == {}
        assert torch.equal(bits(receiver.pool.buffer[:, :, dst]), bits(expected[:, :, src]))
    sender.close()
    receiver.close()
