"""TritonAttentionBackend against TorchAttentionBackend on the same pool and batch.

Without a GPU the Triton kernels (the backend's and kernels/kv_store's) run in Triton's
interpreter on CPU tensors: an autouse fixture sets PD_SERVE_TRITON_CPU=1. On a CUDA machine the
same tests run compiled on the GPU instead (one Triton mode per process: the interpreter patches
triton.language for good). The graph-mode tests plan into the fixed buffers and run eagerly;
one CUDA test captures a graph and replays it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import paged_attention
from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.engine.attention.base import AttentionMetadata
from pd_serve.engine.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

NUM_LAYERS, PAGE_SIZE, NUM_PAGES = 2, 4, 40
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")


def make_pools(dtype, device=DEVICE, num_heads=NUM_KV_HEADS, head_dim=HEAD_DIM):
    """Two pools with the same random contents (the cached prefixes live there already)."""
    layout = KVLayout(NUM_LAYERS, PAGE_SIZE, num_heads, head_dim, str(dtype).removeprefix("torch."))
    pools = [KVPool(layout, NUM_PAGES, device) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    init = torch.randn(pools[0].buffer.shape, generator=g).to(dtype)
    for pool in pools:
        pool.buffer.copy_(init)
    return pools


def make_batch(rows: list[tuple[int, int]], device=DEVICE, seed: int = 0) -> AttentionMetadata:
    """rows: (query_len, seq_len) per sequence; scattered pages, and page tables holding more
    pages than the context needs (allocated ahead), as the scheduler's are."""
    order = torch.randperm(NUM_PAGES - 1, generator=torch.Generator().manual_seed(seed)) + 1
    free = order.tolist()  # page 0 stays out: graph padding reads it
    tables, slots = [], []
    for num_new, seq_len in rows:
        num_pages = -(-seq_len // PAGE_SIZE) + 1
        pages, free = free[:num_pages], free[num_pages:]
        tables.append(pages)
        slots += [pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
                  for p in range(seq_len - num_new, seq_len)]
    return AttentionMetadata([n for n, _ in rows], [L for _, L in rows], tables,
                             torch.tensor(slots, device=device))


def run_layers(backend, meta, dtype, seed: int = 1, drawn: int | None = None,
               planned: bool = False) -> list[torch.Tensor]:
    """plan() once (unless planned), then run() on each layer with fresh random q, k, v (the
    first meta.num_tokens of `drawn` rows, so a padded and an unpadded batch see the same
    values) -> the outputs."""
    if not planned:
        backend.plan(meta)
    g = torch.Generator().manual_seed(seed)
    n = meta.num_tokens
    outs = []
    for layer in range(NUM_LAYERS):
        q = torch.randn(drawn or n, backend.num_heads, backend.head_dim, generator=g)
        k, v = (torch.randn(drawn or n, backend.pool.layout.num_kv_heads, backend.head_dim,
                            generator=g) for _ in range(2))
        inputs = (x[:n].to(dtype).to(backend.pool.buffer.device) for x in (q, k, v))
        outs.append(backend.run(layer, *inputs).clone())
    return outs


def backends(pools, num_heads=NUM_HEADS, head_dim=HEAD_DIM, layer_windows=()):
    from pd_serve.engine.attention.triton_backend import TritonAttentionBackend

    scale = head_dim ** -0.5
    return (TritonAttentionBackend(pools[0], num_heads, head_dim, scale,
                                   layer_windows=layer_windows),
            TorchAttentionBackend(pools[1], num_heads, head_dim, scale,
                                  layer_windows=layer_windows))


def assert_same(triton_outs, torch_outs, pools, dtype):
    for ours, ref in zip(triton_outs, torch_outs):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape
        err = (ours.float() - ref.float()).abs().max().item()
        assert err <= TOLERANCE[dtype], f"max abs error {err:.3e}"
    assert torch.equal(pools[0].buffer, pools[1].buffer), "the pools differ after run()"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [
    pytest.param([(5, 5), (1, 9), (6, 14), (1, 1), (3, 3)], id="mixed"),
    pytest.param([(1, 9), (1, 1), (1, 23), (1, 4)], id="decode"),
])
def test_matches_torch_backend(rows, dtype):
    pools = make_pools(dtype)
    triton_backend, torch_backend = backends(pools)
    meta = make_batch(rows)
    before = paged_attention.triton_launches
    ours = run_layers(triton_backend, meta, dtype)
    assert paged_attention.triton_launches > before, "the Triton path did not run"
    assert triton_backend.decode == all(n == 1 for n, _ in rows)
    assert_same(ours, run_layers(torch_backend, meta, dtype), pools, dtype)


