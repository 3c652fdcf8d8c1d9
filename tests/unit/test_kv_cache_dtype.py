"""--kv-cache-dtype: flag validation, per-layer scales from a checkpoint, FP8 store and attention
in the torch backend, and the layout check two workers run on each other."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file

from kernels.kv_store import quantize_ref, slotted_rows, store_kv_ref
from pd_serve.cache.kv_quant import kv_cache_dtype, load_kv_scales
from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.cli import build_parser, engine_config_from_args
from pd_serve.config import CacheConfig
from pd_serve.engine.attention.base import AttentionMetadata
from pd_serve.engine.attention.torch_backend import TorchAttentionBackend
from pd_serve.model.checkpoint import kv_scale_target, read_checkpoint_kv_scales
from pd_serve.transfer.base import layout_mismatch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NUM_LAYERS, PAGE_SIZE, NUM_PAGES, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 4, 24, 4, 2, 16


# ----------------------------------------------------------------------------- flags

def test_config_and_cli_accept_the_three_names_only():
    for name in ("auto", "fp8_e4m3", "fp8_e5m2"):
        assert CacheConfig(kv_cache_dtype=name).kv_cache_dtype == name
        args = build_parser().parse_args(["chat", "hi", "--kv-cache-dtype", name])
        assert engine_config_from_args(args).cache.kv_cache_dtype == name
    with pytest.raises(ValueError, match=r"--kv-cache-dtype 'int8' must be one of auto, "
                                         r"fp8_e4m3, fp8_e5m2"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "hi", "--kv-cache-dtype", "fp8"])
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.float32) == E4M3
    assert kv_cache_dtype("fp8_e5m2", torch.float32) == E5M2


def test_layout_bytes_and_scales():
    fp8 = KVLayout(3, 16, 2, 64, "float8_e4m3fn", k_scales=[0.5, 1, 2], v_scales=(1, 1, 4))
    bf16 = KVLayout(3, 16, 2, 64, "bfloat16")
    assert fp8.bytes_per_token * 2 == bf16.bytes_per_token == 3 * 2 * 2 * 64 * 2
    assert fp8.k_scales == (0.5, 1.0, 2.0) and fp8.v_scale(2) == 4.0  # lists become tuples
    assert bf16.k_scale(1) == 1.0 and bf16.v_scale(0) == 1.0
    with pytest.raises(ValueError, match="k_scales has 2 entries for 3 layers"):
        KVLayout(3, 16, 2, 64, "float8_e4m3fn", k_scales=(1.0, 1.0))


# ----------------------------------------------------------------------------- scales

def test_scale_names_vllm_modelopt_compressed_tensors():
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_target("model.layers.0.self_attn.kv_scale") == (0, "kv")
    assert kv_scale_target("model.layers.7.self_attn.attn.v_scale") == (7, "v")
    assert kv_scale_target("model.layers.2.self_attn.k_proj.k_scale") == (2, "k")
    assert kv_scale_target("model.layers.2.self_attn.v_proj.output_scale") == (2, "v")
    assert kv_scale_target("model.layers.2.self_attn.k_proj.weight") is None
    assert kv_scale_target("model.layers.2.self_attn.k_proj.weight_scale") is None


def test_scales_from_checkpoint_else_one_with_a_warning(tmp_path, caplog):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.25),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
               "model.layers.1.self_attn.kv_scale": torch.tensor(2.0, dtype=torch.bfloat16),
               "model.layers.2.self_attn.k_proj.k_scale": torch.tensor([0.1, 0.7, 0.3]),  # per head
               "model.embed_tokens.weight": torch.zeros(4, 4)},
              str(tmp_path / "model.safetensors"))
    found = read_checkpoint_kv_scales([tmp_path / "model.safetensors"])
    assert found == {(0, "k"): 0.25, (0, "v"): 0.5, (1, "k"): 2.0, (1, "v"): 2.0,
                     (2, "k"): pytest.approx(0.7)}
    with caplog.at_level(logging.WARNING, logger="pd_serve.cache.kv_quant"):
        k, v = load_kv_scales(tmp_path, 4, E4M3, "--kv-cache-dtype fp8_e4m3")
    assert k == (0.25, 2.0, pytest.approx(0.7), 1.0) and v == (0.5, 2.0, 1.0, 1.0)
    assert "KV scales for 5 of 8 K/V tensors; the rest use 1.0" in caplog.text
    assert load_kv_scales(tmp_path, 4, torch.bfloat16, "--kv-cache-dtype auto") == ((), ())
    with pytest.raises(ValueError, match="name layer 2; the model has 2 layers"):
        load_kv_scales(tmp_path, 2, E4M3, "x")

    bare = tmp_path / "bare"  # no safetensors at all (--load-format dummy)
    bare.mkdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pd_serve.cache.kv_quant"):
        assert load_kv_scales(bare, 2, E5M2, "--kv-cache-dtype fp8_e5m2") == ((1.0, 1.0),
                                                                              (1.0, 1.0))
    assert "no k_scale/v_scale tensors; using scale 1.0" in caplog.text
    assert "+-57344" in caplog.text

    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="k_scale' is 0.0; it must be finite and > 0"):
        load_kv_scales(tmp_path, 2, E4M3, "x")


# ----------------------------------------------------------------------------- store / dequant

@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=lambda d: str(d)[6:])
def test_quantise_round_trip_and_saturation(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 30
    fmax = torch.finfo(dtype).max
    bits = 3 if dtype == E4M3 else 2  # stored mantissa bits: half an ulp is 2 ** -(bits + 1)
    for scale in (1.0, 0.05, 3.0):
        back = quantize_ref(x, dtype, scale).float() * scale
        scaled = (x / scale).abs()
        normal = (scaled >= torch.finfo(dtype).smallest_normal) & (scaled <= fmax)
        rel = ((back - x).abs() / x.abs())[normal]
        assert rel.max() <= 2.0 ** -(bits + 1) + 1e-7
    huge = torch.tensor([1e6, -1e6, 5 * fmax, float("inf")])
    assert quantize_ref(huge, dtype).float().tolist() == [fmax, -fmax, fmax, fmax]
    assert quantize_ref(huge, dtype, 1e4).float()[0] == pytest.approx(100, rel=0.07)


def make_pool(dtype_name: str, k_scales=(), v_scales=()) -> KVPool:
    layout = KVLayout(NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype_name, k_scales,
                      v_scales)
    return KVPool(layout, NUM_PAGES, "cpu")


def batch() -> AttentionMetadata:
    """A prefill row of 9 new tokens and a decode row at context 6, on scattered pages."""
    tables = [[5, 2, 9], [7, 1]]
    slots = [tables[0][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(9)]
    slots += [tables[1][5 // PAGE_SIZE] * PAGE_SIZE + 5 % PAGE_SIZE]
    return AttentionMetadata([9, 1], [9, 6], tables, torch.tensor(slots))


def run(backend: TorchAttentionBackend, prefix: torch.Tensor, seed: int = 1) -> list:
    """Store the decode row's 5-token prefix, then run both layers over random q, k, v."""
    meta = batch()
    prefix_slots = torch.tensor([7 * PAGE_SIZE + p % PAGE_SIZE if p < 4 else PAGE_SIZE
                                 for p in range(5)])
    g = torch.Generator().manual_seed(seed)
    outs = []
    for layer in range(NUM_LAYERS):
        store_kv_ref(prefix[layer, 0], prefix[layer, 1], backend.pool.k_cache(layer),
                     backend.pool.v_cache(layer), prefix_slots, backend.k_scales[layer],
                     backend.v_scales[layer])
    backend.plan(meta)
    for layer in range(NUM_LAYERS):
        q = torch.randn(10, NUM_HEADS, HEAD_DIM, generator=g)
        k, v = (torch.randn(10, NUM_KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
        outs.append(backend.run(layer, q, k, v))
    return outs


@pytest.mark.parametrize("dtype_name, tolerance", [("float8_e4m3fn", 0.04),
                                                   ("float8_e5m2", 0.10)])
def test_torch_backend_fp8_close_to_fp32_and_equal_to_its_dequantised_pool(dtype_name, tolerance):
    prefix = torch.randn(NUM_LAYERS, 2, 5, NUM_KV_HEADS, HEAD_DIM,
                         generator=torch.Generator().manual_seed(2))
    scales = dict(k_scales=(0.02, 1.0), v_scales=(1.0, 0.125))
    fp8 = TorchAttentionBackend(make_pool(dtype_name, **scales), NUM_HEADS, HEAD_DIM, 0.25,
                                torch.float32)
    full = TorchAttentionBackend(make_pool("float32"), NUM_HEADS, HEAD_DIM, 0.25)
    ours, ref = run(fp8, prefix), run(full, prefix)
    for a, b in zip(ours, ref):  # relative error of the whole output
        assert a.dtype == torch.float32
        assert (a - b).norm() <= tolerance * b.norm()
    # The same pool dequantised into float32 (K * k_scale, V * v_scale), with the new tokens'
    # K/V already rounded through FP8: attention over it is the FP8 backend's, to float32 noise.
    deq = make_pool("float32")
    layout = fp8.pool.layout
    for layer in range(NUM_LAYERS):
        deq.buffer[layer, 0] = fp8.pool.buffer[layer, 0].float() * layout.k_scale(layer)
        deq.buffer[layer, 1] = fp8.pool.buffer[layer, 1].float() * layout.v_scale(layer)
    again = TorchAttentionBackend(deq, NUM_HEADS, HEAD_DIM, 0.25)
    again.plan(batch())
    g = torch.Generator().manual_seed(1)
    for layer in range(NUM_LAYERS):
        q = torch.randn(10, NUM_HEADS, HEAD_DIM, generator=g)
        torch.randn(20, NUM_KV_HEADS, HEAD_DIM, generator=g)  # k, v: stored already
        again.slotted = slotted_rows(torch.empty(0, dtype=torch.int64))  # store nothing
        k = v = torch.empty(0, NUM_KV_HEADS, HEAD_DIM)
        torch.testing.assert_close(again.run(layer, q, k, v), ours[layer], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- layout check

def test_layout_mismatch_names_the_kv_dtype_and_the_scales():
    fp32 = KVLayout(2, 16, 2, 64, "float32")
    fp8 = KVLayout(2, 16, 2, 64, "float8_e4m3fn", k_scales=(1.0, 1.0), v_scales=(1.0, 1.0))
    as_sent = lambda layout: {k: list(v) if isinstance(v, tuple) else v  # noqa: E731
                              for k, v in layout.__dict__.items()}  # as msgpack delivers it
    assert layout_mismatch(fp8, as_sent(fp8)) == ""
    error = layout_mismatch(fp32, as_sent(fp8))  # sender fp8, receiver fp32
    assert error == ("dtype 'float8_e4m3fn' != 'float32' (the KV cache dtype: start both with "
                     "the same --kv-cache-dtype (and --dtype))")
    other = KVLayout(2, 16, 2, 64, "float8_e4m3fn", k_scales=(1.0, 0.5), v_scales=(1.0, 1.0))
    error = layout_mismatch(fp8, as_sent(other))
    assert error.startswith("k_scales differ (layer 1: 0.5 != 1.0; FP8 KV scales come from")
    assert "v_scales" not in error
