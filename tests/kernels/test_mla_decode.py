"""MLA decode kernels (kernels/mla_decode.py) against their float32 torch reference.

On CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py), on small shapes
(R 32, Dr 8) in float32 and float16; on a CUDA machine the same cases run compiled in bf16 too,
plus DeepSeek's shape and a graph replay. Every cache slot outside the rows' contexts holds NaN,
and each row's page list goes on past its pages with entries naming a NaN page, so a kernel
that reads anything it should not fails loudly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import mla_decode as mla

ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", marks=needs_cuda, id="cuda")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
RANK, ROPE = 32, 8
# lengths of one token, off the page size, a whole tile (32 keys), several tiles
LENS = [1, 17, 64, 130, 5]


@contextlib.contextmanager
def expect_launches(n: int):
    before = mla.triton_launches
    yield
    assert mla.triton_launches - before == n, "the Triton path did not run as expected"


def make_latent_cache(seq_lens: list[int], page_size: int, entry: int, dtype, device, seed: int):
    """A cache [P, S, 1, entry] (a view whose slots are `entry + 3` apart) with random entries
    at the rows' context slots and NaN elsewhere; the rows' pages as kv_indptr [B + 1] and
    kv_indices int32, shuffled page ids, each list going on past the row's pages with 0-2
    entries naming a NaN page. Returns (cache, (kv_indptr, kv_indices), seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_row) + 3  # spare pages, all NaN
    ids = torch.randperm(num_pages, generator=g).tolist()
    nan_page, ids = ids[0], ids[1:]
    values = torch.full((num_pages, page_size, 1, entry), float("nan"))
    indptr, indices = [0], []
    for b, (n, num) in enumerate(zip(seq_lens, pages_per_row, strict=True)):
        row_ids, ids = ids[:num], ids[num:]
        indices += row_ids + [nan_page] * (b % 3)
        indptr.append(len(indices))
        for p in range(n):
            values[row_ids[p // page_size], p % page_size, 0] = torch.randn(entry, generator=g)
    pages = (torch.tensor(indptr, dtype=torch.int32, device=device),
             torch.tensor(indices, dtype=torch.int32, device=device))
    cache = torch.full((num_pages, page_size, 1, entry + 3), float("nan"), dtype=dtype,
                       device=device)[..., :entry]
    cache.copy_(values)
    return cache, pages, torch.tensor(seq_lens, dtype=torch.int32, device=device)


def random_q(num_rows: int, num_heads: int, entry: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, num_heads, entry, generator=g).to(dtype).to(device)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "NaN in the output"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3e} in {dtype}"


def test_reference_of_one_token_is_its_latent():
    """A context of one token: softmax weight 1, the output is that token's latent."""
    cache, (indptr, indices), seq_lens = make_latent_cache([1, 1], 4, RANK + ROPE,
                                                           torch.float32, "cpu", seed=1)
    q = random_q(2, 3, RANK + ROPE, torch.float32, "cpu", seed=2)
    out = mla.mla_decode_attention_ref(q, cache, indptr, indices, seq_lens, 0.5, RANK)
    for b in range(2):
        latent = cache[indices[indptr[b]], 0, 0, :RANK]
        torch.testing.assert_close(out[b], latent.expand(3, RANK))


# (heads, dtype, page size); no bf16 on CPU: the interpreter's tl.dot of bf16 tiles is wrong
CPU_CASES = [(4, torch.float32, 4), (4, torch.float16, 16), (3, torch.float16, 4),
             (20, torch.float32, 16)]
CUDA_CASES = [(h, dt, s) for h in (4, 20) for dt in TOLERANCE for s in (4, 16)]


def _params(device_param, cases):
    device = device_param.values[0]
    return [pytest.param(device, h, dt, s, marks=device_param.marks,
                         id=f"{device}-h{h}-{str(dt)[6:]}-page{s}") for h, dt, s in cases]


@needs_triton
@pytest.mark.parametrize("device,num_heads,dtype,page_size",
                         _params(CPU, CPU_CASES) + _params(CUDA, CUDA_CASES))
def test_matches_reference(device, num_heads, dtype, page_size):
    """Ragged rows over shuffled pages, heads not a multiple of the 16 a program takes, and
    split counts from one to more than a row has tiles."""
    cache, pages, seq_lens = make_latent_cache(LENS, page_size, RANK + ROPE, dtype, device,
                                               seed=3)
    q = random_q(len(LENS), num_heads, RANK + ROPE, dtype, device, seed=4)
    scale = (RANK + ROPE) ** -0.5
    ref = mla.mla_decode_attention_ref(q, cache, *pages, seq_lens, scale, RANK)
    for num_splits in (None, 1, 2, 4, 16):  # 16: more than any row has tiles
        out = mla.mla_decode_attention(q, cache, *pages, seq_lens, scale, RANK,
                                       num_splits=num_splits)
        assert_close(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize("rank,rope", [(24, 8), (32, 12)], ids=["rank24", "rope12"])
def test_widths_not_powers_of_two(rank, rope):
    cache, pages, seq_lens = make_latent_cache([1, 40, 9], 4, rank + rope, torch.float32, "cpu",
                                               seed=5)
    q = random_q(3, 4, rank + rope, torch.float32, "cpu", seed=6)
    ref = mla.mla_decode_attention_ref(q, cache, *pages, seq_lens, 0.2, rank)
    for num_splits in (1, 3):
        assert_close(mla.mla_decode_attention(q, cache, *pages, seq_lens, 0.2, rank,
                                              num_splits=num_splits), ref, torch.float32)


@needs_triton
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_views_in_and_out(device):
    """q a strided view, out a view into a larger buffer, int64 page lists; one launch for
    one split, two (split + merge) for more."""
    cache, (indptr, indices), seq_lens = make_latent_cache([9, 40, 3], 4, RANK + ROPE,
                                                           torch.float32, device, seed=7)
    pages = (indptr.long(), indices.long())
    q = random_q(3, 8, RANK + ROPE, torch.float32, device, seed=8)[:, ::2]  # head stride 2
    buffer = torch.full((3, 8, RANK), float("nan"), device=device)
    out = buffer[:, 4:]
    ref = mla.mla_decode_attention_ref(q.contiguous(), cache, *pages, seq_lens.long(), 0.3, RANK)
    for num_splits, launches in ((1, 1), (2, 2)):
        out.fill_(float("nan"))
        with expect_launches(launches):
            returned = mla.mla_decode_attention(q, cache, *pages, seq_lens.long(), 0.3, RANK,
                                                out=out, num_splits=num_splits)
        assert returned is out
        assert_close(out, ref, torch.float32)
        assert buffer[:, :4].isnan().all(), "wrote outside out"


def test_without_interpreter_cpu_uses_the_reference(monkeypatch):
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    cache, pages, seq_lens = make_latent_cache([3, 12], 4, RANK + ROPE, torch.float32, "cpu",
                                               seed=9)
    q = random_q(2, 4, RANK + ROPE, torch.float32, "cpu", seed=10)
    with expect_launches(0):
        out = mla.mla_decode_attention(q, cache, *pages, seq_lens, 0.25, RANK)
    assert torch.equal(out, mla.mla_decode_attention_ref(q, cache, *pages, seq_lens, 0.25, RANK))


def _bad_calls():
    cache = torch.zeros(4, 4, 1, 40)
    indptr = torch.tensor([0, 1, 3], dtype=torch.int32)
    indices = torch.tensor([2, 0, 1], dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    q = torch.zeros(2, 4, 40)
    call = mla.mla_decode_attention
    yield "two KV heads", lambda: call(q, torch.zeros(4, 4, 2, 40), indptr, indices, lens, 1.0, 32)
    yield "entry width differs", lambda: call(torch.zeros(2, 4, 48), cache, indptr, indices,
                                              lens, 1.0, 32)
    yield "rank the whole entry", lambda: call(q, cache, indptr, indices, lens, 1.0, 40)
    yield "float page ids", lambda: call(q, cache, indptr, indices.float(), lens, 1.0, 32)
    yield "kv_indptr of B rows", lambda: call(q, cache, indptr[:2], indices, lens, 1.0, 32)
    yield "q last dim strided", lambda: call(torch.zeros(2, 4, 80)[..., ::2], cache, indptr,
                                             indices, lens, 1.0, 32)
    yield "out of wrong shape", lambda: call(q, cache, indptr, indices, lens, 1.0, 32,
                                             out=torch.zeros(2, 4, 40))


@pytest.mark.parametrize("call", [pytest.param(c, id=name) for name, c in _bad_calls()])
def test_rejects_bad_inputs(call):
    with expect_launches(0), pytest.raises(ValueError):
        call()


@needs_triton
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("device", [CUDA])
def test_deepseek_shape(device, num_heads):
    """DeepSeek-V2-Lite (16 heads) and V3 (128): R 512, Dr 64, page 64, bf16."""
    lens = [1, 1000, 4096, 333, 64, 65]
    cache, pages, seq_lens = make_latent_cache(lens, 64, 512 + 64, torch.bfloat16, device,
                                               seed=11)
    q = random_q(len(lens), num_heads, 512 + 64, torch.bfloat16, device, seed=12)
    scale = 192 ** -0.5  # DeepSeek's qk head dim before absorption
    ref = mla.mla_decode_attention_ref(q, cache, *pages, seq_lens, scale, 512)
    for num_splits in (None, 1, 7):
        out = mla.mla_decode_attention(q, cache, *pages, seq_lens, scale, 512,
                                       num_splits=num_splits)
        assert_close(out, ref, torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("device", [CUDA])
def test_graph_replays_with_new_lengths_and_pages(device):
    """Captured once, the launches replay for other seq_lens and page lists."""
    entry, page_size = 512 + 64, 64
    contexts = [make_latent_cache(lens, page_size, entry, torch.bfloat16, "cuda", seed=13 + i)
                for i, lens in enumerate(([100, 7, 1500, 64], [1800, 1, 33, 700]))]
    num_pages = max(c[0].shape[0] for c in contexts)
    capacity = max(c[1][1].shape[0] for c in contexts) + 5
    cache = torch.zeros(num_pages, page_size, 1, entry, dtype=torch.bfloat16, device="cuda")
    kv_indptr = torch.zeros(5, dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(capacity, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(4, dtype=torch.int32, device="cuda")
    q = torch.zeros(4, 16, entry, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(4, 16, 512, dtype=torch.bfloat16, device="cuda")

    def load(i: int) -> None:  # refill the fixed inputs in place, as a graph runner does
        c, (indptr, indices), lens = contexts[i]
        cache[:c.shape[0]].copy_(c)
        kv_indptr.copy_(indptr)
        kv_indices[:indices.shape[0]].copy_(indices)
        seq_lens.copy_(lens)
        q.copy_(random_q(4, 16, entry, torch.bfloat16, "cuda", seed=20 + i))

    def run() -> None:
        mla.mla_decode_attention(q, cache, kv_indptr, kv_indices, seq_lens, 0.07, 512, out=out,
                                 num_splits=8)

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
        ref = mla.mla_decode_attention_ref(q, cache, kv_indptr, kv_indices, seq_lens, 0.07, 512)
        assert_close(out, ref, torch.bfloat16)


def compile_main() -> int:
    """Compile every launch of a few configurations for sm_90 (as test_compile_for_hopper.py
    does for the other kernels); print one line per case; 1 if any failed."""
    import triton.runtime.jit as jit

    from tests.kernels.test_compile_for_hopper import _compile
    launches = []
    jit.JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append(
        (self, args, kwargs))
    pages = (torch.tensor([0, 2, 3, 5], dtype=torch.int32), torch.zeros(5, dtype=torch.int32))
    lens = torch.tensor([40, 1, 64], dtype=torch.int32)
    failed = 0
    for heads, rank, rope, dtype, splits in [(16, 512, 64, torch.bfloat16, 1),
                                             (128, 512, 64, torch.bfloat16, 4),
                                             (3, 24, 12, torch.float32, 2)]:
        name = f"H {heads} R {rank} Dr {rope} {dtype} {splits} splits"
        launches.clear()
        try:
            q = torch.zeros(3, heads, rank + rope, dtype=dtype)
            cache = torch.zeros(8, 64, 1, rank + rope, dtype=dtype)
            mla.mla_decode_attention(q, cache, *pages, lens, 0.1, rank, num_splits=splits)
            assert len(launches) == (1 if splits == 1 else 2), "not the expected launches"
            for fn, args, kwargs in launches:
                _compile(fn, args, dict(kwargs))
            print(f"ok   {name}")
        except Exception as e:  # report every case, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[-1500:]}")
    return 1 if failed else 0


@needs_triton
def test_kernels_compile_for_sm90():
    """The interpreter checks no types or layouts: compile for a Hopper GPU, in a subprocess
    without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PD_SERVE_TRITON_CPU="1", PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", "import sys; from tests.kernels."
                           "test_mla_decode import compile_main; sys.exit(compile_main())"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
