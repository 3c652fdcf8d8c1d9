"""Quantized linear layers (model/quant.py, model/fp8.py) against their references, and the
choice of a quantization method from config.json and --quantization."""

from __future__ import annotations

import json

import pytest
import torch

from pd_serve.config import EngineConfig
from pd_serve.model import fp8
from pd_serve.model.gptq import GPTQConfig, dequantize, quantize_rtn
from pd_serve.model.quant import Fp8Linear, GPTQLinear, quantization_method


def _model_dir(tmp_path, quantization_config=None, name="m"):
    d = tmp_path / name
    d.mkdir()
    config = {"architectures": ["LlamaForCausalLM"]}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (d / "config.json").write_text(json.dumps(config))
    return d


# ----------------------------------------------------------------------------- method choice

def test_method_from_checkpoint_and_flag(tmp_path):
    plain = _model_dir(tmp_path, name="plain")
    assert quantization_method(plain, None) is None
    at_load = quantization_method(plain, "fp8")
    assert at_load.name == "fp8" and not at_load.checkpoint_quantized
    gptq = _model_dir(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                 "desc_act": True, "sym": False}, name="gptq")
    for flag in (None, "gptq"):
        method = quantization_method(gptq, flag)
        assert method.name == "gptq" and method.config.desc_act and not method.config.sym
    ct = _model_dir(tmp_path, {"quant_method": "compressed-tensors", "format": "float-quantized",
                               "config_groups": {"g": {
                                   "weights": {"num_bits": 8, "type": "float",
                                               "strategy": "channel"},
                                   "input_activations": {"num_bits": 8, "type": "float",
                                                         "strategy": "tensor", "dynamic": False}}}},
                    name="ct")
    method = quantization_method(ct, "fp8")
    assert method.name == "fp8" and method.checkpoint_quantized and method.config.static_activation
    legacy = tmp_path / "legacy"  # AutoGPTQ's quantize_config.json beside a plain config.json
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    (legacy / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 64}))
    assert quantization_method(legacy, None).config.group_size == 64


@pytest.mark.parametrize("quant, flag, message", [
    (None, "gptq", "is not a GPTQ checkpoint"),
    ({"quant_method": "gptq", "bits": 4}, "fp8", "does not match"),
    ({"quant_method": "awq", "bits": 4}, None, "supported: gptq"),
    ({"quant_method": "gptq", "bits": 8}, None, "only 4-bit"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, None, "two positive ints"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     None, "dynamic activation"),
    ({"quant_method": "fp8", "activation_scheme": "mixed"}, None, "activation_scheme"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, None, "pack-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}, None,
     "weight-only FP8"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True}}}}, None, "per-channel or per-tensor"),
])
def test_method_errors_name_the_problem(tmp_path, quant, flag, message):
    with pytest.raises(ValueError, match=message):
        quantization_method(_model_dir(tmp_path, quant), flag)


def test_engine_config_checks_the_flag():
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="--quantization 'int8' must be one of fp8, gptq"):
        EngineConfig(quantization="int8")


# ----------------------------------------------------------------------------- FP8

def test_fp8_weight_quantization_is_per_channel():
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different size
    q, scale = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48,)
    assert torch.equal(q.float().abs().amax(1), torch.full((48,), 448.0))
    rel = (fp8.dequantize_weight(q, scale) - w).abs() / w.abs().amax(1, keepdim=True)
    assert rel.max() < 2 ** -4  # e4m3: 3 mantissa bits, half a step of the largest binade


