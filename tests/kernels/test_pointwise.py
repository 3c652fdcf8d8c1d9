"""RMSNorm, RoPE, SiLU-and-mul, KV-store and pending-id kernels against their torch references.

On CPU the kernels run in Triton's interpreter: an autouse fixture sets PD_SERVE_TRITON_CPU=1 for
each CPU test (the modules import Triton lazily and jit their kernel on first use, which is
when Triton reads the variable), so the setting never leaks into other test modules. On a CUDA
machine the same tests also run compiled on the GPU, bfloat16 included.

Where kernel and reference do the same float ops in the same order the check is exact; where
they cannot (a reduction order, exp's implementation, FMA contraction on the GPU) it allows a
couple of units in the last place of the dtype, and the test says why.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import pytest
import torch

from kernels import activation, kv_store, norm, pending, rope
from pd_serve.model.rope import RotaryEmbedding

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (device, dtype): the interpreter has no bfloat16 arithmetic worth testing, the GPU does.
CASES = [
    pytest.param("cpu", torch.float32, id="cpu-float32"),
    pytest.param("cpu", torch.float16, id="cpu-float16"),
    *[pytest.param("cuda", dtype, id=f"cuda-{str(dtype)[6:]}", marks=needs_cuda)
      for dtype in (torch.float32, torch.float16, torch.bfloat16)],
]
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MAX_POSITIONS = 4096
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
POISON = {1: 0x7F, 2: 0x7E5A, 4: 0x7FC0DEAD}  # NaN patterns for fp8 e4m3 / fp16 / fp32


@contextlib.contextmanager
def expect_launches(module, n: int):
    """Fails unless the block launched `module`'s Triton kernel exactly n times."""
    before = module.triton_launches
    yield
    assert module.triton_launches - before == n, "the Triton path did not run"


def randn(*shape, dtype, device, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def assert_within_ulps(got: torch.Tensor, expected: torch.Tensor, ulps: float) -> None:
    """Equal to within `ulps` units of the dtype's epsilon (relative, and absolute near 0)."""
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), expected.float(), rtol=ulps * eps, atol=ulps * eps)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.element_size()])


# ----------------------------------------------------------------------------- rms_norm

NORM_SHAPES = {
    "one-token": (1, 72),
    "odd-rows": (37, 72),
    "llama-hidden": (3, 4096),
    "per-head": (37, 3, 64),
}


def qk_norm_view(num_tokens: int, dtype, device) -> torch.Tensor:
    """q of a fused [T, q + 2 kv] output as [T, heads, head_dim]: strided rows, Qwen3's q-norm."""
    qkv = randn(num_tokens, (4 + 2 * 2) * 64, dtype=dtype, device=device, seed=7)
    return qkv[:, : 4 * 64].view(num_tokens, 4, 64)


@needs_triton
@pytest.mark.parametrize("shape", list(NORM_SHAPES))
@pytest.mark.parametrize("device, dtype", CASES)
def test_rms_norm_matches_reference(device, dtype, shape):
    x = randn(*NORM_SHAPES[shape], dtype=dtype, device=device, seed=1, scale=3.0)
    residual = randn(*NORM_SHAPES[shape], dtype=dtype, device=device, seed=2)
    weight = randn(x.shape[-1], dtype=dtype, device=device, seed=3)
    with expect_launches(norm, 2):
        out = norm.rms_norm(x, weight, 1e-6)
        out_fused, s = norm.rms_norm(x, weight, 1e-6, residual)
    expected_fused, expected_s = norm.rms_norm_ref(x, weight, 1e-6, residual)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(s, expected_s)  # one add rounded once, both sides
    # The mean square is a sum in another order (and rsqrt is approximate on the GPU), so a
    # rounding to the dtype may land one unit apart, which the weight multiply can carry on.
    assert_within_ulps(out, norm.rms_norm_ref(x, weight, 1e-6), 2)
    assert_within_ulps(out_fused, expected_fused, 2)


