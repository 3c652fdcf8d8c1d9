"""KV transfer between real processes over real sockets (CPU: tcp and torch/gloo)."""

from __future__ import annotations

import math
import subprocess
import sys
import random
import threading
import time
from dataclasses import replace

import pytest
import torch

from pd_serve.ports import free_port
from pd_serve.transfer.base import Deadlines, TransferError
from pd_serve.transfer.receiver import KVReceiver
from pd_serve.transfer.sender import MESSAGE_DEPTH, KVSender

from peer import POISON, poisoned_pool, seeded_pool  # noqa: E402

from peer import LAYOUT, NUM_PAGES, SEED  # noqa: E402
from pd_serve.transfer.backends.nixl import nixl_available  # noqa: E402

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="nixl is not installed (pip install pd-serve[nixl])"))
BACKENDS = ["tcp", "torch", NIXL]


def wait_results(node, count: int, timeout: float) -> list:
    results, deadline = [], time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        results += node.poll()
        time.sleep(0.005)
    return results


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_16_concurrent_requests_arrive_bit_exact_and_only_in_reserved_pages(backend, peers):
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), backend, timeout_s=10)
    sender = peers("sender", backend)
    assert sender.call("connect", address=receiver.address) == {"ok": True}
    rng = random.Random(0)
    dst_free = rng.sample(range(NUM_PAGES), NUM_PAGES)  # shuffled: non-contiguous destinations
    plan = {}
    for i in range(16):
        n = rng.randint(1, 3)
        src = rng.sample(range(NUM_PAGES), n)
        dst, dst_free = dst_free[:n], dst_free[n:]
        plan[f"r{i}"] = (src, dst)
        receiver.expect(f"r{i}", dst)
    for rid, (src, dst) in plan.items():
        assert sender.call("send", request_id=rid, address=receiver.address,
                           src_page_ids=src, dst_page_ids=dst) == {"ok": True}
    sent = sender.call("poll", count=16, wait=10)["results"]
    received = wait_results(receiver, 16, 10)
    assert sorted(r["request_id"] for r in sent if r["ok"]) == sorted(plan)
    assert sorted(r.request_id for r in received if r.ok) == sorted(plan)
    expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
    got = receiver.pool.buffer
    used = set()
    for src, dst in plan.values():
        assert torch.equal(bits(got[:, :, dst]), bits(expected[:, :, src]))
        used |= set(dst)
    untouched = [p for p in range(NUM_PAGES) if p not in used]
    assert (got[:, :, untouched] == POISON).all()
    assert all(r.num_bytes == len(plan[r.request_id][0]) * LAYOUT.bytes_per_page for r in received)
    receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_groups_assemble_one_request(backend, peers):
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), backend, timeout_s=10)
    sender = peers("sender", backend)
    sender.call("connect", address=receiver.address)
    src, dst = [5, 2, 9], [40, 3, 17]
    receiver.expect("req", dst)
    for start, end in [(0, 1), (1, 3), (3, 4)]:
        sender.call("send", request_id="req", address=receiver.address, src_page_ids=src,
                    dst_page_ids=dst, layer_start=start, layer_end=end, last=end == 4)
    (result,) = wait_results(receiver, 1, 10)
    assert result.ok
    expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
    assert torch.equal(bits(receiver.pool.buffer[:, :, dst]), bits(expected[:, :, src]))
    receiver.close()