@pytest.mark.parametrize("static", [False, True])
def test_fp8_scaled_mm_matches_the_reference(static):
    """torch._scaled_mm with row-wise scales (the CUDA path; torch runs it on the CPU too)
    against the dequantized reference the CPU model runs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen) * torch.logspace(-2, 1, 7)[:, None]
    weight, scale = fp8.quantize_weight(torch.randn(32, 64, generator=gen))
    input_scale = (x.abs().max() / 448).reshape(1) if static else None  # calibrated on x
    bias = torch.randn(32, generator=gen)
    ref = fp8.fp8_linear_ref(x, weight, scale, input_scale, bias)
    out = fp8.fp8_linear_scaled_mm(x, weight, scale, input_scale, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dense = fp8.dequantize_weight(weight, scale)
    assert torch.equal(fp8.fp8_linear(x, weight, scale, input_scale, bias, dense=dense), ref)
    err = (ref - (x @ dense.T + bias)).norm() / ref.norm()  # what activation rounding costs
    assert 0 < err < 0.05


def test_fp8_linear_fused_parts_and_static_scales():
    """Per-tensor scales of q/k/v spread over their channels; input_scale is their max."""
    sizes, gen = [16, 8, 8], torch.Generator().manual_seed(1)
    layer = Fp8Linear(64, sizes, bias=True, dtype=torch.float32,
                      config=fp8.Fp8Config(checkpoint=True, static_activation=True))
    dense, bias = [], torch.randn(32, generator=gen)
    for part, (n, s_in) in enumerate(zip(sizes, (0.5, 2.0, 1.0))):
        w = torch.randn(n, 64, generator=gen)
        scale = w.abs().max() / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        dense.append(q.float() * scale)
        for name, t in (("weight", q), ("weight_scale", scale.reshape(1)),
                        ("input_scale", torch.tensor([s_in])), ("bias", bias.split(sizes)[part])):
            layer.load(name, t, part)
    assert layer.missing() == []
    layer.finish_loading(keep_dense=True)
    assert torch.equal(layer.input_scale, torch.tensor([2.0]))
    torch.testing.assert_close(layer.dense, torch.cat(dense))
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(layer(x), fp8.fp8_linear_ref(x, layer.weight, layer.weight_scale,
                                                            layer.input_scale, bias))


def test_fp8_linear_rejects_wrong_tensors():
    layer = Fp8Linear(64, [32], bias=False, dtype=torch.float32, config=fp8.Fp8Config(True))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        layer.load("weight", torch.randn(32, 64), None)
    with pytest.raises(ValueError, match="per-tensor and per-channel"):
        layer.load("weight_scale", torch.ones(2, 2), None)
    with pytest.raises(ValueError, match="block-wise"):
        layer.load("weight_scale_inv", torch.ones(1, 1), None)
    with pytest.raises(ValueError, match="non-zero bias"):
        layer.load("bias", torch.ones(32), None)
    layer.load("bias", torch.zeros(32), None)  # GPTQ-style zero biases are skipped
    assert layer.missing() == ["weight#0", "weight_scale#0"]


# ----------------------------------------------------------------------------- GPTQ

def _gptq_parts(sizes, in_features, group_size, sym, g_idx, fmt="gptq", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [quantize_rtn(torch.randn(n, in_features, generator=gen), group_size, sym,
                         g_idx=g_idx, checkpoint_format=fmt) for n in sizes]


@pytest.mark.parametrize("in_features, act_order, sym, fmt", [
    (256, False, True, "gptq"),      # trivial g_idx, dropped: the kernel's fast path
    (192, False, False, "gptq"),     # 192 inputs in groups of 128: g_idx kept
    (256, True, False, "gptq_v2"),   # act-order: rows sorted at load, perm kept
])
def test_gptq_linear_fused_parts(in_features, act_order, sym, fmt, monkeypatch):
    """q/k/v parts concatenated along the output dim == each part's own dequantization; the
    kernel path (reference on the CPU, and Triton's interpreter) == the dense path."""
    sizes, group_size = [32, 16, 16], 128
    g_idx = None
    if act_order:
        order = torch.randperm(in_features, generator=torch.Generator().manual_seed(3))
        g_idx = torch.empty(in_features, dtype=torch.int32)
        g_idx[order] = torch.arange(in_features, dtype=torch.int32) // group_size
    parts = _gptq_parts(sizes, in_features, group_size, sym, g_idx, fmt)
    config = GPTQConfig(group_size=group_size, sym=sym, desc_act=act_order, checkpoint_format=fmt)
    layer = GPTQLinear(in_features, sizes, bias=True, dtype=torch.float32, config=config)
    bias = torch.randn(64)
    for part, (qweight, qzeros, scales, g) in enumerate(parts):
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales),
                        ("g_idx", g), ("bias", bias.split(sizes)[part])):
            layer.load(name, t, part)
    layer.finish_loading(keep_dense=True)
    assert (layer.perm is not None) == act_order
    assert (layer.g_idx is None) == (in_features % group_size == 0)  # sorted: trivial again
    expected = torch.cat([dequantize(*p, checkpoint_format=fmt, dtype=torch.float32)
                          for p in parts])
    torch.testing.assert_close(layer.dense, expected)
    x = torch.randn(3, in_features)
    dense_out = layer(x)
    torch.testing.assert_close(dense_out, x @ expected.T + bias)
    layer.dense = None  # the path CUDA runs: w4a16_matmul (its torch reference here) ...
    torch.testing.assert_close(layer(x), dense_out, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")  # ... and its Triton kernel, interpreted
    from kernels import w4a16
    launches = w4a16.triton_launches
    torch.testing.assert_close(layer(x), dense_out, rtol=1e-3, atol=1e-3)
    assert w4a16.triton_launches > launches


def test_gptq_linear_checks():
    config = GPTQConfig(desc_act=True)
    layer = GPTQLinear(256, [32, 32], bias=False, dtype=torch.float32, config=config)
    assert "g_idx#1" in layer.missing()  # act-order needs g_idx
    with pytest.raises(ValueError, match=r"shape \(3, 4\), expected \(2, 4\)"):
        layer.load("qzeros", torch.zeros(3, 4, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="no tensor 'weight'"):
        layer.load("weight", torch.zeros(32, 256), 0)
    a, b = torch.arange(256, dtype=torch.int32) // 128, torch.arange(256, dtype=torch.int32) % 2
    for part, g in enumerate((a, b)):
        qweight, qzeros, scales, _ = _gptq_parts([32], 256, 128, True, g, seed=part)[0]
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales),
                        ("g_idx", g)):
            layer.load(name, t, part)
    with pytest.raises(ValueError, match="g_idx differ"):
        layer.finish_loading(keep_dense=True)