@pytest.mark.parametrize("rows", [
    pytest.param([(5, 5), (1, 9), (6, 14), (1, 1), (3, 3), (9, 23)], id="mixed"),
    pytest.param([(1, 9), (1, 1), (1, 23), (1, 4)], id="decode"),
])
def test_sliding_window_matches_torch_backend(rows):
    """Layer 0 sees a window of 3 keys, layer 1 the whole context (as Qwen2's
    max_window_layers mixes them); the window changes layer 0's output."""
    dtype = torch.float32
    pools = make_pools(dtype)
    triton_backend, torch_backend = backends(pools, layer_windows=(3, 0))
    meta = make_batch(rows)
    ours = run_layers(triton_backend, meta, dtype)
    assert_same(ours, run_layers(torch_backend, meta, dtype), pools, dtype)
    full = run_layers(backends(make_pools(dtype))[1], meta, dtype)
    assert not torch.allclose(ours[0], full[0]) and torch.allclose(ours[1], full[1], atol=1e-5)


def graph_batch(rows: list[tuple[int, int]], bs: int, slot_buffer: torch.Tensor, seed: int):
    """A decode batch padded to bs rows as the runner pads it (slot -1, one token in page 0);
    slot_mapping a view of the fixed slot buffer. Returns (padded meta, meta of the real rows)."""
    real = make_batch(rows, slot_buffer.device, seed)
    pad = bs - len(rows)
    slot_buffer[:bs].copy_(torch.tensor(real.slot_mapping.tolist() + [-1] * pad))
    padded = AttentionMetadata([1] * bs, real.seq_lens + [1] * pad, real.page_tables + [[0]] * pad,
                               slot_buffer[:bs])
    return padded, real