def test_the_transfer_timeout_counts_time_without_progress():
    """A prefill sends a prompt's layer groups as its forward computes them: the time between
    groups is compute, not transfer. Four groups 1.6 s apart (4.8 s in all) under a 4 s timeout
    on both sides arrive; then a transfer that stops after its first group times out on both."""
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=4)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "tcp", timeout_s=4)
    sender.connect(receiver.address)
    src, dst = [5, 2, 9], [40, 3, 17]
    receiver.expect("slow", dst, wait_s=math.inf)
    for layer in range(4):
        time.sleep(1.6 if layer else 0)
        sender.send("slow", receiver.address, src, dst, layer_start=layer, layer_end=layer + 1,
                    last=layer == 3)
    assert [r.ok for r in wait_results(sender, 1, 30)] == [True]
    assert [r.ok for r in wait_results(receiver, 1, 30)] == [True]
    expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
    assert torch.equal(bits(receiver.pool.buffer[:, :, dst]), bits(expected[:, :, src]))
    receiver.expect("stopped", [1, 6], wait_s=math.inf)
    sender.send("stopped", receiver.address, [7, 8], [1, 6], layer_start=0, layer_end=2, last=False)
    (sent,) = wait_results(sender, 1, 30)
    (received,) = wait_results(receiver, 1, 30)
    # both ends time out at 4 s: whichever does first tells the other (either may say why)
    for result in (sent, received):
        assert not result.ok and ("no acknowledgement" in result.error or "timed out" in result.error)
    sender.close()
    receiver.close()


@pytest.mark.parametrize("change", [dict(dtype="bfloat16"), dict(page_size=8), dict(num_kv_heads=4)])
def test_layout_mismatch_fails_the_handshake_clearly(change, peers):
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=10)
    sender = peers("sender", "tcp", layout=replace(LAYOUT, **change))
    answer = sender.call("connect", address=receiver.address)
    field, value = next(iter(change.items()))
    assert "KV layout mismatch" in answer["error"] and field in answer["error"]
    assert repr(value) in answer["error"]
    receiver.close()


FP8_LAYOUT = replace(LAYOUT, dtype="float8_e4m3fn", k_scales=(0.5, 1.0, 2.0, 0.25),
                     v_scales=(1.0, 1.0, 4.0, 1.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_pages_arrive_bit_exact(backend, peers):
    """--kv-cache-dtype fp8_e4m3 on both sides: one byte per element on the wire, unchanged."""
    receiver = KVReceiver(poisoned_pool(FP8_LAYOUT, NUM_PAGES), backend, timeout_s=10)
    poisoned = receiver.pool.buffer.clone()
    sender = peers("sender", backend, layout=FP8_LAYOUT)
    assert sender.call("connect", address=receiver.address) == {"ok": True}
    src, dst = [3, 60, 17, 4], [8, 1, 44, 63]
    receiver.expect("fp8", dst)
    sender.call("send", request_id="fp8", address=receiver.address, src_page_ids=src,
                dst_page_ids=dst)
    (result,) = wait_results(receiver, 1, 10)
    assert result.ok and result.num_bytes == 4 * FP8_LAYOUT.bytes_per_page
    assert FP8_LAYOUT.bytes_per_page * 4 == LAYOUT.bytes_per_page
    expected = seeded_pool(FP8_LAYOUT, NUM_PAGES, SEED).buffer.view(torch.uint8)
    got = receiver.pool.buffer.view(torch.uint8)
    assert torch.equal(got[:, :, dst], expected[:, :, src])
    untouched = [p for p in range(NUM_PAGES) if p not in dst]
    assert torch.equal(got[:, :, untouched], poisoned.view(torch.uint8)[:, :, untouched])
    receiver.close()


def test_fp8_sender_fp32_receiver_fails_the_handshake_naming_the_kv_dtype(peers):
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=10)
    sender = peers("sender", "tcp", layout=FP8_LAYOUT)
    error = sender.call("connect", address=receiver.address)["error"]
    assert "KV layout mismatch (sender vs receiver): dtype 'float8_e4m3fn' != 'float32'" in error
    assert "--kv-cache-dtype" in error and "k_scales" not in error
    receiver.close()


def test_backend_mismatch_and_unknown_backend(monkeypatch):
    from pd_serve.transfer.backends import nixl

    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=5)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "torch", timeout_s=5)
    with pytest.raises(TransferError, match="backend mismatch"):
        sender.connect(receiver.address)
    monkeypatch.setattr(nixl, "_MODULES", ("no_such_nixl._api",))  # as where it is not installed
    with pytest.raises(TransferError, match=r"'nixl' package, which is not installed \(pip install "
                                            r"pd-serve\[nixl\]\); use --transfer-backend torch, ipc or tcp"):
        KVSender(seeded_pool(LAYOUT, 4, SEED), "nixl")
    with pytest.raises(TransferError, match="not one of torch, ipc, tcp, nixl"):
        KVSender(seeded_pool(LAYOUT, 4, SEED), "carrier-pigeon")
    sender.close()
    receiver.close()