@needs_triton
@pytest.mark.parametrize("device, dtype", CASES)
def test_rms_norm_on_strided_views(device, dtype):
    q = qk_norm_view(37, dtype, device)  # [T, 4, 64], token stride 512: read where it lies
    residual = randn(37, 4, 64, dtype=dtype, device=device, seed=4)  # contiguous: another layout
    weight = randn(64, dtype=dtype, device=device, seed=5)
    with expect_launches(norm, 2):
        out = norm.rms_norm(q, weight, 1e-6)
        out_fused, s = norm.rms_norm(q, weight, 1e-6, residual)
    # As above: a reduction in another order, so within a couple of units.
    assert_within_ulps(out, norm.rms_norm_ref(q, weight, 1e-6), 2)
    expected_fused, expected_s = norm.rms_norm_ref(q, weight, 1e-6, residual)
    assert torch.equal(s, expected_s)
    assert_within_ulps(out_fused, expected_fused, 2)
    # Leading dims that fold into no two strides are copied first: same answer.
    scattered = randn(6, 5, 4, 64, dtype=dtype, device=device, seed=6)[::2, :, 1:3]
    with expect_launches(norm, 1):
        out = norm.rms_norm(scattered, weight, 1e-6)
    assert_within_ulps(out, norm.rms_norm_ref(scattered, weight, 1e-6), 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rms_norm_reference_is_hugging_face_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(72, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(randn(72, dtype=dtype, device="cpu", seed=8))
        x = randn(37, 72, dtype=dtype, device="cpu", seed=9, scale=3.0)
        residual = randn(37, 72, dtype=dtype, device="cpu", seed=10)
        assert torch.equal(norm.rms_norm_ref(x, hf.weight, 1e-5), hf(x))
        hidden = residual + x  # the decoder layer's order
        out, s = norm.rms_norm_ref(x, hf.weight, 1e-5, residual)
        assert torch.equal(s, hidden) and torch.equal(out, hf(hidden))


# ----------------------------------------------------------------------------- rope

ROPE_SHAPES = {  # T, Hq, Hk, D
    "one-token": (1, 4, 2, 64),
    "odd-tokens": (37, 4, 2, 128),
    "odd-heads": (5, 3, 1, 64),
    "llama-heads": (3, 32, 8, 128),  # several head blocks of q, one of k
}


@functools.cache
def llama3_tables(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    emb = RotaryEmbedding(head_dim, MAX_POSITIONS, 500000.0, LLAMA3_SCALING)
    return emb.cos, emb.sin  # [max_pos, D] float32 each


def fused_qkv(num_tokens, num_q_heads, num_k_heads, head_dim, dtype, device, seed: int):
    """A fused [T, (Hq + 2 Hk) D + 3] projection output (+ 3: an odd token stride)."""
    width = (num_q_heads + 2 * num_k_heads) * head_dim + 3
    return randn(num_tokens, width, dtype=dtype, device=device, seed=seed)


def qk_views(qkv: torch.Tensor, num_q_heads: int, num_k_heads: int, head_dim: int):
    """q [T, Hq, D] and k [T, Hk, D] as views into the fused tensor."""
    q_end = num_q_heads * head_dim
    q = qkv[:, :q_end].view(-1, num_q_heads, head_dim)
    k = qkv[:, q_end:q_end + num_k_heads * head_dim].view(-1, num_k_heads, head_dim)
    return q, k


def test_rope_reference_rotates_like_the_model_formula():
    """The reference is HF's x * cos + rotate_half(x) * sin, here in float32."""
    cos, sin = llama3_tables(64)
    positions = torch.tensor([0, 5, 4095])
    q, k = qk_views(fused_qkv(3, 2, 1, 64, torch.float32, "cpu", seed=12), 2, 1, 64)
    q0, k0 = q.clone(), k.clone()
    rope.apply_rope_ref_(positions, q, k, cos, sin)
    c, s = cos[positions, None], sin[positions, None]
    for got, x in ((q, q0), (k, k0)):
        rotated = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)
        assert torch.equal(got, x * c + rotated * s)
    assert torch.equal(q[0], q0[0])  # position 0 is the identity


# ----------------------------------------------------------------------------- silu_and_mul

SILU_SHAPES = {"one-token": (1, 72), "odd-tokens": (37, 72), "wide": (3, 2500)}  # T, I


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(100)
@pytest.mark.parametrize("shape", list(SILU_SHAPES))
@pytest.mark.parametrize("device, dtype", CASES)
def test_silu_and_mul_matches_reference(device, dtype, shape):
    num_tokens, inner = SILU_SHAPES[shape]
    fused = randn(num_tokens, 2 * inner + 5, dtype=dtype, device=device, seed=13, scale=4.0)
    fused[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp overflow, saturation, zero
    x = fused[:, : 2 * inner]  # [T, 2I], row stride 2I + 5
    with expect_launches(activation, 1):
        out = activation.silu_and_mul(x)
    assert out.shape == (num_tokens, inner) and out.dtype == dtype and out.is_contiguous()
    # exp differs by an ulp between implementations (numpy or libdevice vs torch's own), and
    # the dtype rounding of silu can carry one unit into the product.
    assert_within_ulps(out, activation.silu_and_mul_ref(x), 2)


def test_silu_and_mul_reference_is_hugging_face_order():
    x = randn(5, 2 * 72, dtype=torch.bfloat16, device="cpu", seed=14, scale=4.0)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(activation.silu_and_mul_ref(x), torch.nn.functional.silu(gate) * up)


# ----------------------------------------------------------------------------- store_kv

KV_SHAPES = {  # T, H, D, P, S
    "one-token": (1, 2, 64, 4, 16),
    "odd-tokens": (37, 2, 128, 6, 8),
    "odd-head-dim": (5, 3, 72, 2, 4),
}
# (new dtype, cache dtype). The interpreter's downcasts to bfloat16 / fp8 do not round to
# nearest even, so those casts are checked on the GPU only.
KV_CASTS = [
    pytest.param("cpu", torch.float32, torch.float32, id="cpu-float32"),
    pytest.param("cpu", torch.float16, torch.float16, id="cpu-float16"),
    pytest.param("cpu", torch.float16, torch.float32, id="cpu-float16-to-float32"),
    *[pytest.param("cuda", new, cache, marks=needs_cuda,
                   id=f"cuda-{str(new)[6:]}-to-{str(cache)[6:]}")
      for new, cache in [(torch.float32, torch.float32), (torch.float16, torch.float16),
                         (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                         (torch.bfloat16, torch.float8_e4m3fn)]],
]


def poisoned_cache(shape, dtype, device) -> torch.Tensor:
    cache = torch.empty(shape, dtype=dtype, device=device)
    bits(cache).fill_(POISON[cache.element_size()])
    return cache  # [P, S, H, D]


def slots_with_padding(num_tokens: int, num_slots: int, device) -> torch.Tensor:
    """Distinct random slots, every fourth token (the first included) a -1 padding row."""
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(15))[:num_tokens]
    slots[::4] = -1
    return slots.to(device)


@needs_triton
@pytest.mark.parametrize("shape", list(KV_SHAPES))
@pytest.mark.parametrize("device, new_dtype, cache_dtype", KV_CASTS)
def test_store_kv_writes_only_valid_slots(device, new_dtype, cache_dtype, shape):
    num_tokens, num_heads, head_dim, num_pages, page_size = KV_SHAPES[shape]
    # k, v as views of a fused [T, q + 2 kv] output (q: 2 heads), as the model has them.
    qkv = randn(num_tokens, (2 + 2 * num_heads) * head_dim, dtype=new_dtype, device=device,
                seed=16, scale=2.0)
    k = qkv[:, 2 * head_dim:(2 + num_heads) * head_dim].view(num_tokens, num_heads, head_dim)
    v = qkv[:, (2 + num_heads) * head_dim:].view(num_tokens, num_heads, head_dim)
    cache_shape = (num_pages, page_size, num_heads, head_dim)
    k_cache, v_cache = (poisoned_cache(cache_shape, cache_dtype, device) for _ in range(2))
    slots = slots_with_padding(num_tokens, num_pages * page_size, device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    kv_store.store_kv_ref(k, v, k_expected, v_expected, slots)
    with expect_launches(kv_store, 1):
        kv_store.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(bits(k_cache), bits(k_expected))  # a copy or one cast: exact
    assert torch.equal(bits(v_cache), bits(v_expected))
    valid = (slots >= 0).cpu()
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
    untouched[slots.cpu()[valid]] = False
    for cache, new in ((k_cache, k), (v_cache, v)):
        rows = bits(cache).view(-1, num_heads, head_dim)
        assert bool((rows[untouched.to(device)] == POISON[cache.element_size()]).all())
        assert torch.equal(bits(rows[slots[valid.to(device)]]),
                           bits(new[valid.to(device)].to(cache_dtype)))


ROPE_KV_CASES = [  # (device, dtype, cache dtype, k_scale)
    pytest.param("cpu", torch.float32, torch.float32, 1.0, id="cpu-float32"),
    pytest.param("cpu", torch.float16, torch.float16, 1.0, id="cpu-float16"),
    pytest.param("cpu", torch.float16, torch.float32, 0.5, id="cpu-float16-to-float32-scaled"),
    *[pytest.param("cuda", new, cache, scale, marks=needs_cuda,
                   id=f"cuda-{str(new)[6:]}-to-{str(cache)[6:]}")
      for new, cache, scale in [(torch.bfloat16, torch.bfloat16, 1.0),
                                (torch.float16, torch.float16, 1.0),
                                (torch.bfloat16, torch.float8_e4m3fn, 0.05)]],
]


@needs_triton
@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
@pytest.mark.parametrize("device, dtype, cache_dtype, k_scale", ROPE_KV_CASES)
def test_rope_store_kv_is_rope_then_store(device, dtype, cache_dtype, k_scale, shape):
    """One launch gives what the reference rotation then store_kv give: q rotated in place,
    rotated k and v in the valid slots only (padding rows skipped), k itself unchanged."""
    num_tokens, num_q_heads, num_k_heads, head_dim = ROPE_SHAPES[shape]
    num_pages, page_size = 8, 8
    cos, sin = (t.to(device) for t in llama3_tables(head_dim))
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,),
                              generator=torch.Generator().manual_seed(21)).to(device)
    qkv = fused_qkv(num_tokens, num_q_heads, num_k_heads, head_dim, dtype, device, seed=22)
    v = qkv[:, (num_q_heads + num_k_heads) * head_dim:-3].view(num_tokens, num_k_heads, head_dim)
    slots = slots_with_padding(num_tokens, num_pages * page_size, device)
    cache_shape = (num_pages, page_size, num_k_heads, head_dim)
    k_cache, v_cache = (poisoned_cache(cache_shape, cache_dtype, device) for _ in range(2))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    separate = qkv.clone()
    q_sep, k_sep = qk_views(separate, num_q_heads, num_k_heads, head_dim)
    rope.apply_rope_ref_(positions, q_sep, k_sep, cos, sin)
    kv_store.store_kv(k_sep, v, k_expected, v_expected, slots, k_scale, 2 * k_scale)
    before = qkv.clone()
    q, k = qk_views(qkv, num_q_heads, num_k_heads, head_dim)
    with expect_launches(kv_store, 1):
        kv_store.rope_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots, k_scale,
                               2 * k_scale)
    q_end = num_q_heads * head_dim
    assert torch.equal(qkv[:, q_end:], before[:, q_end:]), "k or v modified"
    if device == "cpu":  # the same float32 ops in the same order as the reference's
        assert torch.equal(qkv[:, :q_end], separate[:, :q_end])
        assert torch.equal(bits(k_cache), bits(k_expected))
        assert torch.equal(bits(v_cache), bits(v_expected))
        return
    # The GPU contracts x1 * c - x2 * s into an FMA: one rounding fewer, so the float32 result
    # may differ by a unit, and a dtype rounding by one.
    assert_within_ulps(qkv[:, :q_end], separate[:, :q_end], 2)
    valid = slots[slots >= 0]
    for got, expected in ((k_cache, k_expected), (v_cache, v_expected)):
        got, expected = (c.view(-1, num_k_heads, head_dim)[valid].float() for c in (got, expected))
        tolerance = 0.125 if cache_dtype == torch.float8_e4m3fn else 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool, device=device)
    untouched[valid] = False
    for cache in (k_cache, v_cache):
        rows = bits(cache).view(-1, num_k_heads, head_dim)[untouched]
        assert bool((rows == POISON[cache.element_size()]).all())


