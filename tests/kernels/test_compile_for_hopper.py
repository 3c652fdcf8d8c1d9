"""Every Triton kernel compiles for a Hopper GPU (sm_90), on a machine without one.

Triton's interpreter, which runs the kernels in CPU CI, does not check what the compiler
checks: a kernel that passed every CPU test once failed to compile on an H200 (a name set in
both arms of a runtime `if` with two types). Here each case calls a dispatch function on CPU
tensors with Triton's launch replaced by a recorder, and compiles every recorded launch, with
its real arguments and constexprs, for sm_90 down to a cubin (Triton ships ptxas).

It runs in a subprocess: this test process has TRITON_INTERPRET=1 (tests/conftest.py, no GPU),
under which triton.jit builds interpreted functions that do not compile.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")


def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


def _cases():
    """(name, call): each call launches the kernel(s) of one configuration."""
    from kernels import (activation, argmax, fp8_gemm, fp8_quant, fused_moe, gemv, kv_copy,
                         kv_store, moe_batch1, moe_routing, norm, paged_attention, pending, w4a16)
    bf16, i32, i64, f32 = torch.bfloat16, torch.int32, torch.int64, torch.float32
    e4m3 = torch.float8_e4m3fn
    yield "rms_norm", lambda: norm.rms_norm(_t(3, 4096), _t(4096), 1e-5)
    yield "rms_norm + residual", lambda: norm.rms_norm(_t(3, 4096), _t(4096), 1e-5, _t(3, 4096))
    yield "silu_and_mul", lambda: activation.silu_and_mul(_t(3, 2 * 14336))
    caches = lambda dtype: (_t(4, 16, 8, 128, dtype=dtype), _t(4, 16, 8, 128, dtype=dtype))  # noqa: E731
    slots = torch.tensor([0, -1, 5])
    yield "store_kv", lambda: kv_store.store_kv(_t(3, 8, 128), _t(3, 8, 128), *caches(bf16), slots)
    yield "store_kv fp8", lambda: kv_store.store_kv(_t(3, 8, 128), _t(3, 8, 128), *caches(e4m3),
                                                    slots, 0.5, 0.25)
    qkv = _t(3, 48 * 128)
    q, k, v = (qkv[:, :4096].view(3, 32, 128), qkv[:, 4096:5120].view(3, 8, 128),
               qkv[:, 5120:].view(3, 8, 128))
    tables = (_t(64, 128, dtype=f32), _t(64, 128, dtype=f32))
    positions = torch.tensor([1, 2, 3])
    yield "rope_store_kv", lambda: kv_store.rope_store_kv(positions, q, k, v, *tables, *caches(bf16),
                                                          slots)
    yield "rope_store_kv fp8 into q_out", lambda: kv_store.rope_store_kv(
        positions, q, k, v, *tables, *caches(e4m3), slots, 0.5, 0.25, q_out=_t(3, 32, 128))
    yield "rope_store_kv + qk_norm", lambda: kv_store.rope_store_kv(
        positions, q, k, v, *tables, *caches(bf16), slots, qk_norm=(_t(128), _t(128), 1e-6))
    yield "moe routing", lambda: moe_routing.route(_t(3, 128), 8, True)
    yield "moe routing, one row", lambda: moe_routing.route_one_row(
        _t(1, 2048), _t(1, 2048), _t(2048), 1e-6, _t(128, 2048), 8, True)
    ids1 = torch.tensor([[5, 0, 7, 2, 1, 3, 4, 6]], dtype=i32)
    for fp8 in (False, True):
        w13 = _t(8, 2 * 768, 2048, dtype=e4m3 if fp8 else bf16)
        w2 = _t(8, 2048, 768, dtype=e4m3 if fp8 else bf16)
        scales = dict(w13_scale=_t(8, 2 * 768, dtype=f32), w2_scale=_t(8, 2048, dtype=f32)) if fp8 else {}
        yield f"moe batch1{' fp8' if fp8 else ''}", lambda a=(w13, w2), sc=scales: fused_moe.fused_moe(
            _t(1, 2048), *a, _t(1, 8, dtype=f32), ids1, **sc, batch1=True)
        yield f"moe batch1{' fp8' if fp8 else ''}, down split", lambda a=(w13, w2), sc=scales: (
            moe_batch1.moe_batch1(_t(1, 2048), *a, _t(1, 8, dtype=f32), ids1, **sc,
                                  config={"gate_up": (1, 1, 1024, 4, 2), "down": (2, 4, 256, 4, 1)}))
    pages = torch.tensor([0, 3, 4, 8], dtype=i32), torch.zeros(8, dtype=i32)  # kv_indptr, kv_indices
    lens = torch.tensor([40, 1, 64], dtype=i32)
    for splits in (1, 3):
        yield f"decode attention, {splits} splits", lambda s=splits: (
            paged_attention.paged_decode_attention(_t(3, 32, 128), *caches(bf16), *pages, lens,
                                                   0.1, num_splits=s))
    yield "decode attention fp8", lambda: paged_attention.paged_decode_attention(
        _t(3, 32, 128), *caches(e4m3), *pages, lens, 0.1, num_splits=2, k_scale=0.5, v_scale=2.0)
    indptr = torch.tensor([0, 30, 31, 64], dtype=i32)
    yield "prefill attention", lambda: paged_attention.paged_prefill_attention(
        _t(64, 32, 128), *caches(bf16), indptr, *pages, lens, 0.1,
        q_blocks=torch.zeros(5, 2, dtype=i32))
    for k_dim in (4096, 14336):
        yield f"gemv K={k_dim}", lambda kd=k_dim: gemv.gemv(_t(1, kd), _t(64, kd), bias=_t(64))
    yield "gemv + silu_and_mul", lambda: gemv.gemv(_t(1, 4096), _t(128, 4096), silu_and_mul=True)
    # one output channel (Qwen2-MoE's shared-expert gate): Triton passes an int argument of 1
    # as a constant, not a tensor
    yield "gemv N=1", lambda: gemv.gemv(_t(1, 2048), _t(1, 2048))
    w8, s8 = _t(128, 4096, dtype=e4m3), _t(128, dtype=f32)
    yield "gemv fp8", lambda: gemv.gemv(_t(1, 4096), w8, s8)
    yield "gemv fp8 + silu_and_mul", lambda: gemv.gemv(_t(1, 4096), w8, s8, silu_and_mul=True)
    yield "gemv fp8 K=14336", lambda: gemv.gemv(_t(1, 14336), _t(64, 14336, dtype=e4m3),
                                                _t(64, dtype=f32))
    for m, n, k_dim in ((2, 6144, 4096), (16, 4096, 14336), (64, 28672, 4096), (64, 200, 300)):
        yield f"fp8_gemm {m}x{n}x{k_dim}", lambda s=(m, n, k_dim): fp8_gemm.fp8_gemm(
            _t(s[0], s[2], dtype=e4m3), _t(s[0], 1, dtype=f32), _t(s[1], s[2], dtype=e4m3),
            _t(s[1], dtype=f32), bf16)
    for dtype in (f32, bf16):
        yield f"argmax {dtype}", lambda d=dtype: argmax.argmax(_t(3, 128256, dtype=d),
                                                              out=_t(3, dtype=i64))
    yield "fp8 quantize", lambda: fp8_quant.quantize_per_token(_t(3, 4096))
    yield "fp8 quantize static", lambda: fp8_quant.quantize_per_token(_t(3, 4096), _t(1, dtype=f32))
    qweight, qzeros = _t(512, 256, dtype=i32), _t(32, 32, dtype=i32)
    yield "w4a16", lambda: w4a16.w4a16_matmul(_t(16, 4096, dtype=torch.float16), qweight, qzeros,
                                              _t(32, 256, dtype=torch.float16))
    yield "w4a16 one row", lambda: w4a16.w4a16_matmul(_t(1, 4096), qweight, qzeros,
                                                      _t(32, 256, dtype=torch.float16))
    yield "w4a16 one row, no zeros", lambda: w4a16.w4a16_matmul(
        _t(1, 4096, dtype=torch.float16), qweight, None, _t(32, 256, dtype=torch.float16))
    pool = lambda: _t(2, 2, 6, 16, 8, 128)  # noqa: E731  [L, 2, P, S, H, D]
    ids = torch.tensor([4, 1], dtype=i64)
    for dtype in (i32, i64):
        yield f"fill_pending {dtype}", lambda d=dtype: pending.fill_pending_(
            torch.tensor([5, -1], dtype=d), torch.tensor([7], dtype=i64))
    yield "gather_pages", lambda: kv_copy.gather_pages(pool(), ids, 0, 2, heads=(2, 6))
    yield "scatter_pages", lambda: kv_copy.scatter_pages(pool(), ids, _t(2, 2, 2, 16, 8, 128), 0, 2)
    yield "copy_pages", lambda: kv_copy.copy_pages(pool(), ids, pool(), ids.flip(0), 0, 2)
    yield "copy_pages_counted", lambda: kv_copy.copy_pages_counted(
        pool(), pool(), torch.tensor([2, 4, 1, 0, 3], dtype=i32), 0, 2, programs=16)


def _compile(fn, args: tuple, kwargs: dict) -> None:
    """triton.compile one recorded launch of JITFunction `fn` for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    bound = inspect.signature(fn.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for i, param in enumerate(fn.params):
        value = bound.arguments[param.name]
        # an int argument equal to 1 is a constant, as Triton's launch specializes it
        if param.is_constexpr or mangle_type(value, not param.do_not_specialize) == "constexpr":
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[param.name] = mangle_type(value)
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32), options=options)