def test_torch_backend_refuses_a_sender_on_its_own_gpu(monkeypatch):
    """NCCL cannot pair two ranks on one GPU: the handshake says so and names ipc (the GPU's
    UUID is faked here, so the check runs on CPU)."""
    from pd_serve.transfer import base
    from pd_serve.transfer.backends import torch_dist

    monkeypatch.setattr(base, "device_uuid", lambda device: "GPU-same")
    monkeypatch.setattr(torch_dist, "device_uuid", lambda device: "GPU-same")
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "torch", timeout_s=5)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "torch", timeout_s=5)
    with pytest.raises(TransferError, match="same GPU .GPU-same.*use --transfer-backend ipc"):
        sender.connect(receiver.address)
    sender.close()
    receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unreserved_request_is_refused_and_writes_nothing(backend, peers):
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), backend, timeout_s=10)
    sender = peers("sender", backend)
    sender.call("connect", address=receiver.address)
    sender.call("send", request_id="ghost", address=receiver.address, src_page_ids=[1, 2],
                dst_page_ids=[3, 4])
    (result,) = sender.call("poll", count=1, wait=10)["results"]
    assert not result["ok"] and "not expected" in result["error"]
    receiver.expect("wrong-pages", [10, 11])
    sender.call("send", request_id="wrong-pages", address=receiver.address, src_page_ids=[1, 2],
                dst_page_ids=[10, 12])
    (result,) = wait_results(receiver, 1, 10)
    assert not result.ok and "destination pages differ" in result.error
    receiver.expect("too-few-pages", [20, 21])
    sender.call("send", request_id="too-few-pages", address=receiver.address, src_page_ids=[1],
                dst_page_ids=[20])
    (result,) = wait_results(receiver, 1, 10)
    assert not result.ok and "leaves reserved pages unwritten" in result.error
    assert (receiver.pool.buffer == POISON).all()
    receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_mid_transfer_fails_both_sides(backend, peers):
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), backend, timeout_s=10)
    sender = peers("sender", backend)
    sender.call("connect", address=receiver.address)
    receiver.expect("req", [1, 2])
    sender.call("send", request_id="req", address=receiver.address, src_page_ids=[3, 4],
                dst_page_ids=[1, 2], layer_start=0, layer_end=2, last=False)
    sender.call("abort", request_id="req")
    (sent,) = sender.call("poll", count=1, wait=5)["results"]
    (received,) = wait_results(receiver, 1, 5)
    assert not sent["ok"] and "aborted" in sent["error"]
    assert not received.ok and "sender aborted" in received.error
    assert receiver.num_expected == 0
    receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_killed_mid_transfer_receiver_reports_it(backend, peers):
    """The receiver ends the request with an error within its timeout: by the timeout itself,
    or sooner when the backend sees the peer's connection drop (gloo does)."""
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), backend, timeout_s=10)
    sender = peers("sender", backend)
    sender.call("connect", address=receiver.address)
    receiver.expect("req", [1, 2], timeout_s=1.5)
    sender.call("send", request_id="req", address=receiver.address, src_page_ids=[3, 4],
                dst_page_ids=[1, 2], layer_start=0, layer_end=1, last=False)
    sender.kill()
    start = time.monotonic()
    (result,) = wait_results(receiver, 1, 10)
    assert not result.ok
    assert "timed out" in result.error or "receive failed" in result.error, result.error
    assert time.monotonic() - start < 3.0
    assert receiver.num_expected == 0
    receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_killed_sender_reports_error_within_timeout(backend, peers):
    receiver = peers("receiver", backend)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), backend, timeout_s=2.0)
    sender.connect(receiver.address)
    receiver.call("expect", request_id="req", page_ids=[1, 2])
    receiver.kill()
    start = time.monotonic()
    sender.send("req", receiver.address, [3, 4], [1, 2])
    (result,) = wait_results(sender, 1, 10)
    assert not result.ok
    assert time.monotonic() - start < 4.0
    assert sender._outstanding[receiver.address] == 0  # the failed request counted out too
    sender.close()


