"""Paged attention kernels against their float32 torch references.

On CPU the kernels run in Triton's interpreter (an autouse fixture sets PD_SERVE_TRITON_CPU=1 for
each CPU test; the kernels are jitted on first use, which is when Triton reads it), on small
shapes; on a CUDA machine the same cases also run compiled, plus bf16 and Llama-3-8B-like
shapes. Every cache slot outside the rows' contexts holds NaN, and each row's page list goes on
past its pages with entries naming a NaN page, so a kernel that reads or keeps anything it
should not fails loudly.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from kernels import paged_attention as pa

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", marks=needs_cuda, id="cuda")
DTYPES_CUDA = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (num_heads, num_kv_heads, head_dim): GQA 2 and 3 on CPU; Llama-3-8B's heads on CUDA.
HEADS_CPU = [(4, 2, 16), (6, 2, 16)]
HEADS_CUDA = [(32, 8, 128), (12, 4, 64)]
# (query_len, seq_len) rows: one-token rows, fresh prefills, chunks after a cached prefix,
# lengths off the page size, rows longer than one query block and one key tile.
PREFILL_ROWS = [(1, 1), (20, 20), (1, 41), (33, 90), (70, 70), (2, 7)]
DECODE_LENS = [1, 17, 64, 130, 5]


@contextlib.contextmanager
def expect_launches(n: int):
    before = pa.triton_launches
    yield
    assert pa.triton_launches - before == n, "the Triton path did not run as expected"


def make_paged_context(seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
                       dtype, device, seed: int):
    """Caches [P, S, Hkv, D] with random K/V at every row's context slots and NaN elsewhere;
    the rows' pages as kv_indptr [B + 1] and kv_indices int32, scattered page ids, each row's
    list going on past its pages with 0-2 entries naming a NaN page (allocated ahead, as the
    scheduler's are). Returns (k_cache, v_cache, (kv_indptr, kv_indices), seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_row) + 3  # spare pages, all NaN
    ids = torch.randperm(num_pages, generator=g).tolist()
    nan_page, ids = ids[0], ids[1:]
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    indptr, indices = [0], []
    for b, (n, num) in enumerate(zip(seq_lens, pages_per_row)):
        row_ids, ids = ids[:num], ids[num:]
        indices += row_ids + [nan_page] * (b % 3)
        indptr.append(len(indices))
        for p in range(n):
            page, offset = row_ids[p // page_size], p % page_size
            k_cache[page, offset] = torch.randn(num_kv_heads, head_dim, generator=g)
            v_cache[page, offset] = torch.randn(num_kv_heads, head_dim, generator=g)
    pages = (torch.tensor(indptr, dtype=torch.int32, device=device),
             torch.tensor(indices, dtype=torch.int32, device=device))
    return (k_cache.to(dtype).to(device), v_cache.to(dtype).to(device), pages,
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


def random_q(num_tokens: int, num_heads: int, head_dim: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype).to(device)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "NaN in the output"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3e} in {dtype}"


def cases(device):
    """(heads, dtype) pairs: on CPU GQA 2 in both dtypes and GQA 3 in fp16; on CUDA all."""
    if device == "cpu":
        return [(HEADS_CPU[0], torch.float32), (HEADS_CPU[0], torch.float16),
                (HEADS_CPU[1], torch.float16)]
    return [(h, dt) for h in HEADS_CUDA for dt in DTYPES_CUDA]


def _params(device_param):
    device = device_param.values[0]
    return [pytest.param(device, heads, dtype, marks=device_param.marks,
                         id=f"{device}-{heads[0]}x{heads[1]}x{heads[2]}-{str(dtype)[6:]}")
            for heads, dtype in cases(device)]


CASES = _params(CPU) + _params(CUDA)


@needs_triton
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("device,heads,dtype", CASES)
def test_decode_matches_reference(device, heads, dtype, page_size):
    num_heads, num_kv_heads, head_dim = heads
    lens = DECODE_LENS if device == "cpu" else DECODE_LENS + [1000, 2047, 333]
    k_cache, v_cache, pages, seq_lens = make_paged_context(lens, page_size, num_kv_heads,
                                                           head_dim, dtype, device, seed=1)
    q = random_q(len(lens), num_heads, head_dim, dtype, device, seed=2)
    scale = head_dim ** -0.5
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, *pages, seq_lens, scale)
    for num_splits in (None, 1, 3):  # the shape rule, one split (one launch), several
        with expect_launches(1):  # the last split to finish merges, in the same launch
            out = pa.paged_decode_attention(q, k_cache, v_cache, *pages, seq_lens, scale,
                                            num_splits=num_splits)
        assert_close(out, ref, dtype)
    assert not pa._counters.get(k_cache.device, torch.zeros(1)).any(), "counters left non-zero"


@needs_triton
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_decode_merges_splits_in_chunks(device, monkeypatch):
    """The merging program loads the partials a few splits at a time (a ragged last chunk
    here), rescaling as it goes; and a second launch finds the counters zeroed again."""
    monkeypatch.setattr(pa, "_MERGE_ELEMENTS", 2 * 4 * 16)  # 2 splits a chunk: group 4, D 16
    lens = [1, 17, 200, 64]
    k_cache, v_cache, pages, seq_lens = make_paged_context(lens, 4, 2, 16, torch.float32,
                                                           device, seed=7)
    q = random_q(len(lens), 8, 16, torch.float32, device, seed=8)
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, *pages, seq_lens, 0.25)
    for _ in range(2):
        out = pa.paged_decode_attention(q, k_cache, v_cache, *pages, seq_lens, 0.25, num_splits=5)
        assert_close(out, ref, torch.float32)
    assert not pa._counters[k_cache.device].any()


