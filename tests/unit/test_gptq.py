"""GPTQ INT4 layout: config parsing, packing, round-to-nearest quantization and the reference
dequantization, against the conventions AutoGPTQ / GPTQModel checkpoints use."""

from __future__ import annotations

import json

import pytest
import torch

from pd_serve.model import gptq

FORMATS = ["gptq", "gptq_v2"]


def random_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * 0.05  # [out, in]


def permuted_g_idx(in_features: int, group_size: int, seed: int) -> torch.Tensor:
    """An act-order grouping: groups of group_size rows, in a random order of the rows."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(in_features, generator=g)
    return gptq.trivial_g_idx(in_features, group_size)[perm]


def per_element_scale(scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    return scales.float()[g_idx.long()].t()  # [out, in]


# ----------------------------------------------------------------------------- config

def test_config_from_autogptq_dict():
    config = gptq.GPTQConfig.from_dict({"quant_method": "gptq", "bits": 4, "group_size": 128,
                                        "desc_act": True, "sym": False})
    assert config == gptq.GPTQConfig(group_size=128, sym=False, desc_act=True)
    assert config.zero_offset == 1 and config.checkpoint_format == "gptq"
    assert config.group_size_for(4096) == 128 and config.num_groups(4096) == 32


def test_config_gptqmodel_fields_and_per_channel():
    config = gptq.GPTQConfig.from_dict({"method": "gptq", "bits": 4, "group_size": -1,
                                        "format": "gptq_v2", "pack_dtype": "int32"})
    assert config.zero_offset == 0 and config.sym and not config.desc_act
    assert config.group_size_for(4096) == 4096 and config.num_groups(4096) == 1
    legacy = gptq.GPTQConfig.from_dict({"bits": 4, "group_size": 32,
                                        "checkpoint_format": "gptq"})
    assert legacy.group_size == 32 and legacy.zero_offset == 1


@pytest.mark.parametrize("bad", [
    {"quant_method": "awq", "bits": 4},
    {"bits": 8},
    {"bits": True},
    {"group_size": 128},  # bits missing
    {"bits": 4, "group_size": 0},
    {"bits": 4, "group_size": -2},
    {"bits": 4, "group_size": 12.5},
    {"bits": 4, "sym": "yes"},
    {"bits": 4, "desc_act": 1},
    {"bits": 4, "checkpoint_format": "marlin"},
    {"bits": 4, "is_marlin_format": True},
    {"bits": 4, "pack_dtype": "int16"},
], ids=str)
def test_config_rejects_unsupported(bad):
    with pytest.raises(ValueError):
        gptq.GPTQConfig.from_dict(bad)


def test_config_from_dir(tmp_path):
    assert gptq.GPTQConfig.from_dir(tmp_path) is None
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 64}))
    assert gptq.GPTQConfig.from_dir(tmp_path).group_size == 64
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}}))
    assert gptq.GPTQConfig.from_dir(tmp_path) == gptq.GPTQConfig(group_size=128, sym=False)


# ----------------------------------------------------------------------------- packing

@pytest.mark.parametrize("dim", [0, 1])
def test_pack_round_trip(dim):
    values = torch.randint(0, 16, (24, 16), generator=torch.Generator().manual_seed(0))
    packed = gptq.pack_int4(values, dim)
    assert packed.dtype == torch.int32
    assert packed.shape == ((3, 16) if dim == 0 else (24, 2))
    assert torch.equal(gptq.unpack_int4(packed, dim), values.to(torch.int32))


def test_pack_bit_layout():
    """Nibble j of a word is bits [4j, 4j + 4), the first value lowest; a high nibble of 15
    makes the int32 negative, as in real checkpoints."""
    column = torch.tensor([1, 2, 3, 4, 5, 6, 7, 15])[:, None]  # 8 input rows, 1 output column
    word = gptq.pack_int4(column, dim=0)
    assert word.shape == (1, 1) and word.item() == 0xF7654321 - (1 << 32)
    row = gptq.pack_int4(column.t(), dim=1)  # the same values along the output dim (qzeros)
    assert row.item() == word.item()


def test_pack_rejects_bad_sizes():
    with pytest.raises(ValueError):
        gptq.pack_int4(torch.zeros(12, 8, dtype=torch.int32), dim=0)
    with pytest.raises(ValueError):
        gptq.unpack_int4(torch.zeros(2, 8, dtype=torch.int64), dim=0)


# ----------------------------------------------------------------------------- quantization

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [128, 64, -1])
@pytest.mark.parametrize("act_order", [False, True], ids=["trivial", "act-order"])
def test_quantize_dequantize_error_within_half_a_scale(act_order, group_size, sym, fmt):
    out_features, in_features = 48, 256
    weight = random_weight(out_features, in_features, seed=1)
    g_idx = permuted_g_idx(in_features, group_size, seed=2) if act_order else None
    qweight, qzeros, scales, g_idx_out = gptq.quantize_rtn(weight, group_size, sym, g_idx=g_idx,
                                                           checkpoint_format=fmt)
    num_groups = 1 if group_size == -1 else in_features // group_size
    assert qweight.shape == (in_features // 8, out_features) and qweight.dtype == torch.int32
    assert qzeros.shape == (num_groups, out_features // 8) and qzeros.dtype == torch.int32
    assert scales.shape == (num_groups, out_features) and scales.dtype == torch.float16
    assert g_idx_out.shape == (in_features,) and g_idx_out.dtype == torch.int32
    if g_idx is not None:
        assert torch.equal(g_idx_out, g_idx.to(torch.int32))
    else:
        assert torch.equal(g_idx_out, gptq.trivial_g_idx(in_features, group_size))

    dense = gptq.dequantize(qweight, qzeros, scales, g_idx_out, checkpoint_format=fmt,
                            dtype=torch.float32)
    assert dense.shape == (out_features, in_features)
    # Half a scale, plus the fp16 rounding of the scale across the 15 steps of the range.
    bound = per_element_scale(scales, g_idx_out) * (0.5 + 15 * 2.0 ** -11)
    assert bool(((dense - weight).abs() <= bound).all())
    if act_order and group_size != -1:  # a wrong g_idx puts rows in other groups' scales
        wrong = gptq.dequantize(qweight, qzeros, scales, None, checkpoint_format=fmt,
                                dtype=torch.float32)
        assert not bool(((wrong - weight).abs() <= bound).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_nearly_nonnegative_groups_stay_within_half_a_scale(fmt):
    """Groups whose min is a sliver below 0 round their zero point to 0, which v1 cannot
    store: quantize_rtn widens those groups instead of clipping them."""
    g = torch.Generator().manual_seed(6)
    weight = torch.rand(16, 128, generator=g) - 0.01  # [out, in], min about -0.01
    qweight, qzeros, scales, g_idx = gptq.quantize_rtn(weight, 64, False, checkpoint_format=fmt)
    dense = gptq.dequantize(qweight, qzeros, scales, g_idx, checkpoint_format=fmt,
                            dtype=torch.float32)
    bound = per_element_scale(scales, g_idx) * (0.5 + 15 * 2.0 ** -11)
    assert bool(((dense - weight).abs() <= bound).all())
    zeros = gptq.unpack_int4(qzeros, dim=1) + (1 if fmt == "gptq" else 0)
    assert int(zeros.min()) == (1 if fmt == "gptq" else 0)


def test_sort_act_order_makes_groups_contiguous():
    weight = random_weight(16, 256, seed=7)
    g_idx = permuted_g_idx(256, 64, seed=8)
    qweight, qzeros, scales, g_idx = gptq.quantize_rtn(weight, 64, False, g_idx=g_idx)
    qweight_sorted, g_sorted, perm = gptq.sort_act_order(qweight, g_idx)
    assert g_sorted is None and perm.dtype == torch.int32
    dense = gptq.dequantize(qweight, qzeros, scales, g_idx)
    dense_sorted = gptq.dequantize(qweight_sorted, qzeros, scales, None)
    assert torch.equal(dense_sorted, dense[:, perm.long()])
    # Groups of unequal size stay non-trivial once sorted, and keep their g_idx.
    uneven = torch.tensor([1] * 8 + [0] * 24)
    qweight, qzeros, scales, uneven = gptq.quantize_rtn(random_weight(8, 32, 9), -1, True,
                                                        g_idx=uneven)
    qweight_sorted, g_sorted, perm = gptq.sort_act_order(qweight, uneven)
    assert torch.equal(g_sorted, torch.tensor([0] * 24 + [1] * 8, dtype=torch.int32))
    assert torch.equal(gptq.dequantize(qweight_sorted, qzeros, scales, g_sorted),
                       gptq.dequantize(qweight, qzeros, scales, uneven)[:, perm.long()])


@pytest.mark.parametrize("fmt, word", [("gptq", 0x77777777), ("gptq_v2", 0x88888888 - (1 << 32))])
def test_symmetric_zero_points_as_stored(fmt, word):
    """Zero 8: AutoGPTQ's v1 stores zero - 1, so a symmetric v1 checkpoint's qzeros are all
    0x77777777; v2 stores the zero itself. Without qzeros the reference assumes 8."""
    weight = random_weight(16, 128, seed=3)
    qweight, qzeros, scales, g_idx = gptq.quantize_rtn(weight, 128, True, checkpoint_format=fmt)
    assert bool((qzeros == word).all())
    dense = gptq.dequantize(qweight, qzeros, scales, g_idx, checkpoint_format=fmt)
    assert torch.equal(dense, gptq.dequantize(qweight, None, scales, g_idx))
    assert torch.equal(dense, gptq.dequantize(qweight, None, scales, None))


def test_v1_and_v2_differ_only_in_the_stored_zeros():
    weight = random_weight(16, 128, seed=4)
    v1 = gptq.quantize_rtn(weight, 64, False, checkpoint_format="gptq")
    v2 = gptq.quantize_rtn(weight, 64, False, checkpoint_format="gptq_v2")
    assert torch.equal(v1[0], v2[0]) and torch.equal(v1[2], v2[2])
    assert torch.equal(gptq.unpack_int4(v1[1], 1) + 1, gptq.unpack_int4(v2[1], 1))
    # Read with the wrong convention, every weight moves by one step of its scale.
    wrong = gptq.dequantize(v1[0], v1[1], v1[2], v1[3], checkpoint_format="gptq_v2",
                            dtype=torch.float32)
    right = gptq.dequantize(*v1, dtype=torch.float32)
    assert torch.allclose(wrong - right, per_element_scale(v1[2], v1[3]))


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 a checkpoint stores."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def test_dequantize_matches_a_hand_built_layer():
    """One group of 8 input rows and 8 output columns, packed word by word with explicit
    shifts: W[n, k] = (q[k, n] - zero[n]) * scale[n], zero = stored nibble + 1 in v1."""
    q = (torch.arange(8)[:, None] * 3 + torch.arange(8)[None, :] * 5) % 16  # [in 8, out 8]
    stored = torch.tensor([7, 0, 3, 15, 8, 1, 14, 6])  # [out 8], v1 nibbles
    qweight = torch.tensor([[sum(int(q[j, n]) << (4 * j) for j in range(8))
                             for n in range(8)]], dtype=torch.int64)  # [1, 8]
    qzeros = torch.tensor([[sum(int(stored[n]) << (4 * n) for n in range(8))]])  # [1, 1]
    scales = torch.tensor([[0.5, 0.25, 1, 2, 0.125, 3, 0.75, 1.5]], dtype=torch.float16)
    expected = ((q - (stored + 1)).float() * scales.float()).t()  # [out 8, in 8]
    dense = gptq.dequantize(as_int32(qweight), as_int32(qzeros), scales, dtype=torch.float32)
    assert torch.equal(dense, expected)
    assert torch.equal(gptq.pack_int4(q, dim=0), as_int32(qweight))


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_group_and_constant_weights(fmt):
    """A group of zeros dequantizes to zeros. A constant group c: asym takes min 0, so its
    range is [0, c] and c is exact in v2; v1 cannot store zero 0, takes zero 1 and range
    [-c / 14, c], where c is exact again. sym lands c on +7.5 steps, and its top code is +7."""
    weight = torch.zeros(8, 64)
    weight[:, 32:] = 0.75
    sym = gptq.dequantize(*gptq.quantize_rtn(weight, 32, True, checkpoint_format=fmt),
                          checkpoint_format=fmt, dtype=torch.float32)
    qweight, qzeros, scales, g_idx = gptq.quantize_rtn(weight, 32, False, checkpoint_format=fmt)
    asym = gptq.dequantize(qweight, qzeros, scales, g_idx, checkpoint_format=fmt,
                           dtype=torch.float32)
    assert torch.equal(sym[:, :32], weight[:, :32]) and torch.equal(asym[:, :32], weight[:, :32])
    assert torch.allclose(asym[:, 32:], weight[:, 32:], rtol=1e-3)
    assert torch.allclose(sym[:, 32:], weight[:, 32:] - 0.05, rtol=1e-3)  # scale 0.1
    stored = gptq.unpack_int4(qzeros, dim=1)[1]  # group 1
    assert bool((stored == 0).all())  # v1: zero 1 stored as 0; v2: zero 0 stored as 0


def _bad_layouts():
    qweight, qzeros, scales, g_idx = gptq.quantize_rtn(random_weight(16, 256, 5), 128, False)
    yield "qweight int64", lambda: gptq.dequantize(qweight.long(), qzeros, scales, g_idx)
    yield "scales of other width", lambda: gptq.dequantize(qweight, qzeros, scales[:, :8], g_idx)
    yield "qzeros of other groups", lambda: gptq.dequantize(qweight, qzeros[:1], scales, g_idx)
    yield "g_idx too short", lambda: gptq.dequantize(qweight, qzeros, scales, g_idx[:8])
    yield "g_idx float", lambda: gptq.dequantize(qweight, qzeros, scales, g_idx.float())
    yield "groups do not divide", lambda: gptq.dequantize(qweight, qzeros.repeat(3, 1),
                                                          scales.repeat(3, 1), None)
    yield "unknown format", lambda: gptq.dequantize(qweight, qzeros, scales, g_idx,
                                                    checkpoint_format="awq")
    yield "quantize in % 8", lambda: gptq.quantize_rtn(torch.randn(8, 12), -1, True)
    yield "quantize group 0", lambda: gptq.quantize_rtn(torch.randn(8, 16), 0, True)
    yield "quantize gap in groups", lambda: gptq.quantize_rtn(
        torch.randn(8, 16), 8, True, g_idx=torch.tensor([0] * 8 + [2] * 8))


@pytest.mark.parametrize("call", [pytest.param(c, id=name) for name, c in _bad_layouts()])
def test_rejects_bad_layouts(call):
    with pytest.raises(ValueError):
        call()