@needs_triton
@pytest.mark.parametrize("shape", ["one-token", "odd-heads", "llama-heads"])
@pytest.mark.parametrize("device, dtype, cache_dtype, k_scale", ROPE_KV_CASES)
def test_rope_store_kv_with_qk_norm_is_norm_then_rope_then_store(device, dtype, cache_dtype,
                                                                  k_scale, shape):
    """Qwen3's per-head q/k norms in the same launch: as rms_norm_ref on q and k, then the
    rotation and store (padding rows skipped, k itself unchanged). The kernel sums a head's
    squares in two halves, so a value may differ from the reference's by a dtype unit."""
    num_tokens, num_q_heads, num_k_heads, head_dim = ROPE_SHAPES[shape]
    cos, sin = (t.to(device) for t in llama3_tables(head_dim))
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,),
                              generator=torch.Generator().manual_seed(31)).to(device)
    qkv = fused_qkv(num_tokens, num_q_heads, num_k_heads, head_dim, dtype, device, seed=32)
    v = qkv[:, (num_q_heads + num_k_heads) * head_dim:-3].view(num_tokens, num_k_heads, head_dim)
    q_weight, k_weight = (randn(head_dim, dtype=dtype, device=device, seed=s) for s in (33, 34))
    slots = slots_with_padding(num_tokens, 64, device)
    k_cache, v_cache = (poisoned_cache((8, 8, num_k_heads, head_dim), cache_dtype, device)
                        for _ in range(2))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    q, k = qk_views(qkv, num_q_heads, num_k_heads, head_dim)
    q_ref, k_ref = norm.rms_norm_ref(q, q_weight, 1e-6), norm.rms_norm_ref(k, k_weight, 1e-6)
    rope.apply_rope_ref_(positions, q_ref, k_ref, cos, sin)
    kv_store.store_kv_ref(k_ref, v, k_expected, v_expected, slots, k_scale, 2 * k_scale)
    before = qkv.clone()
    with expect_launches(kv_store, 1):
        got = kv_store.rope_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots,
                                     k_scale, 2 * k_scale, qk_norm=(q_weight, k_weight, 1e-6))
    q_end = num_q_heads * head_dim
    assert got is q and torch.equal(qkv[:, q_end:], before[:, q_end:]), "k or v modified"
    assert_within_ulps(q, q_ref, 4)
    valid = slots[slots >= 0]
    tolerance = 0.125 if cache_dtype == torch.float8_e4m3fn else 4 * torch.finfo(dtype).eps
    for got_cache, expected in ((k_cache, k_expected), (v_cache, v_expected)):
        got_rows, expected_rows = (c.view(-1, num_k_heads, head_dim)[valid].float()
                                   for c in (got_cache, expected))
        torch.testing.assert_close(got_rows, expected_rows, rtol=tolerance, atol=tolerance)
    untouched = torch.ones(64, dtype=torch.bool, device=device)
    untouched[valid] = False
    for cache in (k_cache, v_cache):
        rows = bits(cache).view(-1, num_k_heads, head_dim)[untouched]
        assert bool((rows == POISON[cache.element_size()]).all())