@needs_triton
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("device,heads,dtype", CASES)
def test_prefill_matches_reference(device, heads, dtype, page_size):
    num_heads, num_kv_heads, head_dim = heads
    rows = PREFILL_ROWS if device == "cpu" else PREFILL_ROWS + [(512, 2048), (300, 300), (1, 999)]
    q_lens, lens = [n for n, _ in rows], [L for _, L in rows]
    k_cache, v_cache, pages, seq_lens = make_paged_context(lens, page_size, num_kv_heads,
                                                           head_dim, dtype, device, seed=3)
    q = random_q(sum(q_lens), num_heads, head_dim, dtype, device, seed=4)
    indptr = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    ref = pa.paged_prefill_attention_ref(q, k_cache, v_cache, indptr, *pages, seq_lens, scale)
    with expect_launches(2):
        blocks = pa.prefill_blocks(q_lens, lens, num_heads, num_kv_heads)
        out = pa.paged_prefill_attention(q, k_cache, v_cache, indptr, *pages, seq_lens, scale,
                                         q_blocks=torch.tensor(blocks, dtype=torch.int32,
                                                               device=device).view(-1, 2))
        again = pa.paged_prefill_attention(q, k_cache, v_cache, indptr, *pages, seq_lens, scale)
    assert_close(out, ref, dtype)
    assert torch.equal(again, out)


WINDOW_CASES = [pytest.param("cpu", torch.float32, id="cpu-float32"),
                pytest.param("cuda", torch.bfloat16, marks=needs_cuda, id="cuda-bfloat16")]