def _with_pdl():
    """The cases whose kernels take programmatic dependent launch (kernels/_triton.py), again
    with it on, as a Hopper GPU has them (unless PD_SERVE_PDL=0)."""
    from kernels import (fp8_gemm, fp8_quant, gemv, kv_store, moe_batch1, moe_routing, norm,
                         paged_attention)
    pdl_modules = (fp8_gemm, fp8_quant, gemv, kv_store, moe_batch1, moe_routing, norm,
                   paged_attention)
    for name, call in _cases():
        def with_pdl(call=call):
            saved = [m.pdl for m in pdl_modules]
            for m in pdl_modules:
                m.pdl = lambda x: True
            try:
                call()
            finally:
                for m, f in zip(pdl_modules, saved):
                    m.pdl = f
        if name.split()[0] in ("rms_norm", "rope_store_kv", "decode", "prefill", "gemv", "moe",
                                   "fp8_gemm", "fp8"):
            yield f"{name}, PDL", with_pdl


def main() -> int:
    """Run every case, compile what it launched; print one line per case; 1 if any failed."""
    import itertools

    import triton.runtime.jit as jit
    launches = []
    jit.JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append(
        (self, args, kwargs))
    failed = 0
    for name, call in itertools.chain(_cases(), _with_pdl()):
        launches.clear()
        try:
            call()
            if not launches:
                raise AssertionError("no kernel launched")
            for fn, args, kwargs in launches:
                _compile(fn, args, dict(kwargs))
            print(f"ok   {name} ({len(launches)} launch(es))")
        except Exception as e:  # report every case, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[-1500:]}")
    return 1 if failed else 0


@needs_triton
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PD_SERVE_TRITON_CPU="1", PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", "import sys; from tests.kernels."
                           "test_compile_for_hopper import main; sys.exit(main())"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_pdl_on_by_default_on_a_gpu_only(monkeypatch):
    """Programmatic dependent launch is on unless PD_SERVE_PDL=0, and never for CPU tensors;
    launch_pdl is passed only when it is on (so Triton builds without it launch as before)."""
    from kernels import _triton
    x = torch.zeros(2)
    monkeypatch.delenv("PD_SERVE_PDL", raising=False)
    assert _triton.pdl_enabled() and not _triton.pdl(x)  # CPU
    monkeypatch.setenv("PD_SERVE_PDL", "0")
    assert not _triton.pdl_enabled()
    monkeypatch.setenv("PD_SERVE_PDL", "yes")
    with pytest.raises(ValueError, match="PD_SERVE_PDL must be 0 or 1"):
        _triton.pdl_enabled()
    assert _triton.launch_options(False) == {"PDL": False}
    assert _triton.launch_options(True) == {"PDL": True, "launch_pdl": True}