def test_rope_store_kv_qk_norm_without_interpreter_is_the_references(monkeypatch):
    """The torch path: rms_norm_ref on q and k, then the reference rotation and store."""
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    cos, sin = llama3_tables(64)
    positions = torch.tensor([3, 700, 5])
    qkv = fused_qkv(3, 4, 2, 64, torch.float32, "cpu", seed=35)
    q, k = qk_views(qkv, 4, 2, 64)
    v = qkv[:, 6 * 64:-3].view(3, 2, 64)
    weights = randn(64, dtype=torch.float32, device="cpu", seed=36), torch.ones(64)
    slots = torch.tensor([5, -1, 0])
    caches = [poisoned_cache((2, 4, 2, 64), torch.float32, "cpu") for _ in range(4)]
    q_ref, k_ref = norm.rms_norm_ref(q, weights[0], 1e-5), norm.rms_norm_ref(k, weights[1], 1e-5)
    rope.apply_rope_ref_(positions, q_ref, k_ref, cos, sin)
    kv_store.store_kv_ref(k_ref, v, caches[2], caches[3], slots)
    k_before = k.clone()
    with expect_launches(kv_store, 0):
        got = kv_store.rope_store_kv(positions, q, k, v, cos, sin, caches[0], caches[1], slots,
                                     qk_norm=(*weights, 1e-5))
    assert got is q and torch.equal(q, q_ref) and torch.equal(k, k_before)
    assert torch.equal(bits(caches[0]), bits(caches[2]))
    assert torch.equal(bits(caches[1]), bits(caches[3]))
    with pytest.raises(ValueError, match="qk_norm weights must be"):
        kv_store.rope_store_kv(positions, q, k, v, cos, sin, caches[0], caches[1], slots,
                               qk_norm=(torch.ones(32), torch.ones(64), 1e-5))