def test_window_reference_keeps_the_last_window_keys():
    """The reference's window, checked apart from the kernels: window 1 attends the query's own
    key (out = its V), a window as long as the context is full attention."""
    lens = [1, 17, 64, 130, 5]
    k_cache, v_cache, pages, seq_lens = make_paged_context(lens, 4, 2, 16, torch.float32, "cpu",
                                                           seed=11)
    q = random_q(len(lens), 4, 16, torch.float32, "cpu", seed=12)
    full = pa.paged_decode_attention_ref(q, k_cache, v_cache, *pages, seq_lens, 0.25)
    assert torch.equal(pa.paged_decode_attention_ref(q, k_cache, v_cache, *pages, seq_lens, 0.25,
                                                     window=130), full)
    own = pa.paged_decode_attention_ref(q, k_cache, v_cache, *pages, seq_lens, 0.25, window=1)
    indptr, indices = pages
    for b, n in enumerate(lens):  # the last key's V, heads 2h and 2h + 1 reading KV head h
        page = indices[indptr[b] + (n - 1) // 4]
        expected = v_cache[page, (n - 1) % 4].repeat_interleave(2, dim=0)
        torch.testing.assert_close(own[b], expected)


@needs_triton
@pytest.mark.parametrize("window", [1, 7, 16, 50])
@pytest.mark.parametrize("device,dtype", WINDOW_CASES)
def test_decode_window_matches_reference(device, dtype, window):
    """Sliding window in decode: the kernel skips tiles wholly before the window and masks the
    rest; with splits, each split takes whole tiles from the window's first on."""
    lens = DECODE_LENS + ([1000, 333] if device == "cuda" else [])
    num_heads, num_kv_heads, head_dim = HEADS_CPU[0] if device == "cpu" else HEADS_CUDA[0]
    k_cache, v_cache, pages, seq_lens = make_paged_context(lens, 4, num_kv_heads, head_dim,
                                                           dtype, device, seed=13)
    q = random_q(len(lens), num_heads, head_dim, dtype, device, seed=14)
    scale = head_dim ** -0.5
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, *pages, seq_lens, scale,
                                        window=window)
    for num_splits in (None, 1, 3):
        out = pa.paged_decode_attention(q, k_cache, v_cache, *pages, seq_lens, scale,
                                        num_splits=num_splits, window=window)
        assert_close(out, ref, dtype)
    assert not pa._counters.get(k_cache.device, torch.zeros(1)).any(), "counters left non-zero"


