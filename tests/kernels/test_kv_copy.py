"""KV page gather/scatter: the Triton kernel against the torch reference, bit for bit.

On CPU the kernel runs in Triton's interpreter: an autouse fixture sets PD_SERVE_TRITON_CPU=1 for
each CPU test (kernels/kv_copy.py imports Triton lazily and jits the kernel on first use, which
is when Triton reads the variable), so the setting never leaks into other test modules. On a
CUDA machine the same tests also run compiled on the GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from kernels import kv_copy

L, P, H, D = 3, 10, 2, 8  # layers, pages, kv heads, head dim
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
POISON = {1: 0xA5, 2: 0x7E5A, 4: 0x7FC0DEAD}  # a NaN pattern for fp16 / fp32

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
LAYERS = [pytest.param((0, L), id="all-layers"), pytest.param((1, 2), id="middle-layer")]
PAGE_SIZES = [1, 16]
PAGE_IDS = {
    "single": [3],
    "contiguous": [2, 3, 4, 5],
    "scattered": [0, 3, 7, 9],
    "reversed": [9, 6, 5, 1, 0],
    "random": torch.randperm(P, generator=torch.Generator().manual_seed(0))[:6].tolist(),
}


@contextlib.contextmanager
def expect_launches(n: int):
    """Fails unless the block launched the Triton kernel exactly n times."""
    before = kv_copy.triton_launches
    yield
    assert kv_copy.triton_launches - before == n, "the Triton path did not run"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.element_size()])


def random_bits(shape, dtype, device, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities and subnormals included) viewed as `dtype`."""
    int_dtype = INT_VIEW[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(int_dtype)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(info.min, info.max + 1, shape, dtype=int_dtype, generator=g)
    return raw.view(dtype).to(device)


def poisoned_pool(num_pages: int, page_size: int, dtype, device) -> torch.Tensor:
    pool = torch.empty(L, 2, num_pages, page_size, H, D, dtype=dtype, device=device)
    bits(pool).fill_(POISON[pool.element_size()])
    return pool  # [L, 2, P, S, H, D]


def assert_only_pages_written(pool: torch.Tensor, page_ids: list[int], layers: tuple[int, int],
                              expected: torch.Tensor) -> None:
    """`pool[a:b, :, page_ids]` equals `expected` bit for bit; every other page is still poison."""
    a, b = layers
    assert torch.equal(bits(pool)[a:b, :, page_ids], bits(expected))
    untouched = torch.ones(L, pool.shape[2], dtype=torch.bool)
    untouched[a:b, page_ids] = False
    rest = bits(pool).permute(0, 2, 1, 3, 4, 5)[untouched.to(pool.device)]
    assert bool((rest == POISON[pool.element_size()]).all()), "a page outside the request changed"


@needs_triton
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("ids_case", list(PAGE_IDS))
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_gather_matches_reference(device, dtype, layers, ids_case, page_size):
    pool = random_bits((L, 2, P, page_size, H, D), dtype, device, seed=1)
    page_ids = torch.tensor(PAGE_IDS[ids_case], device=device)
    expected = kv_copy.gather_pages_ref(bits(pool), page_ids, *layers)
    with expect_launches(2):
        staging = kv_copy.gather_pages(pool, page_ids, *layers)
        out = poisoned_pool(len(page_ids), page_size, dtype, device)[: layers[1] - layers[0]]
        returned = kv_copy.gather_pages(pool, page_ids, *layers, out=out)
    assert staging.dtype == dtype and staging.is_contiguous()
    assert torch.equal(bits(staging), expected)
    assert returned is out and torch.equal(bits(out), expected)


@needs_triton
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("ids_case", list(PAGE_IDS))
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_scatter_writes_only_requested_pages(device, dtype, layers, ids_case, page_size):
    pool = poisoned_pool(P, page_size, dtype, device)
    ids = PAGE_IDS[ids_case]
    a, b = layers
    staging = random_bits((b - a, 2, len(ids), page_size, H, D), dtype, device, seed=2)
    expected_pool = pool.clone()
    kv_copy.scatter_pages_ref(bits(expected_pool), torch.tensor(ids, device=device),
                              bits(staging), a, b)
    with expect_launches(1):
        kv_copy.scatter_pages(pool, torch.tensor(ids, device=device), staging, a, b)
    assert torch.equal(bits(pool), bits(expected_pool))
    assert_only_pages_written(pool, ids, layers, staging)


@needs_triton
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_moves_pages_between_pools(device, dtype, layers, ids_dtype, page_size):
    src = random_bits((L, 2, P, page_size, H, D), dtype, device, seed=3)
    dst = poisoned_pool(7, page_size, dtype, device)  # a smaller pool, other page ids
    src_ids, dst_ids = PAGE_IDS["random"], [6, 0, 4, 1, 5, 2]
    a, b = layers
    src_ids_t = torch.tensor(src_ids, dtype=ids_dtype, device=device)
    dst_ids_t = torch.tensor(dst_ids, dtype=ids_dtype, device=device)
    with expect_launches(2):
        staging = kv_copy.gather_pages(src, src_ids_t, a, b)
        kv_copy.scatter_pages(dst, dst_ids_t, staging, a, b)
    assert_only_pages_written(dst, dst_ids, layers, bits(src)[a:b, :, src_ids])


@needs_triton
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_copy_moves_pages_between_pools_in_one_launch(device, dtype, layers, ids_dtype, page_size):
    src = random_bits((L, 2, P, page_size, H, D), dtype, device, seed=6)
    dst = poisoned_pool(7, page_size, dtype, device)  # a smaller pool, other page ids
    src_ids, dst_ids = PAGE_IDS["random"], [6, 0, 4, 1, 5, 2]
    a, b = layers
    expected = dst.clone()
    kv_copy.copy_pages_ref(src, torch.tensor(src_ids, device=device), expected,
                           torch.tensor(dst_ids, device=device), a, b)
    with expect_launches(1):
        kv_copy.copy_pages(src, torch.tensor(src_ids, dtype=ids_dtype, device=device), dst,
                           torch.tensor(dst_ids, dtype=ids_dtype, device=device), a, b)
    assert torch.equal(bits(dst), bits(expected))
    assert_only_pages_written(dst, dst_ids, layers, bits(src)[a:b, :, src_ids])


@needs_triton
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_head_ranges_move_only_those_heads(device, dtype, page_size):
    """A tensor-parallel hand-off moves part of a rank's KV heads: gather heads [1, 3) of a
    4-head pool, scatter them into heads [2, 4) of another, and copy pool to pool between pools
    of 4 and 2 heads, each one launch; every other head and page keeps its poison."""
    a, b = 1, L
    src = random_bits((L, 2, P, page_size, 4, D), dtype, device, seed=8)
    ids, dst_ids = PAGE_IDS["random"], [6, 0, 4, 1, 5, 2]
    ids_t, dst_t = torch.tensor(ids, device=device), torch.tensor(dst_ids, device=device)
    want = bits(src)[a:b, :, ids, :, 1:3]
    with expect_launches(1):
        staging = kv_copy.gather_pages(src, ids_t, a, b, heads=(1, 3))
    assert staging.shape == (b - a, 2, len(ids), page_size, 2, D) and staging.is_contiguous()
    assert torch.equal(bits(staging), want)
    assert torch.equal(bits(staging), bits(kv_copy.gather_pages_ref(src, ids_t, a, b, (1, 3))))

    def only_heads_written(pool, heads, expected):
        h0, h1 = heads
        assert torch.equal(bits(pool)[a:b, :, dst_ids, :, h0:h1], expected)
        rest = bits(pool).clone()
        rest[a:b, :, dst_ids, :, h0:h1] = POISON[pool.element_size()]
        assert bool((rest == POISON[pool.element_size()]).all()), "a head outside the range changed"

    dst = poisoned_pool(7, page_size, dtype, device).repeat(1, 1, 1, 1, 2, 1)  # 4 heads
    with expect_launches(1):
        kv_copy.scatter_pages(dst, dst_t, staging, a, b, heads=(2, 4))
    only_heads_written(dst, (2, 4), want)
    narrow = poisoned_pool(7, page_size, dtype, device)  # 2 heads: exactly the range's
    wide = poisoned_pool(7, page_size, dtype, device).repeat(1, 1, 1, 1, 2, 1)
    src_on_dst = torch.tensor(ids, dtype=torch.int32, device=device)
    with expect_launches(2):
        kv_copy.copy_pages(src, src_on_dst, narrow, dst_t, a, b, src_heads=(1, 3))
        kv_copy.copy_pages(narrow, dst_t, wide, dst_t, a, b, dst_heads=(1, 3))
    only_heads_written(narrow, (0, 2), want)
    only_heads_written(wide, (1, 3), want)
    expected = poisoned_pool(7, page_size, dtype, device).repeat(1, 1, 1, 1, 2, 1)
    kv_copy.copy_pages_ref(narrow, dst_t, expected, dst_t, a, b, None, (1, 3))
    assert torch.equal(bits(wide), bits(expected))


@needs_triton
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("device", ["cuda"])  # what tests/kernels/conftest.py runs on a GPU
def test_copy_reads_a_pool_on_a_peer_gpu(monkeypatch, device):
    """The kernel runs on the destination's GPU and reads the source pages over the link."""
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    for a, b in (("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")):  # a copy enables peer access
        torch.ones(1, device=a).to(b)
    src = random_bits((L, 2, P, 16, H, D), torch.bfloat16, "cuda:0", seed=7)
    dst = poisoned_pool(7, 16, torch.bfloat16, "cuda:1")
    src_ids, dst_ids = PAGE_IDS["random"], [6, 0, 4, 1, 5, 2]
    with expect_launches(1):
        kv_copy.copy_pages(src, torch.tensor(src_ids, device="cuda:1"), dst,
                           torch.tensor(dst_ids, device="cuda:1"), 0, L)
    assert_only_pages_written(dst, dst_ids, (0, L), bits(src)[:, :, src_ids].to("cuda:1"))


@needs_triton
@pytest.mark.parametrize("heads", [None, (1, 3)], ids=["all-heads", "heads-1-3"])
@pytest.mark.parametrize("device", DEVICES)
def test_counted_copy_reads_its_page_count_from_memory(device, heads):
    """The counted form a CUDA graph replays: count, source ids and destination ids in one
    tensor with room to spare (junk after them), and fewer programs than rows, so each program
    strides over several; n = 0 moves nothing."""
    a, b = 1, L
    src = random_bits((L, 2, P, 16, 4, D), torch.bfloat16, device, seed=9)
    dst = poisoned_pool(7, 16, torch.bfloat16, device).repeat(1, 1, 1, 1, 1 if heads else 2, 1)
    src_ids, dst_ids = PAGE_IDS["random"], [6, 0, 4, 1, 5, 2]
    ids = torch.tensor([len(src_ids), *src_ids, *dst_ids, 99, 99, 99], dtype=torch.int32,
                       device=device)
    expected = dst.clone()
    kv_copy.copy_pages_ref(src, torch.tensor(src_ids, device=device), expected,
                           torch.tensor(dst_ids, device=device), a, b, heads, None)
    with expect_launches(1):
        kv_copy.copy_pages_counted(src, dst, ids, a, b, src_heads=heads, programs=5)
    assert torch.equal(bits(dst), bits(expected))
    untouched = dst.clone()
    with expect_launches(1):
        kv_copy.copy_pages_counted(src, dst, torch.zeros(3, dtype=torch.int32, device=device), a,
                                   b, src_heads=heads, programs=5)
    assert torch.equal(bits(dst), bits(untouched))


@needs_triton
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_copy_graph_replays_for_any_page_count(monkeypatch, device):
    """CopyGraph: captured once, replayed for copies of different page counts (ids from
    page-locked memory), each landing exactly as the reference's."""
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    src = random_bits((L, 2, P, 16, H, D), torch.bfloat16, "cuda", seed=10)
    dst = poisoned_pool(7, 16, torch.bfloat16, "cuda")
    graph = kv_copy.CopyGraph(src, dst, 0, L)
    expected = dst.clone()
    for src_ids, dst_ids in (([3], [5]), (PAGE_IDS["random"], [6, 0, 4, 1, 5, 2]), ([9, 1], [2, 3])):
        host = torch.tensor([len(src_ids), *src_ids, *dst_ids], dtype=torch.int32, pin_memory=True)
        with expect_launches(0):
            graph(host)
        kv_copy.copy_pages_ref(src, torch.tensor(src_ids, device="cuda"), expected,
                               torch.tensor(dst_ids, device="cuda"), 0, L)
        torch.cuda.synchronize()
        assert torch.equal(bits(dst), bits(expected))
    with pytest.raises(ValueError, match="7"):
        graph(torch.zeros(1 + 2 * 8, dtype=torch.int32, pin_memory=True))


@needs_triton
def test_no_pages_launches_nothing():
    pool = random_bits((L, 2, P, 4, H, D), torch.float16, "cpu", seed=4)
    before = pool.clone()
    ids = torch.empty(0, dtype=torch.int64)
    with expect_launches(0):
        staging = kv_copy.gather_pages(pool, ids, 0, L)
        kv_copy.scatter_pages(pool, ids, staging, 0, L)
    assert staging.shape == (L, 2, 0, 4, H, D)
    assert torch.equal(bits(pool), bits(before))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_interpreter_cpu_uses_the_reference(monkeypatch, dtype):
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    pool = random_bits((L, 2, P, 4, H, D), dtype, "cpu", seed=5)
    ids = torch.tensor([8, 1, 4])
    with expect_launches(0):
        staging = kv_copy.gather_pages(pool, ids, 1, L)
        target = torch.zeros_like(pool)
        kv_copy.scatter_pages(target, ids, staging, 1, L)
    assert torch.equal(bits(staging), bits(kv_copy.gather_pages_ref(pool, ids, 1, L)))
    assert torch.equal(bits(target[1:, :, [8, 1, 4]]), bits(pool[1:, :, [8, 1, 4]]))


def _bad_calls():
    pool = torch.zeros(L, 2, P, 4, H, D)
    ids = torch.tensor([1, 2])
    staging = torch.zeros(L, 2, 2, 4, H, D)
    yield "layer_end past L", lambda: kv_copy.gather_pages(pool, ids, 0, L + 1)
    yield "empty layer range", lambda: kv_copy.gather_pages(pool, ids, 2, 2)
    yield "negative layer_start", lambda: kv_copy.gather_pages(pool, ids, -1, 2)
    yield "page id too large", lambda: kv_copy.gather_pages(pool, torch.tensor([0, P]), 0, L)
    yield "negative page id", lambda: kv_copy.gather_pages_ref(pool, torch.tensor([-1]), 0, L)
    yield "2-D page ids", lambda: kv_copy.gather_pages(pool, ids[None], 0, L)
    yield "float page ids", lambda: kv_copy.gather_pages(pool, ids.float(), 0, L)
    yield "pool not 6-D", lambda: kv_copy.gather_pages(pool[0], ids, 0, 1)
    yield "pool not contiguous", lambda: kv_copy.gather_pages(pool.transpose(3, 4), ids, 0, L)
    yield "out of wrong shape", lambda: kv_copy.gather_pages(pool, ids, 0, L, out=staging[:2])
    yield "staging of wrong shape", lambda: kv_copy.scatter_pages(pool, ids, staging[:, :, :1],
                                                                  0, L)
    yield "staging of wrong layers", lambda: kv_copy.scatter_pages(pool, ids, staging, 1, L)
    yield "staging of wrong dtype", lambda: kv_copy.scatter_pages(pool, ids, staging.half(), 0, L)
    yield "repeated scatter ids", lambda: kv_copy.scatter_pages(pool, torch.tensor([1, 1]),
                                                                staging, 0, L)
    yield "copy: id counts differ", lambda: kv_copy.copy_pages(pool, ids, pool.clone(), ids[:1], 0, L)
    yield "copy: dtypes differ", lambda: kv_copy.copy_pages(pool, ids, pool.half(), ids, 0, L)
    other_pages = pool[:, :, :, :2].contiguous()
    yield "copy: page shapes differ", lambda: kv_copy.copy_pages(pool, ids, other_pages, ids, 0, L)
    yield "copy: repeated dst ids", lambda: kv_copy.copy_pages(pool, ids, pool.clone(),
                                                               torch.tensor([3, 3]), 0, L)
    yield "copy: src id too large", lambda: kv_copy.copy_pages(pool, torch.tensor([0, P]),
                                                               pool.clone(), ids, 0, L)
    yield "head range past H", lambda: kv_copy.gather_pages(pool, ids, 0, L, heads=(1, H + 1))
    yield "empty head range", lambda: kv_copy.gather_pages(pool, ids, 0, L, heads=(1, 1))
    yield "staging of other heads", lambda: kv_copy.scatter_pages(pool, ids, staging, 0, L,
                                                                  heads=(0, 1))
    yield "counted: int64 ids", lambda: kv_copy.copy_pages_counted(pool, pool.clone(), ids, 0, L)
    yield "counted: no ids", lambda: kv_copy.copy_pages_counted(
        pool, pool.clone(), torch.empty(0, dtype=torch.int32), 0, L)
    yield "copy: head counts differ", lambda: kv_copy.copy_pages(pool, ids, pool.clone(), ids, 0, L,
                                                                 src_heads=(0, 1))


@pytest.mark.parametrize("call", [pytest.param(c, id=name) for name, c in _bad_calls()])
def test_rejects_bad_inputs(call):
    with expect_launches(0), pytest.raises(ValueError):
        call()


@needs_triton
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_pool_past_int32_offsets(monkeypatch, device):
    """Pages whose elements lie beyond 2**31 in a >2 GiB fp8 pool (viewed as uint8)."""
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    num_pages = 33_000  # 2 * 2 * 33000 * 16 * 8 * 128 bytes > 2**31
    pool = torch.empty(2, 2, num_pages, 16, 8, 128, dtype=torch.uint8, device="cuda")
    pool.random_(0, 256)
    ids = torch.tensor([num_pages - 1, 0, num_pages - 2], device="cuda")
    with expect_launches(2):
        fp8_pool = pool.view(torch.float8_e4m3fn)
        staging = kv_copy.gather_pages(fp8_pool, ids, 0, 2)
        assert torch.equal(staging.view(torch.uint8), kv_copy.gather_pages_ref(pool, ids, 0, 2))
        new = torch.randint_like(staging.view(torch.uint8), 0, 256)
        kv_copy.scatter_pages(fp8_pool, ids, new.view(torch.float8_e4m3fn), 0, 2)
    assert torch.equal(pool[:, :, ids.tolist()], new)


@needs_triton
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("device", DEVICES)
def test_latent_pools_of_one_plane_move_bit_exact(device, layers):
    """A latent (MLA) pool, [L, 1, P, S, 1, D]: gather, scatter and copy as for K/V pools."""
    src = random_bits((L, 1, P, 4, 1, 40), torch.bfloat16, device, seed=8)
    dst = torch.zeros(L, 1, 7, 4, 1, 40, dtype=torch.bfloat16, device=device)
    src_ids, dst_ids = PAGE_IDS["random"], [6, 0, 4, 1, 5, 2]
    a, b = layers
    src_ids_t, dst_ids_t = (torch.tensor(i, device=device) for i in (src_ids, dst_ids))
    with expect_launches(3):
        staging = kv_copy.gather_pages(src, src_ids_t, a, b)  # [b - a, 1, n, S, 1, D]
        kv_copy.scatter_pages(dst, dst_ids_t, staging, a, b)
        copied = torch.zeros_like(dst)
        kv_copy.copy_pages(src, src_ids_t, copied, dst_ids_t, a, b)
    assert staging.shape == (b - a, 1, len(src_ids), 4, 1, 40)
    for pool in (dst, copied):
        assert torch.equal(bits(pool)[a:b, :, dst_ids], bits(src)[a:b, :, src_ids])
        assert torch.equal(bits(pool)[:a], bits(torch.zeros_like(pool))[:a])