def test_stats_count_bytes_transfers_and_failures(peers):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=10)
    sender = peers("sender", "tcp")
    sender.call("connect", address=receiver.address)
    receiver.expect("ok", [1])
    sender.call("send", request_id="ok", address=receiver.address, src_page_ids=[2], dst_page_ids=[1])
    receiver.expect("late", [5], timeout_s=0.2)
    assert len(wait_results(receiver, 2, 10)) == 2
    text = generate_latest(receiver.stats.registry).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["pd_serve:kv_transfers_total"] == 1
    assert samples["pd_serve:kv_transfer_failures_total"] == 1
    assert samples["pd_serve:kv_transfer_bytes_total"] == LAYOUT.bytes_per_page
    assert samples["pd_serve:kv_transfer_seconds_count"] == 1
    receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_sends_split_into_chunks_stay_bit_exact(backend):
    """Chunks of one byte: every page travels as its own chunk, whole and by layer group."""
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), backend, timeout_s=10)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), backend, timeout_s=10, chunk_bytes=1,
                      max_chunk_bytes=1)
    sender.connect(receiver.address)
    plan = {"whole": ([7, 1, 30, 12], [0, 63, 8, 9]), "grouped": ([2, 5, 40], [20, 11, 33])}
    for rid, (src, dst) in plan.items():
        receiver.expect(rid, dst)
    sender.send("whole", receiver.address, *plan["whole"])
    for start, end in [(0, 1), (1, 4)]:
        sender.send("grouped", receiver.address, *plan["grouped"], layer_start=start, layer_end=end,
                    last=end == 4)
    sent = wait_results(sender, 2, 10)
    received = wait_results(receiver, 2, 10)
    assert sorted(r.request_id for r in sent if r.ok) == sorted(plan)
    assert sorted(r.request_id for r in received if r.ok) == sorted(plan)
    assert all(r.num_bytes == len(plan[r.request_id][0]) * LAYOUT.bytes_per_page for r in received)
    expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
    for src, dst in plan.values():
        assert torch.equal(bits(receiver.pool.buffer[:, :, dst]), bits(expected[:, :, src]))
    sender.close()
    receiver.close()


def test_chunks_double_from_the_first_size_up_to_the_largest():
    page = LAYOUT.bytes_per_page
    sender = KVSender(seeded_pool(LAYOUT, 4, SEED), "tcp", chunk_bytes=2 * page, max_chunk_bytes=8 * page)
    assert sender._chunk_bounds(20, page) == [(0, 2), (2, 6), (6, 14), (14, 20)]
    assert sender._chunk_bounds(1, page) == [(0, 1)]
    assert sender._chunk_bounds(0, page) == [(0, 0)]
    assert sender._chunk_bounds(3, 100 * page) == [(0, 1), (1, 2), (2, 3)]  # pages never split
    sender.close()