@needs_triton
@pytest.mark.parametrize("window", [1, 7, 33])
@pytest.mark.parametrize("device,dtype", WINDOW_CASES)
def test_prefill_window_matches_reference(device, dtype, window):
    """Sliding window in prefill: chunks after a cached prefix longer than the window, rows
    longer than a query block, decode rows beside them."""
    rows = PREFILL_ROWS + ([(512, 2048), (1, 999)] if device == "cuda" else [])
    num_heads, num_kv_heads, head_dim = HEADS_CPU[0] if device == "cpu" else HEADS_CUDA[0]
    q_lens, lens = [n for n, _ in rows], [L for _, L in rows]
    k_cache, v_cache, pages, seq_lens = make_paged_context(lens, 4, num_kv_heads, head_dim,
                                                           dtype, device, seed=15)
    q = random_q(sum(q_lens), num_heads, head_dim, dtype, device, seed=16)
    indptr = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    ref = pa.paged_prefill_attention_ref(q, k_cache, v_cache, indptr, *pages, seq_lens, scale,
                                         window=window)
    with expect_launches(1):
        out = pa.paged_prefill_attention(q, k_cache, v_cache, indptr, *pages, seq_lens, scale,
                                         window=window)
    assert_close(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_views_in_and_out(device):
    """q a strided view (as from a fused qkv output), out a view into a larger buffer."""
    num_heads, num_kv_heads, head_dim = (4, 2, 16) if device == "cpu" else (32, 8, 128)
    lens = [9, 40, 3]
    k_cache, v_cache, pages, seq_lens = make_paged_context(lens, 4, num_kv_heads, head_dim,
                                                           torch.float32, device, seed=5)
    fused = random_q(3, 2 * num_heads, head_dim, torch.float32, device, seed=6)
    q = fused[:, :num_heads]  # token stride 2 * Hq * D
    buffer = torch.full((3, 2 * num_heads, head_dim), float("nan"), device=device)
    out = buffer[:, num_heads:]
    ref = pa.paged_decode_attention_ref(q.contiguous(), k_cache, v_cache, *pages, seq_lens, 0.3)
    with expect_launches(1):  # 2 splits, merged by the last of them
        returned = pa.paged_decode_attention(q, k_cache, v_cache, *pages, seq_lens, 0.3, out=out,
                                             num_splits=2)
    assert returned is out
    assert_close(out, ref, torch.float32)
    assert buffer[:, :num_heads].isnan().all(), "wrote outside out"
    indptr = torch.arange(4, dtype=torch.int32, device=device)
    out.fill_(float("nan"))
    pa.paged_prefill_attention(q, k_cache, v_cache, indptr, *pages, seq_lens, 0.3, out=out)
    assert_close(out, ref, torch.float32)


@needs_triton
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_fp8_caches_with_scales(device, kv_dtype):
    """FP8 caches holding K / k_scale and V / v_scale (NaN outside the contexts, as above):
    the kernels equal the reference, which is attention over K and V dequantised to float32.
    (The interpreter's FP8 -> float upcast is exact, so this runs on CPU too.)"""
    num_heads, num_kv_heads, head_dim = (4, 2, 16) if device == "cpu" else (32, 8, 128)
    q_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    k_scale, v_scale = 0.37, 2.5
    rows = [(1, 1), (20, 20), (33, 90), (2, 7)]
    q_lens, lens = [n for n, _ in rows], [L for _, L in rows]
    k, v, pages, seq_lens = make_paged_context(lens, 4, num_kv_heads, head_dim, torch.float32,
                                               device, seed=30)
    k_cache, v_cache = (k / k_scale).to(kv_dtype), (v / v_scale).to(kv_dtype)
    k_deq, v_deq = k_cache.float() * k_scale, v_cache.float() * v_scale
    scale = head_dim ** -0.5
    q = random_q(sum(q_lens), num_heads, head_dim, q_dtype, device, seed=31)
    indptr = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    ref = pa.paged_prefill_attention_ref(q, k_cache, v_cache, indptr, *pages, seq_lens, scale,
                                         k_scale, v_scale)
    deq = pa.paged_prefill_attention_ref(q, k_deq, v_deq, indptr, *pages, seq_lens, scale)
    assert torch.equal(ref, deq)  # the same float32 products
    with expect_launches(1):
        out = pa.paged_prefill_attention(q, k_cache, v_cache, indptr, *pages, seq_lens, scale,
                                         k_scale=k_scale, v_scale=v_scale)
    assert_close(out, ref, q_dtype)
    q = q[:len(lens)]  # decode: one query per row
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, *pages, seq_lens, scale, k_scale,
                                        v_scale)
    for num_splits in (1, 3):
        out = pa.paged_decode_attention(q, k_cache, v_cache, *pages, seq_lens, scale,
                                        num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
        assert_close(out, ref, q_dtype)


@needs_triton
def test_one_split_is_one_launch():
    k_cache, v_cache, pages, seq_lens = make_paged_context([5, 6], 4, 2, 16, torch.float32,
                                                           "cpu", seed=7)
    q = random_q(2, 4, 16, torch.float32, "cpu", seed=8)
    with expect_launches(1):
        pa.paged_decode_attention(q, k_cache, v_cache, *pages, seq_lens, 0.25, num_splits=1)


def test_split_rule_reads_shapes_only():
    """One wave of 4 programs per SM (the CPU counts an H200's 132), rounded down."""
    cpu = torch.device("cpu")
    assert pa.decode_num_splits(1, 8, 8192, cpu) == 64  # capped
    assert pa.decode_num_splits(4, 8, 8192, cpu) == 16  # 512 programs of 528
    assert pa.decode_num_splits(33, 8, 8192, cpu) == 2
    assert pa.decode_num_splits(34, 8, 8192, cpu) == 1  # not 2 waves, the second a sliver
    assert pa.decode_num_splits(256, 8, 8192, cpu) == 1  # the batch fills the GPU
    assert pa.decode_num_splits(1, 8, 100, cpu) == 2  # two key tiles: a split each
    assert pa.decode_num_splits(1, 8, 512, cpu) == 8  # at least one tile each


def test_without_interpreter_cpu_uses_the_reference(monkeypatch):
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    k_cache, v_cache, pages, seq_lens = make_paged_context([3, 12], 4, 2, 16, torch.float32,
                                                           "cpu", seed=9)
    q = random_q(2, 4, 16, torch.float32, "cpu", seed=10)
    with expect_launches(0):
        out = pa.paged_decode_attention(q, k_cache, v_cache, *pages, seq_lens, 0.25)
    assert torch.equal(out, pa.paged_decode_attention_ref(q, k_cache, v_cache, *pages, seq_lens,
                                                          0.25))


def _bad_calls():
    k_cache = torch.zeros(4, 4, 2, 16)
    kv_indptr = torch.tensor([0, 1, 3], dtype=torch.int32)
    kv_indices = torch.tensor([2, 0, 1], dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    q = torch.zeros(2, 4, 16)
    call = pa.paged_decode_attention
    yield "Hq not a multiple of Hkv", lambda: call(torch.zeros(2, 3, 16), k_cache, k_cache,
                                                   kv_indptr, kv_indices, lens, 1.0)
    yield "head dim differs", lambda: call(torch.zeros(2, 4, 8), k_cache, k_cache, kv_indptr,
                                           kv_indices, lens, 1.0)
    yield "caches differ", lambda: call(q, k_cache, k_cache.half(), kv_indptr, kv_indices, lens,
                                        1.0)
    yield "float page ids", lambda: call(q, k_cache, k_cache, kv_indptr, kv_indices.float(), lens,
                                         1.0)
    yield "page ids not 1-D", lambda: call(q, k_cache, k_cache, kv_indptr, kv_indices[None],
                                           lens, 1.0)
    yield "kv_indptr of B rows", lambda: call(q, k_cache, k_cache, kv_indptr[:2], kv_indices,
                                              lens, 1.0)
    yield "q last dim strided", lambda: call(torch.zeros(2, 4, 32)[..., ::2], k_cache, k_cache,
                                             kv_indptr, kv_indices, lens, 1.0)
    yield "out of wrong shape", lambda: call(q, k_cache, k_cache, kv_indptr, kv_indices, lens,
                                             1.0, out=torch.zeros(2, 4, 8))
    yield "indptr of wrong length", lambda: pa.paged_prefill_attention(
        q, k_cache, k_cache, torch.tensor([0, 2], dtype=torch.int32), kv_indptr, kv_indices,
        lens, 1.0)


@pytest.mark.parametrize("call", [pytest.param(c, id=name) for name, c in _bad_calls()])
def test_rejects_bad_inputs(call):
    with expect_launches(0), pytest.raises(ValueError):
        call()


@needs_triton
@pytest.mark.parametrize("device", [CUDA])
def test_decode_graph_replays_with_new_lengths_and_pages(device):
    """Captured once, the launch replays for other seq_lens and page lists (fixed-size buffers
    of page ids, filled as far as each batch needs)."""
    num_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16
    contexts = [make_paged_context(lens, page_size, num_kv_heads, head_dim, torch.bfloat16,
                                   "cuda", seed=11 + i)
                for i, lens in enumerate(([100, 7, 1500, 64], [1800, 1, 33, 700]))]
    num_pages = max(c[0].shape[0] for c in contexts)
    capacity = max(c[2][1].shape[0] for c in contexts) + 5
    k_cache = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=torch.bfloat16,
                          device="cuda")
    v_cache = torch.zeros_like(k_cache)
    kv_indptr = torch.zeros(5, dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(capacity, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(4, dtype=torch.int32, device="cuda")
    q = torch.zeros(4, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)

    def load(i: int) -> None:  # refill the fixed inputs in place, as a graph runner does
        k, v, (indptr, indices), lens = contexts[i]
        k_cache[:k.shape[0]].copy_(k)
        v_cache[:v.shape[0]].copy_(v)
        kv_indptr.copy_(indptr)
        kv_indices[:indices.shape[0]].copy_(indices)
        seq_lens.copy_(lens)
        q.copy_(random_q(4, num_heads, head_dim, torch.bfloat16, "cuda", seed=20 + i))

    def run() -> None:
        pa.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, seq_lens,
                                  head_dim ** -0.5, out=out)

    load(0)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for i in (1, 0):
        load(i)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, kv_indptr, kv_indices,
                                            seq_lens, head_dim ** -0.5)
        assert_close(out, ref, torch.bfloat16)


def test_prefill_programs_are_the_blocks_that_hold_queries():
    """One program per query block of each row (per KV head), not one per block of the longest
    row for every row: decode rows in a mixed batch cost one each. Most keys first."""
    # Hq 32 / Hkv 8: 4 heads a group, 16 query tokens a block.
    blocks = pa.prefill_blocks([1, 40, 1], [700, 40, 17], 32, 8)
    pairs = list(zip(blocks[::2], blocks[1::2]))
    assert sorted(pairs) == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0)]
    # the keys each reads: 700; 40, 32, 16 (row 1's blocks); 17
    assert pairs == [(0, 0), (1, 2), (1, 1), (2, 0), (1, 0)]
    assert pa.prefill_blocks([], [], 32, 8) == []