@needs_triton
@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"),
                                    pytest.param("cuda", marks=needs_cuda, id="cuda")])
def test_rope_store_kv_into_q_out(device):
    """With q_out the rotated q lands there (contiguous), q and k stay as they were, and the
    values equal the in-place call's."""
    cos, sin = (t.to(device) for t in llama3_tables(128))
    positions = torch.tensor([9, 4000, 17], device=device)
    qkv = fused_qkv(3, 32, 8, 128, torch.float16, device, seed=24)
    v = qkv[:, 40 * 128:-3].view(3, 8, 128)
    slots = torch.tensor([3, 0, 9], device=device)
    caches = [poisoned_cache((2, 8, 8, 128), torch.float16, device) for _ in range(4)]
    before = qkv.clone()
    q, k = qk_views(qkv, 32, 8, 128)
    q_out = torch.empty(3, 32, 128, dtype=torch.float16, device=device)
    with expect_launches(kv_store, 1):
        got = kv_store.rope_store_kv(positions, q, k, v, cos, sin, caches[0], caches[1], slots,
                                     q_out=q_out)
    assert got is q_out and torch.equal(qkv, before)
    in_place = kv_store.rope_store_kv(positions, q, k, v, cos, sin, caches[2], caches[3], slots)
    assert in_place is q
    assert torch.equal(q_out, q)
    assert torch.equal(bits(caches[0]), bits(caches[2]))
    assert torch.equal(bits(caches[1]), bits(caches[3]))