def test_requests_queued_together_travel_in_several_messages(monkeypatch):
    """32 requests queued at once go out in messages of at most a MESSAGE_DEPTH-th of them, not
    in one: the receiver takes and acknowledges the first while the sender sends the next."""
    sizes = []  # chunks per message, as the receiver takes them
    split = KVReceiver._split

    def recorded_split(msg, frames):
        sizes.append(len(msg.chunks))
        return split(msg, frames)

    monkeypatch.setattr(KVReceiver, "_split", staticmethod(recorded_split))
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=10)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "tcp", timeout_s=10)
    sender.connect(receiver.address)
    queued, send_chunks = threading.Event(), sender._send_chunks

    def held(jobs, poller):  # the I/O thread waits until every send is queued
        queued.wait(10)
        send_chunks(jobs, poller)

    sender._send_chunks = held
    plan = {f"r{i}": ([i], [32 + i]) for i in range(32)}
    for rid, (src, dst) in plan.items():
        receiver.expect(rid, dst)
        sender.send(rid, receiver.address, src, dst)
    queued.set()
    sent = wait_results(sender, 32, 10)
    assert sorted(r.request_id for r in sent if r.ok) == sorted(plan)
    assert sorted(r.request_id for r in wait_results(receiver, 32, 10) if r.ok) == sorted(plan)
    # (the I/O thread may take the first send alone, before it reaches the wait)
    assert sum(sizes) == 32 and max(sizes) <= 32 // MESSAGE_DEPTH, sizes
    assert len(sizes) >= MESSAGE_DEPTH, sizes
    assert sender._outstanding[receiver.address] == 0  # every result counted out
    expected = seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer
    assert torch.equal(bits(receiver.pool.buffer[:, :, 32:]), bits(expected[:, :, :32]))
    sender.close()
    receiver.close()


def test_poll_waits_for_a_result_up_to_its_timeout():
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=10)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "tcp", timeout_s=10)
    sender.connect(receiver.address)
    start = time.monotonic()
    assert sender.poll(timeout_s=0.2) == []
    assert time.monotonic() - start >= 0.19
    receiver.expect("req", [1])
    sender.send("req", receiver.address, [2], [1])
    (result,) = sender.poll(timeout_s=10)
    assert result.ok and result.request_id == "req"
    sender.close()
    receiver.close()


class _Gate:
    """A stand-in CUDA event: passed once the test opens it."""

    def __init__(self, plane):
        self.plane = plane

    def query(self) -> bool:
        return self.plane.open.is_set()


def gated_receiver() -> KVReceiver:
    """A tcp receiver whose writes 'land' only when the test sets `plane.open` (or something
    synchronizes), counting its plane's calls, as a GPU plane's queued writes would behave."""
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=10)
    plane, base = receiver.plane, type(receiver.plane)

    class Gated(base):
        open = threading.Event()
        calls = {"receive": 0, "flush": 0, "synchronize": 0}

        def receive(self, *args):
            self.calls["receive"] += 1
            return base.receive(self, *args)

        def flush(self):
            self.calls["flush"] += 1

        def mark(self):
            return _Gate(self)

        def synchronize(self):
            self.calls["synchronize"] += 1
            self.open.set()

    plane.__class__ = Gated
    return receiver


def test_ack_waits_until_the_writes_land_and_chunks_waiting_are_written_together():
    receiver = gated_receiver()
    plane = receiver.plane
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "tcp", timeout_s=10)
    sender.connect(receiver.address)
    plan = {f"r{i}": ([i], [10 + i]) for i in range(8)}
    for rid, (_, dst) in plan.items():
        receiver.expect(rid, dst)
    with receiver._lock:  # the I/O thread stops at the first chunk; the rest queue up meanwhile
        for rid, (src, dst) in plan.items():
            sender.send(rid, receiver.address, src, dst)
        time.sleep(0.5)
    assert sender.poll(timeout_s=0.5) == [] and receiver.poll() == []  # written, not landed
    assert plane.calls["receive"] == 8 and plane.calls["flush"] <= 2  # taken in one or two batches
    plane.open.set()
    sent = wait_results(sender, 8, 10)
    assert sorted(r.request_id for r in sent if r.ok) == sorted(plan)
    assert sorted(r.request_id for r in wait_results(receiver, 8, 10) if r.ok) == sorted(plan)
    assert receiver.num_expected == 0
    sender.close()
    receiver.close()