def staging(backend, bs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's staging buffers for bucket bs: host int32 and its device copy."""
    size = bs * backend.graph_input_width(bs)
    return torch.zeros(size, dtype=torch.int32), torch.zeros(size, dtype=torch.int32, device=device)


def plan_graph(backend, bs: int, meta: AttentionMetadata, staged) -> int:
    """plan_cuda_graph, then the runner's host->device copy of what it says it staged; returns
    how many values that was."""
    host, device = staged
    count = backend.plan_cuda_graph(bs, meta, host, device)
    device[:count].copy_(host[:count])
    return count


def test_graph_mode_fills_fixed_buffers():
    dtype = torch.float32
    pools = make_pools(dtype)
    triton_backend, torch_backend = backends(pools)
    triton_backend.init_cuda_graph(8, 6)
    assert triton_backend.graph_input_width(4) == 3 + 6  # seq_len, kv_indptr, 6 pages a row (+1)
    staged = staging(triton_backend, 4, DEVICE)
    out_ptr = triton_backend.graph_out.data_ptr()
    slot_buffer = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    page0 = [pool.buffer[:, :, 0].clone() for pool in pools]
    for seed, rows in enumerate(([(1, 9), (1, 1), (1, 20)], [(1, 21), (1, 4), (1, 2)])):
        padded, real = graph_batch(rows, 4, slot_buffer, seed)
        count = plan_graph(triton_backend, 4, padded, staged)
        assert triton_backend.slot_mapping.data_ptr() == slot_buffer.data_ptr()
        # run() reads views of the staged device buffer: seq_lens, kv_indptr, then the pages
        # (a fixed-size view, filled as far as the rows need).
        assert triton_backend.seq_lens.data_ptr() == staged[1].data_ptr()
        assert triton_backend.kv_indptr.data_ptr() == staged[1][4:].data_ptr()
        assert triton_backend.kv_indices.data_ptr() == staged[1][9:].data_ptr()
        assert triton_backend.kv_indices.shape == (4 * 6,)
        assert triton_backend.seq_lens.tolist() == real.seq_lens + [1]
        used = [pages[:-(-n // PAGE_SIZE)] for pages, n in zip(real.page_tables, real.seq_lens)]
        used.append([0])  # the padded row: page 0
        indptr = triton_backend.kv_indptr.tolist()
        assert indptr == [0] + [sum(map(len, used[:i + 1])) for i in range(4)]
        assert triton_backend.kv_indices[:indptr[-1]].tolist() == sum(used, [])
        # Staged (and copied): the rows' pages, not the bucket's 4 x 6.
        assert count == 4 + 5 + indptr[-1] < staged[0].numel()
        ours = run_layers(triton_backend, padded, dtype, seed=seed, planned=True)
        assert all(out.shape == (4, NUM_HEADS, HEAD_DIM) for out in ours)
        refs = run_layers(torch_backend, real, dtype, seed=seed, drawn=4)
        assert_same([out[:3] for out in ours], refs, pools, dtype)  # ran the rows it was given
        for pool, page in zip(pools, page0):
            assert torch.equal(pool.buffer[:, :, 0], page), "the padded row stored its K/V"
    # run() writes into the fixed output buffer itself.
    q = torch.randn(4, NUM_HEADS, HEAD_DIM, device=DEVICE)
    k = v = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    assert triton_backend.run(0, q, k, v).data_ptr() == out_ptr


def test_graph_mode_rejects_batches_it_cannot_hold():
    triton_backend, _ = backends(make_pools(torch.float32))
    triton_backend.init_cuda_graph(4, 2)
    slots = torch.zeros(8, dtype=torch.int64, device=DEVICE)

    def plan(bs, meta, staged=None):
        plan_graph(triton_backend, bs, meta, staged or staging(triton_backend, bs, DEVICE))
    with pytest.raises(ValueError):  # a prefill row
        plan(2, AttentionMetadata([2, 1], [2, 1], [[1], [2]], slots[:3]))
    with pytest.raises(ValueError):  # more pages than the table is wide
        plan(1, AttentionMetadata([1], [9], [[1, 2, 3]], slots[:1]))
    with pytest.raises(ValueError):  # more rows than max_bs
        plan(5, AttentionMetadata([1] * 5, [1] * 5, [[0]] * 5, slots[:5]))
    with pytest.raises(ValueError):  # staging sized for another bucket
        plan(1, AttentionMetadata([1], [1], [[0]], slots[:1]), staging(triton_backend, 2, DEVICE))


@needs_cuda
def test_cuda_graph_replays_after_new_plan(monkeypatch):
    """Captured after one plan_cuda_graph(4, ...), replayed after another with other lengths."""
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    dtype, num_heads, num_kv_heads, head_dim = torch.bfloat16, 32, 8, 128
    pools = make_pools(dtype, "cuda", num_kv_heads, head_dim)
    triton_backend, torch_backend = backends(pools, num_heads, head_dim)
    triton_backend.init_cuda_graph(8, 10)
    slot_buffer = torch.zeros(8, dtype=torch.int64, device="cuda")
    q = torch.randn(4, num_heads, head_dim, dtype=dtype, device="cuda")
    k, v = (torch.randn(4, num_kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(2))
    staged = staging(triton_backend, 4, "cuda")
    padded, real = graph_batch([(1, 3), (1, 30)], 4, slot_buffer, seed=0)
    plan_graph(triton_backend, 4, padded, staged)
    triton_backend.run(0, q, k, v)  # compile outside the capture
    torch_backend.plan(real)
    torch_backend.run(0, q[:2], k[:2], v[:2])  # the same stores into the other pool
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_backend.run(0, q, k, v)
    padded, real = graph_batch([(1, 37), (1, 1), (1, 12)], 4, slot_buffer, seed=1)
    plan_graph(triton_backend, 4, padded, staged)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch_backend.plan(real)
    ref = torch_backend.run(0, q[:3], k[:3], v[:3])
    assert (out[:3].float() - ref.float()).abs().max().item() <= TOLERANCE[dtype]
    assert torch.equal(pools[0].buffer[0], pools[1].buffer[0])


@pytest.mark.parametrize("rows", [
    pytest.param([(5, 5), (1, 9), (6, 14), (1, 1)], id="mixed"),
    pytest.param([(1, 9), (1, 1), (1, 23)], id="decode"),
])
def test_fp8_pool_matches_torch_backend(rows):
    """An FP8 pool with per-layer scales: both backends store the same bytes and attend alike.
    New K/V are FP8 numbers times power-of-two scales, so quantising them is exact (the
    interpreter's FP8 downcast does not round to nearest; compiled on a GPU it does)."""
    from pd_serve.engine.attention.triton_backend import TritonAttentionBackend

    dtype = torch.float32 if not ON_GPU else torch.bfloat16
    layout = KVLayout(NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, "float8_e4m3fn",
                      k_scales=(0.5, 2.0), v_scales=(0.25, 1.0))
    pools = [KVPool(layout, NUM_PAGES, DEVICE) for _ in range(2)]
    init = torch.randn(pools[0].buffer.shape, generator=torch.Generator().manual_seed(0))
    for pool in pools:
        pool.buffer.copy_(init.to(pool.buffer.dtype))
    scale = HEAD_DIM ** -0.5
    triton_backend = TritonAttentionBackend(pools[0], NUM_HEADS, HEAD_DIM, scale, dtype)
    torch_backend = TorchAttentionBackend(pools[1], NUM_HEADS, HEAD_DIM, scale, dtype)
    meta = make_batch(rows)
    n = meta.num_tokens
    g = torch.Generator().manual_seed(1)
    triton_backend.plan(meta)
    torch_backend.plan(meta)
    for layer in range(NUM_LAYERS):
        q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=g).to(dtype).to(DEVICE)
        k, v = (torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).mul(4)
                .to(torch.float8_e4m3fn).float() * s
                for s in (layout.k_scale(layer), layout.v_scale(layer)))
        k, v = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
        ours = triton_backend.run(layer, q, k, v)
        ref = torch_backend.run(layer, q, k, v)
        assert ours.dtype == dtype
        err = (ours.float() - ref.float()).abs().max().item()
        assert err <= TOLERANCE[dtype], f"layer {layer}: max abs error {err:.3e}"
    assert torch.equal(pools[0].buffer.view(torch.uint8), pools[1].buffer.view(torch.uint8))