def test_rope_store_kv_without_interpreter_is_the_references(monkeypatch):
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    cos, sin = llama3_tables(64)
    positions = torch.tensor([3, 700, 5])
    qkv = fused_qkv(3, 4, 2, 64, torch.float32, "cpu", seed=23)
    q, k = qk_views(qkv, 4, 2, 64)
    v = qkv[:, 6 * 64:-3].view(3, 2, 64)
    slots = torch.tensor([5, -1, 0])
    caches = [poisoned_cache((2, 4, 2, 64), torch.float32, "cpu") for _ in range(4)]
    q_ref, k_ref = q.clone(), k.clone()
    rope.apply_rope_ref_(positions, q_ref, k_ref, cos, sin)
    kv_store.store_kv_ref(k_ref, v, caches[2], caches[3], slots)
    with expect_launches(kv_store, 0):
        kv_store.rope_store_kv(positions, q, k, v, cos, sin, caches[0], caches[1], slots)
    assert torch.equal(q, q_ref)
    assert torch.equal(bits(caches[0]), bits(caches[2]))
    assert torch.equal(bits(caches[1]), bits(caches[3]))


FP8_CACHES = [torch.float8_e4m3fn, torch.float8_e5m2]


@needs_triton
@pytest.mark.parametrize("cache_dtype", FP8_CACHES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"),
                                    pytest.param("cuda", marks=needs_cuda, id="cuda")])
def test_store_kv_fp8_divides_by_the_scale_and_saturates(device, cache_dtype):
    """The cache holds k / k_scale (v / v_scale); values past the format's max become +-max,
    never inf or NaN. The values are FP8 numbers times power-of-two scales, so the quotient is
    exact and the check bit-exact even in the interpreter (whose FP8 downcast does not round)."""
    num_tokens, num_heads, head_dim, num_pages, page_size = 9, 2, 32, 4, 4
    fmax = torch.finfo(cache_dtype).max
    k_scale, v_scale = 0.5, 4.0
    base = randn(num_tokens, num_heads, head_dim, dtype=torch.float32, device="cpu", seed=22,
                 scale=8.0).to(cache_dtype).float()  # [T, H, D], each an FP8 number
    base[1, 0, :4] = torch.tensor([3 * fmax, -3 * fmax, 1e30, -1e30])  # out of range
    k, v = (base * k_scale).to(device), (base.flip(0) * v_scale).to(device)
    cache_shape = (num_pages, page_size, num_heads, head_dim)
    k_cache, v_cache = (poisoned_cache(cache_shape, cache_dtype, device) for _ in range(2))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slots = slots_with_padding(num_tokens, num_pages * page_size, device)
    kv_store.store_kv_ref(k, v, k_expected, v_expected, slots, k_scale, v_scale)
    with expect_launches(kv_store, 1):
        kv_store.store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(bits(k_cache), bits(k_expected))
    assert torch.equal(bits(v_cache), bits(v_expected))
    valid = slots >= 0
    stored = k_cache.view(-1, num_heads, head_dim)[slots[valid]].float().cpu()  # [n, H, D]
    assert torch.equal(stored, base[valid.cpu()].clamp(-fmax, fmax))  # k / k_scale, saturated
    assert stored[0, 0, :4].tolist() == [fmax, -fmax, fmax, -fmax]  # token 1 (token 0 pads)