def test_cancel_while_writes_land_waits_for_them_and_the_sender_hears_of_it():
    receiver = gated_receiver()
    plane = receiver.plane
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "tcp", timeout_s=10)
    sender.connect(receiver.address)
    receiver.expect("req", [4, 5])
    sender.send("req", receiver.address, [1, 2], [4, 5])
    deadline = time.monotonic() + 10
    while plane.calls["receive"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.poll(timeout_s=0.2) == []
    receiver.cancel("req")  # the caller frees the pages next: the writes must be in first
    assert plane.calls["synchronize"] == 1 and receiver.num_expected == 0
    (result,) = sender.poll(timeout_s=10)
    assert not result.ok and "cancelled by the receiver" in result.error
    assert receiver.poll() == []  # cancel() gives no result
    receiver.cancel("never-expected")  # nothing written: nothing to wait for
    assert plane.calls["synchronize"] == 1
    sender.close()
    receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_request_without_pages_completes(backend):
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), backend, timeout_s=10)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), backend, timeout_s=10)
    sender.connect(receiver.address)
    receiver.expect("empty", [])
    sender.send("empty", receiver.address, [], [])
    (result,) = sender.poll(timeout_s=10)
    assert result.ok and result.num_bytes == 0, result
    assert [r.ok for r in wait_results(receiver, 1, 10)] == [True]
    assert (receiver.pool.buffer == POISON).all()
    sender.close()
    receiver.close()


def test_a_malformed_chunk_message_is_dropped_and_the_receiver_keeps_serving():
    import zmq

    from pd_serve import protocol
    from pd_serve.protocol import KVChunk, KVChunks

    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=10)
    receiver.expect("bad", [3])
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(receiver.address)
    chunk = KVChunk("bad", [3], 0, LAYOUT.num_layers, LAYOUT.bytes_per_page, True)
    # says one frame follows, sends none; then a message that is not a message at all
    rogue.send_multipart([protocol.encode(KVChunks([chunk], [1]))])
    rogue.send_multipart([b"\x93garbage"])
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "tcp", timeout_s=10)
    sender.connect(receiver.address)
    receiver.expect("good", [4])
    sender.send("good", receiver.address, [1], [4])
    (result,) = sender.poll(timeout_s=10)
    assert result.ok, result
    assert (receiver.pool.buffer[:, :, 3] == POISON).all()  # nothing written for the bad one
    receiver.cancel("bad")
    rogue.close()
    sender.close()
    receiver.close()


def test_deadlines_give_only_held_records_past_their_deadline():
    deadlines, held = Deadlines(), {}
    for key, deadline in (("a", 1.0), ("b", 3.0), ("c", 2.0)):
        held[key] = object()
        deadlines.add(key, held[key], deadline)
    assert deadlines.expired(0.5, held) == []
    del held["c"]  # dropped by its owner: its entry is skipped
    held["a"] = object()  # re-added under the same key, later
    deadlines.add("a", held["a"], 5.0)
    assert deadlines.expired(3.5, held) == ["b"]
    assert deadlines.expired(10.0, held) == ["a"]
    assert len(deadlines) == 0


def test_a_request_id_expected_again_keeps_its_new_deadline():
    """A cancelled request's deadline does not end the same id expected again later."""
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=10)
    receiver.expect("req", [1], timeout_s=0.2)
    receiver.cancel("req")
    receiver.expect("req", [1], timeout_s=30)
    receiver.expect("short", [2], timeout_s=0.2)
    (result,) = wait_results(receiver, 1, 5)
    assert (result.request_id, result.ok) == ("short", False) and "timed out" in result.error
    time.sleep(0.2)
    assert receiver.poll() == [] and receiver.num_expected == 1
    receiver.cancel("req")
    receiver.close()


def test_a_reservation_without_a_wait_limit_times_out_only_from_its_first_chunk():
    """A decode worker's reservation (wait_s=inf) waits as long as its prompt waits for prefill;
    once its KV starts to arrive, the transfer has timeout_s to finish."""
    receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=1.0)
    sender = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "tcp", timeout_s=60)
    sender.connect(receiver.address)
    receiver.expect("queued", [1, 2], wait_s=math.inf)
    receiver.expect("bounded", [3], wait_s=1.0)
    (result,) = wait_results(receiver, 1, 30)
    assert result.request_id == "bounded" and "timed out" in result.error
    assert receiver.num_expected == 1  # "queued" has no deadline before its first chunk
    sender.send("queued", receiver.address, [3, 4], [1, 2], layer_start=0, layer_end=1, last=False)
    (result,) = wait_results(receiver, 1, 30)
    assert result.request_id == "queued" and "timed out" in result.error
    assert receiver.num_expected == 0
    sender.close()
    receiver.close()



