"""GPU transfers between processes: NCCL pair groups, CUDA IPC and tcp, bit-exact (skip without a GPU)."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch

from peer import LAYOUT, NUM_PAGES, POISON, SEED, poisoned_pool, seeded_pool
from pd_serve.transfer.receiver import KVReceiver

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_LAYOUT = replace(LAYOUT, dtype="bfloat16", num_layers=8, page_size=16, head_dim=128)


@pytest.mark.parametrize("chunk_bytes", [32 * 2**20, 1], ids=["whole", "page-chunks"])
@pytest.mark.parametrize("backend", ["ipc", "torch", "tcp"])
def test_gpu_transfer_bit_exact(backend, chunk_bytes, peers):
    two = torch.cuda.device_count() >= 2
    if backend == "torch" and not two:
        pytest.skip("NCCL pairs need two GPUs")
    receiver_device = "cuda:1" if two else "cuda:0"
    receiver = KVReceiver(poisoned_pool(GPU_LAYOUT, NUM_PAGES, receiver_device), backend, timeout_s=60)
    sender = peers("sender", backend, layout=GPU_LAYOUT, timeout=60, device="cuda:0",
                   chunk_bytes=chunk_bytes)
    assert sender.call("connect", address=receiver.address) == {"ok": True}
    assert sender.call("mark") == {"ok": True}  # one ready mark, shared by every third request
    rng = random.Random(1)
    dst_free = rng.sample(range(NUM_PAGES), NUM_PAGES)
    plan = {}
    for i in range(16):
        n = rng.randint(1, 3)
        src, (dst, dst_free) = rng.sample(range(NUM_PAGES), n), (dst_free[:n], dst_free[n:])
        plan[f"r{i}"] = (src, dst)
        receiver.expect(f"r{i}", dst)
        # every other request goes layer group by layer group
        groups = [(0, 3), (3, 8)] if i % 2 else [(0, 8)]
        for a, b in groups:
            assert sender.call("send", request_id=f"r{i}", address=receiver.address, src_page_ids=src,
                               dst_page_ids=dst, layer_start=a, layer_end=b, last=b == 8,
                               shared_mark=i % 3 == 0) == {"ok": True}
    sent = sender.call("poll", count=16, wait=60)["results"]
    assert sorted(r["request_id"] for r in sent if r["ok"]) == sorted(plan), sent
    results, deadline = [], time.monotonic() + 30
    while len(results) < 16 and time.monotonic() < deadline:
        results += receiver.poll()
    assert all(r.ok for r in results) and len(results) == 16
    expected = seeded_pool(GPU_LAYOUT, NUM_PAGES, SEED).buffer  # rebuilt on CPU
    got = receiver.pool.buffer.cpu()
    used = set()
    for src, dst in plan.values():
        assert torch.equal(got[:, :, dst].view(torch.int16), expected[:, :, src].view(torch.int16))
        used |= set(dst)
    rest = [p for p in range(NUM_PAGES) if p not in used]
    assert (got[:, :, rest].float() == POISON).all()
    receiver.close()


def test_ipc_sender_back_under_its_old_id_is_read_from_its_new_pool(monkeypatch):
    """A prefill worker restarted under the same id pairs again with a new pool: the receiver's
    copy graphs (which hold the old pool's address) must go, so the copies read the new one.
    (Mapping over IPC needs two processes; here the 'mapped' pool is the tensor itself.)"""
    from pd_serve.protocol import KVChunk
    from pd_serve.transfer.backends import ipc
    monkeypatch.setattr(ipc, "import_cuda_tensor", lambda description, device: description)
    pool = poisoned_pool(GPU_LAYOUT, NUM_PAGES, "cuda:0")
    plane = ipc.IpcReceiverPlane(pool, 10.0, "127.0.0.1")
    for seed in (SEED, SEED + 1):
        source = seeded_pool(GPU_LAYOUT, NUM_PAGES, seed, "cuda:0")
        plane.after_welcome("prefill-0", {"pool": source.buffer})
        chunk = KVChunk("r", [5, 6], 0, GPU_LAYOUT.num_layers, 2 * GPU_LAYOUT.bytes_per_page,
                        True, [1, 2])
        with torch.cuda.stream(plane.stream):
            plane.receive("prefill-0", chunk, [], [5, 6])
            plane.flush()
        plane.synchronize()
        assert torch.equal(pool.buffer[:, :, [5, 6]].view(torch.int16),
                           source.buffer[:, :, [1, 2]].view(torch.int16)), f"seed {seed}"