@needs_triton
def test_store_kv_scale_without_fp8():
    """A scale applies to any cache dtype (float32 here): k * float32(1 / k_scale), no clamp."""
    k = randn(6, 2, 16, dtype=torch.float32, device="cpu", seed=23, scale=1e3)
    v = randn(6, 2, 16, dtype=torch.float32, device="cpu", seed=24)
    slots = torch.arange(6)
    caches = [torch.zeros(2, 4, 2, 16) for _ in range(4)]
    kv_store.store_kv_ref(k, v, caches[0], caches[1], slots, 0.3, 3.0)
    with expect_launches(kv_store, 1):
        kv_store.store_kv(k, v, caches[2], caches[3], slots, 0.3, 3.0)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert torch.equal(caches[0].view(-1, 2, 16)[:6], k * torch.tensor(1 / 0.3))
    with pytest.raises(ValueError, match="must be > 0"):
        kv_store.store_kv(k, v, caches[2], caches[3], slots, 0.0, 1.0)


@needs_triton
def test_store_kv_all_padding_writes_nothing():
    k = randn(4, 2, 64, dtype=torch.float16, device="cpu", seed=17)
    cache = poisoned_cache((2, 4, 2, 64), torch.float16, "cpu")
    before = cache.clone()
    with expect_launches(kv_store, 1):
        kv_store.store_kv(k, k, cache, cache.clone(), torch.full((4,), -1))
    assert torch.equal(bits(cache), bits(before))