@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receiver_started_again_at_its_address_is_paired_again(backend, peers):
    """A decode worker restarted on its host: bound to every interface, advertised by address,
    the same port. The sender drops the pairing when the old one's connection closes, so its
    next send says hello again (torch: a new process group) instead of failing."""
    port = free_port()
    sender = peers("sender", backend)
    for i in range(2):
        receiver = KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), backend, host="0.0.0.0",
                              port=port, advertise_host="127.0.0.1", timeout_s=10)
        assert receiver.address == f"tcp://127.0.0.1:{port}"
        receiver.expect(f"r{i}", [i])
        assert sender.call("send", request_id=f"r{i}", address=receiver.address,
                           src_page_ids=[i], dst_page_ids=[i]) == {"ok": True}
        assert [r["ok"] for r in sender.call("poll", count=1, wait=10)["results"]] == [True]
        assert [r.ok for r in wait_results(receiver, 1, 10)] == [True]
        receiver.close()
        time.sleep(1.0)  # for the sender to hear that the connection closed


def test_a_dead_receivers_address_does_not_hold_up_the_others():
    """A decode worker killed (kill -9) while a prompt for it was being computed: the sender
    heard its connection close, so the send says hello again to an address nobody answers.
    The I/O thread waited there for the whole --transfer-timeout, and every transfer to every
    other decode worker waited with it (30 s by default). Now the welcome is awaited in the
    poll loop: the live receiver's transfer lands at once, the dead one's fails on its own."""
    timeout_s = 10.0
    snd = KVSender(seeded_pool(LAYOUT, NUM_PAGES, SEED), "tcp", timeout_s=timeout_s)
    dead, live = (KVReceiver(poisoned_pool(LAYOUT, NUM_PAGES), "tcp", timeout_s=10)
                  for _ in range(2))
    for i, rec in enumerate((dead, live)):  # both paired
        rec.expect(f"warm{i}", [i])
        snd.send(f"warm{i}", rec.address, [i], [i])
    assert sorted(r.ok for r in wait_results(snd, 2, 10)) == [True, True]
    dead_address = dead.address
    dead.close()
    time.sleep(1.0)  # for the sender to hear that its connection closed
    start = time.monotonic()
    snd.send("to-dead", dead_address, [2], [2])
    live.expect("to-live", [3])
    snd.send("to-live", live.address, [3], [3])
    arrived = {}
    while len(arrived) < 2 and time.monotonic() < start + timeout_s + 10:
        for result in snd.poll(0.05):
            arrived[result.request_id] = (result.ok, time.monotonic() - start)
    assert arrived["to-live"][0] and arrived["to-live"][1] < timeout_s / 2, arrived  # (~0.01 s)
    assert not arrived["to-dead"][0] and arrived["to-dead"][1] >= timeout_s - 0.5, arrived
    assert [r.ok for r in wait_results(live, 2, 10)] == [True, True]
    assert torch.equal(bits(live.pool.buffer[:, :, [3]]),
                       bits(seeded_pool(LAYOUT, NUM_PAGES, SEED).buffer[:, :, [3]]))
    snd.close()
    live.close()


class _StallingProxy:
    """A TCP relay to `address` that can stop moving bytes (both ways) without closing, as a
    partitioned link does: TCP backs up into the sender, nothing errors."""

    def __init__(self, address: str):
        import socket
        self.target = int(address.rsplit(":", 1)[1])
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stalled = threading.Event()
        self.socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        while True:
            try:
                a = self.listener.accept()[0]
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            self.socks += [a, b]
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b) -> None:
        import select
        peer = {a: b, b: a}
        try:
            while True:
                if self.stalled.is_set():
                    time.sleep(0.05)
                    continue
                for s in select.select([a, b], [], [], 0.05)[0]:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    peer[s].sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