@needs_triton
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_store_kv_past_int32_offsets(monkeypatch, device):
    """Slots whose elements lie beyond 2**31 in a > 2 GiB fp8 cache."""
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    num_pages, page_size, num_heads, head_dim = 16_400, 128, 8, 128  # 2.15e9 elements
    shape = (num_pages, page_size, num_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    last = num_pages * page_size - 1
    slots = torch.tensor([last, 0, -1, last - 7], device="cuda")
    k = randn(4, num_heads, head_dim, dtype=torch.bfloat16, device="cuda", seed=18)
    v = randn(4, num_heads, head_dim, dtype=torch.bfloat16, device="cuda", seed=19)
    with expect_launches(kv_store, 1):
        kv_store.store_kv(k, v, k_cache, v_cache, slots)
    for cache, new in ((k_cache, k), (v_cache, v)):
        rows = cache.view(-1, num_heads, head_dim)
        for i in (0, 1, 3):
            assert torch.equal(bits(rows[slots[i]]), bits(new[i].to(torch.float8_e4m3fn)))


# ----------------------------------------------------------------------------- dispatch

def test_without_interpreter_cpu_uses_the_references(monkeypatch):
    monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    x = randn(5, 2 * 72, dtype=torch.float16, device="cpu", seed=20)
    weight = randn(144, dtype=torch.float16, device="cpu", seed=21)
    qkv = fused_qkv(5, 2, 1, 64, torch.float16, "cpu", seed=22)
    _, k = qk_views(qkv, 2, 1, 64)
    cache = torch.zeros(2, 4, 1, 64, dtype=torch.float16)
    expected_cache = cache.clone()
    slots = torch.tensor([3, -1, 0, 7, 5])
    modules = (norm, activation, kv_store, pending)
    before = [m.triton_launches for m in modules]
    assert torch.equal(norm.rms_norm(x, weight, 1e-6), norm.rms_norm_ref(x, weight, 1e-6))
    assert torch.equal(activation.silu_and_mul(x), activation.silu_and_mul_ref(x))
    kv_store.store_kv(k, k, cache, cache.clone(), slots)
    kv_store.store_kv_ref(k, k, expected_cache, expected_cache.clone(), slots)
    assert torch.equal(cache, expected_cache)
    assert [m.triton_launches for m in modules] == before


def _bad_calls():
    x = torch.zeros(4, 72)
    yield "norm: weight size", lambda: norm.rms_norm(x, torch.ones(71), 1e-6)
    yield "norm: residual shape", lambda: norm.rms_norm(x, torch.ones(72), 1e-6, x[:2])
    yield "norm: residual dtype", lambda: norm.rms_norm(x, torch.ones(72), 1e-6, x.half())
    yield "norm: int input", lambda: norm.rms_norm(x.int(), torch.ones(72), 1e-6)
    yield "norm: row too wide", lambda: norm.rms_norm(torch.zeros(1, 32768), torch.ones(32768),
                                                      1e-6)
    yield "silu: odd width", lambda: activation.silu_and_mul(torch.zeros(4, 73))
    yield "silu: 3-D", lambda: activation.silu_and_mul(torch.zeros(2, 4, 72))
    yield "silu: strided columns", lambda: activation.silu_and_mul(torch.zeros(4, 144)[:, ::2])
    cos, sin = llama3_tables(64)
    q, k = torch.zeros(3, 4, 64), torch.zeros(3, 2, 64)
    pos = torch.arange(3)
    cache = torch.zeros(2, 4, 2, 64)

    def rope_store(positions, q, k, cos, sin):
        return kv_store.rope_store_kv(positions, q, k, k, cos, sin, cache, cache.clone(), pos)
    yield "rope: position too large", lambda: rope_store(pos + MAX_POSITIONS - 1, q, k, cos, sin)
    yield "rope: token counts", lambda: rope_store(pos, q, k[:2], cos, sin)
    yield "rope: float positions", lambda: rope_store(pos.float(), q, k, cos, sin)
    yield "rope: half tables", lambda: rope_store(pos, q, k, cos.half(), sin.half())
    yield "rope: table width", lambda: rope_store(pos, q[..., :32], k[..., :32], cos, sin)
    yield "rope: dtypes differ", lambda: rope_store(pos, q, k.half(), cos, sin)
    yield "rope: q_out shape", lambda: kv_store.rope_store_kv(pos, q, k, k, cos, sin, cache,
                                                              cache.clone(), pos, q_out=k)
    yield "kv: slot too large", lambda: kv_store.store_kv(k, k, cache, cache.clone(),
                                                          torch.tensor([0, 1, 8]))
    yield "kv: repeated slot", lambda: kv_store.store_kv(k, k, cache, cache.clone(),
                                                         torch.tensor([1, -1, 1]))
    yield "kv: head count", lambda: kv_store.store_kv(q, q, cache, cache.clone(), pos)
    yield "kv: caches differ", lambda: kv_store.store_kv(k, k, cache, cache.half(), pos)
    yield "kv: strided cache", lambda: kv_store.store_kv(k, k, cache.transpose(0, 1),
                                                         cache.transpose(0, 1), pos)
    yield "kv: float slots", lambda: kv_store.store_kv(k, k, cache, cache.clone(), pos.float())
    yield "pending: float ids", lambda: pending.fill_pending_(pos.float(), pos)
    yield "pending: 2-d prev", lambda: pending.fill_pending_(pos, pos.view(1, 3))


@pytest.mark.parametrize("call", [pytest.param(c, id=name) for name, c in _bad_calls()])
def test_rejects_bad_inputs(call):
    modules = (norm, activation, kv_store, pending)
    before = [m.triton_launches for m in modules]
    with pytest.raises(ValueError):
        call()
    assert [m.triton_launches for m in modules] == before


PENDING_CASES = [pytest.param("cpu", id="cpu"),
                 pytest.param("cuda", id="cuda", marks=needs_cuda)]


@needs_triton
@pytest.mark.parametrize("device", PENDING_CASES)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_fill_pending_resolves_only_the_pending_ids(device, ids_dtype):
    # 300 ids (two programs), every third pending, pointing at rows of prev_tokens in any order.
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50_000, (300,), generator=g)
    rows = torch.randint(0, 40, (300,), generator=g)
    pending_at = torch.arange(300) % 3 == 0
    ids = torch.where(pending_at, -1 - rows, ids).to(ids_dtype).to(device)
    prev = torch.randint(0, 128_000, (40,), generator=g).to(device)
    expected = pending.fill_pending_ref_(ids.clone(), prev)
    assert torch.equal(expected.cpu()[pending_at], prev.cpu()[rows[pending_at]].to(ids_dtype))
    with expect_launches(pending, 1):
        out = pending.fill_pending_(ids, prev)
    assert out is ids and torch.equal(ids.cpu(), expected.cpu())