def test_a_stalled_receiver_does_not_hold_up_the_others():
    """A receiver that takes nothing (a partition between a prefill and a decode worker, the
    decode still registered) fills zmq's queue to it: 1,000 messages (a request sends one a
    layer group, more for large prompts). The next send then blocked the sender's I/O thread:
    no transfer to any other receiver went out or ended, and no --transfer-timeout fired, for
    as long as the link stayed dark (forever, were its host gone: no reset ever comes). Now a
    send that would wait fails its requests and drops the pair; the others go on."""
    from pd_serve.cache.pool import KVLayout
    timeout_s = 5.0
    layout = KVLayout(num_layers=4, page_size=16, num_kv_heads=2, head_dim=64, dtype="float32")
    # a page a chunk, a chunk a message (64 KiB each)
    snd = KVSender(seeded_pool(layout, 4, SEED), "tcp", timeout_s=timeout_s, chunk_bytes=1,
                   max_chunk_bytes=1)
    far, live = (KVReceiver(poisoned_pool(layout, 4), "tcp", timeout_s=timeout_s)
                 for _ in range(2))
    proxy = _StallingProxy(far.address)
    try:
        for i, (rec, address) in enumerate(((far, proxy.address), (live, live.address))):
            rec.expect(f"warm{i}", [i])
            snd.send(f"warm{i}", address, [i], [i])
        assert sorted(r.ok for r in wait_results(snd, 2, 10)) == [True, True]
        proxy.stalled.set()
        # 3,000 messages: the kernel's buffers on both ends of the relay take a few hundred
        snd.send("to-far", proxy.address, [2] * 3000, [2] * 3000)
        time.sleep(1.0)
        live.expect("to-live", [3])
        start = time.monotonic()
        snd.send("to-live", live.address, [3], [3])
        arrived = {}
        while len(arrived) < 2 and time.monotonic() < start + timeout_s + 10:
            for result in snd.poll(0.05):
                arrived[result.request_id] = (result.ok, time.monotonic() - start)
        assert "to-live" in arrived and arrived["to-live"][0], arrived
        assert arrived["to-live"][1] < timeout_s, arrived
        assert "to-far" in arrived and not arrived["to-far"][0], arrived
        assert [r.ok for r in wait_results(live, 2, 10)] == [True, True]
    finally:
        proxy.stalled.clear()
        snd.close()
        for rec in (far, live):
            rec.close()
        proxy.close()


_CLOSE_MID_SEND = """
import random, sys
import zmq.utils.garbage
from pd_serve.cache.pool import KVLayout
from pd_serve.transfer.receiver import KVReceiver
from pd_serve.transfer.sender import KVSender
sys.path.insert(0, "tests/transfer")
from peer import poisoned_pool, seeded_pool
layout = KVLayout(num_layers=4, page_size=16, num_kv_heads=8, head_dim=128, dtype="float32")
pages = list(range(64))  # 32 MiB a send: one zero-copy frame, in its write for ~0.1 s
receiver = KVReceiver(poisoned_pool(layout, len(pages)), "tcp", timeout_s=10)
pool = seeded_pool(layout, len(pages), 1)
for i in range(100):
    sender = KVSender(pool, "tcp", timeout_s=10)
    sender.connect(receiver.address)
    receiver.expect(f"r{i}", pages)
    sender.send(f"r{i}", receiver.address, pages, pages)
    sender.poll(random.uniform(0, 0.03))
    sender.close()
    zmq.utils.garbage.gc.refs.clear()  # what pyzmq's atexit does as the interpreter exits
print("closed", i + 1)
"""


def test_a_sender_closed_mid_send_leaves_libzmq_no_frame_to_write():
    """A worker exiting (--drain-timeout passed) with a send in flight: close() returned while
    libzmq's I/O thread was still writing a zero-copy frame of pages, the interpreter's exit
    then let go of the frame's memory, and libzmq aborted the process ("Bad address"). Here
    the exit's release follows each close at once, 100 times (before the fix: within ~40)."""
    out = subprocess.run([sys.executable, "-c", _CLOSE_MID_SEND], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "closed 100" in out.stdout, (out.returncode, out.stderr[-2000:])
