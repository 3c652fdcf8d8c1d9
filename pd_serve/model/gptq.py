"""INT4 weight-only GPTQ checkpoints: the config, the packed layout, and its torch reference.

A GPTQ linear layer of `in_features` inputs and `out_features` outputs is stored as four
tensors (the layout AutoGPTQ and GPTQModel write, and vLLM reads):

    qweight  int32 [in // 8, out]      8 4-bit values per int32 along the *input* dim;
                                       input row k is nibble k % 8 of qweight[k // 8]
    qzeros   int32 [n_groups, out // 8] 8 4-bit zero points per int32 along the *output* dim;
                                       column n is nibble n % 8 of qzeros[:, n // 8]
    scales   fp16  [n_groups, out]
    g_idx    int32 [in]                the group of each input row (k // group_size unless the
                                       checkpoint was quantized with act-order, desc_act)

Nibble j of an int32 is bits [4j, 4j + 4): the lowest bits hold the first value. The weight is

    W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]

where `zero` is the stored nibble plus 1 in the "gptq" checkpoint format (AutoGPTQ's v1: its
packer subtracts 1 from each zero point before packing, and every reader adds it back), or the
stored nibble itself in "gptq_v2" (GPTQModel's `format="gptq_v2"`). A v1 checkpoint therefore
cannot store a zero point of 0 (`quantize_rtn` keeps v1 zero points in [1, 15]), and a stored
nibble 15 reads as zero 16, as AutoGPTQ's readers do. Symmetric checkpoints (sym) use zero 8, stored as 0x77777777 in v1.

`dequantize` is the reference that every quantized path on the CPU runs through;
kernels/w4a16.py computes `x @ W.T` without ever materialising W on the GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

BITS = 4
PACK = 32 // BITS  # 4-bit values per int32
MAX_Q = (1 << BITS) - 1
SYM_ZERO = 1 << (BITS - 1)  # the zero point of a symmetric checkpoint
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> what a reader adds to stored zeros


@dataclass(frozen=True)
class GPTQConfig:
    """A checkpoint's GPTQ settings, from config.json's `quantization_config` or the
    quantize_config.json AutoGPTQ / GPTQModel write next to the weights."""

    group_size: int = 128  # -1: one group over all inputs (per output channel)
    sym: bool = True
    desc_act: bool = False  # act-order: g_idx is a permuted grouping
    checkpoint_format: str = "gptq"
    bits: int = BITS

    @classmethod
    def from_dict(cls, config: dict) -> GPTQConfig:
        """Parse and validate a quantization config; ValueError names what is unsupported."""
        if not isinstance(config, dict):
            raise TypeError(f"a GPTQ quantization config must be a dict, got {type(config)}")
        method = config.get("quant_method", config.get("method", "gptq"))
        if str(method).lower() != "gptq":
            raise ValueError(f"quant_method {method!r} is not 'gptq'")
        bits = config.get("bits")
        if bits != BITS or isinstance(bits, bool):
            raise ValueError(f"only 4-bit GPTQ checkpoints are supported, got bits={bits!r}")
        group_size = config.get("group_size", 128)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or not (
                group_size == -1 or group_size > 0):
            raise ValueError(f"group_size must be -1 or a positive int, got {group_size!r}")
        fmt = config.get("checkpoint_format", config.get("format", "gptq"))
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint format {fmt!r} is not one of "
                             f"{sorted(CHECKPOINT_FORMATS)}")
        if config.get("is_marlin_format"):
            raise ValueError("Marlin-repacked GPTQ checkpoints are not supported")
        pack_dtype = config.get("pack_dtype", "int32")
        if pack_dtype != "int32":
            raise ValueError(f"pack_dtype {pack_dtype!r} is not 'int32'")
        flags = {}
        for name, default in (("sym", True), ("desc_act", False)):
            value = config.get(name, default)
            if type(value) is not bool:
                raise ValueError(f"{name} must be true or false, got {value!r}")
            flags[name] = value
        return cls(group_size=group_size, checkpoint_format=fmt, **flags)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> GPTQConfig | None:
        """The GPTQ config of a model folder, or None when it is not GPTQ-quantized.

        config.json's `quantization_config` wins; quantize_config.json is the fallback.
        """
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if config_path.is_file():
            quant = json.loads(config_path.read_text()).get("quantization_config")
            if quant is not None:
                return cls.from_dict(quant)
        quant_path = model_dir / "quantize_config.json"
        if quant_path.is_file():
            return cls.from_dict(json.loads(quant_path.read_text()))
        return None

    @property
    def zero_offset(self) -> int:
        """What a reader adds to a stored zero point: 1 for "gptq" (v1), 0 for "gptq_v2"."""
        return CHECKPOINT_FORMATS[self.checkpoint_format]

    def group_size_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def num_groups(self, in_features: int) -> int:
        return -(-in_features // self.group_size_for(in_features))


# ----------------------------------------------------------------------------- packing

def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 4-bit values, 8 to an int32 along `dim`, the first in the lowest bits.

    Parameters
    ----------
    values : integer tensor with entries in [0, 15]; its size along `dim` a multiple of 8.

    Returns
    -------
    int32 tensor, `values`'s shape with `dim` divided by 8.
    """
    if values.is_floating_point() or values.dtype == torch.bool:
        raise ValueError(f"values must be an integer tensor, got {values.dtype}")
    if values.shape[dim] % PACK:
        raise ValueError(f"size {values.shape[dim]} along dim {dim} is not a multiple of {PACK}")
    moved = values.movedim(dim, -1).to(torch.int64)  # [..., n]
    nibbles = moved.reshape(*moved.shape[:-1], -1, PACK)  # [..., n / 8, 8]
    shifts = torch.arange(0, 32, BITS, device=values.device)  # [8]
    words = ((nibbles & MAX_Q) << shifts).sum(-1)  # [..., n / 8], in [0, 2**32)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as signed int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 values in [0, 15], `dim` multiplied by 8."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed must be int32, got {packed.dtype}")
    moved = packed.movedim(dim, -1)  # [..., n / 8]
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)  # [8]
    nibbles = (moved[..., None] >> shifts) & MAX_Q  # [..., n / 8, 8]
    return nibbles.reshape(*moved.shape[:-1], -1).movedim(-1, dim).contiguous()


def trivial_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """The g_idx of a checkpoint without act-order: input row k is in group k // group_size
    (group_size -1: one group). int32 [in_features]."""
    if group_size == -1:
        group_size = in_features
    return torch.arange(in_features, dtype=torch.int32, device=device) // group_size


def sort_act_order(qweight: torch.Tensor, g_idx: torch.Tensor):
    """Reorder an act-order layer's input rows so that each group's rows are contiguous.

    Load-time work (it syncs with the device). Row j of the result is input row perm[j] of
    the checkpoint, so `x[:, perm] @ W_sorted.T == x @ W.T`: kernels/w4a16.py takes `perm`
    and gathers x's columns, and the sorted layer runs the trivial-grouping fast path.

    Parameters
    ----------
    qweight : int32 [in / 8, out].
    g_idx : int [in].

    Returns
    -------
    qweight_sorted int32 [in / 8, out]; g_idx_sorted int32 [in], or None when it is the
    trivial grouping (every group of equal size, as GPTQ writes them); perm int32 [in].
    """
    perm = torch.argsort(g_idx.long(), stable=True)  # [in]
    rows = unpack_int4(qweight, dim=0)[perm]  # [in, out]
    g_sorted = g_idx[perm].to(torch.int32)
    in_features, num_groups = g_sorted.numel(), int(g_sorted[-1]) + 1
    trivial = in_features % num_groups == 0 and torch.equal(
        g_sorted, trivial_g_idx(in_features, in_features // num_groups, g_idx.device))
    return pack_int4(rows, dim=0), None if trivial else g_sorted, perm.to(torch.int32)


# ----------------------------------------------------------------------------- quantize

def quantize_rtn(weight: torch.Tensor, group_size: int, sym: bool, *,
                 g_idx: torch.Tensor | None = None, checkpoint_format: str = "gptq"):
    """Round-to-nearest 4-bit quantization of `weight`, packed in the GPTQ layout.

    How the tests make GPTQ checkpoints (GPTQ proper adds error feedback, not a new layout).
    Per group and output channel, over the group's input rows: sym uses scale
    2 * max|w| / 15 and zero 8; asym uses scale (max - min) / 15 and zero round(-min / scale),
    with min <= 0 <= max so that 0.0 is representable; v1 cannot store zero 0, so a v1 group
    whose zero point rounds to 0 takes zero 1 and scale max / 14 instead. Scales are rounded
    to fp16 before the weights are rounded against them, so every element is within half a
    scale of its dequantization (plus the fp16 rounding of the scale over the 15 steps).

    Parameters
    ----------
    weight : [out, in] float; in and out multiples of 8.
    group_size : input rows per group, or -1 for one group.
    sym : symmetric (zero 8) or asymmetric (a zero point per group and channel).
    g_idx : optional [in] ints, the group of each input row (an act-order checkpoint's
        permuted grouping); groups are numbered from 0 and each has at least one row.
        Default: `trivial_g_idx(in, group_size)`.
    checkpoint_format : "gptq" (v1, zero points stored minus one) or "gptq_v2".

    Returns
    -------
    qweight int32 [in / 8, out], qzeros int32 [n_groups, out / 8], scales fp16 [n_groups, out],
    g_idx int32 [in].
    """
    offset = zero_offset(checkpoint_format)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [out, in] matrix, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if in_features % PACK or out_features % PACK:
        raise ValueError(f"in and out features must be multiples of {PACK}, got "
                         f"{tuple(weight.shape)}")
    if g_idx is None:
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"group_size must be -1 or positive, got {group_size}")
        g_idx = trivial_g_idx(in_features, group_size, weight.device)
    if g_idx.shape != (in_features,):
        raise ValueError(f"g_idx must be [{in_features}], got {tuple(g_idx.shape)}")
    groups = g_idx.to(weight.device, torch.int64)  # [in]
    num_groups = int(groups.max()) + 1
    if int(groups.min()) < 0 or torch.bincount(groups, minlength=num_groups).min() == 0:
        raise ValueError("g_idx must number its groups 0..n-1, each with a row")

    w = weight.detach().float().t()  # [in, out]
    index = groups[:, None].expand_as(w)
    empty = w.new_zeros(num_groups, out_features)
    w_min = empty.scatter_reduce(0, index, w, "amin", include_self=False).clamp(max=0)
    w_max = empty.scatter_reduce(0, index, w, "amax", include_self=False).clamp(min=0)
    if sym:
        scale = torch.maximum(-w_min, w_max) * 2 / MAX_Q  # [G, out]
    else:
        scale = (w_max - w_min) / MAX_Q
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    if sym:
        zeros = torch.full_like(scale, SYM_ZERO)
    else:
        zeros = torch.round(-w_min / _fp16_scale(scale))  # [G, out], in [0, 15]
        if offset:  # v1 cannot store zero 0: those groups take zero 1 and range [-s, 14 s]
            low = zeros < offset
            scale = torch.where(low & (w_max > 0), w_max / (MAX_Q - offset), scale)
            zeros = torch.where(low, float(offset), zeros)
    scales = _fp16_scale(scale)
    q = torch.round(w / scales.float()[groups]) + zeros[groups]  # [in, out]
    q = q.clamp(0, MAX_Q).to(torch.int32)
    qzeros = pack_int4(zeros.to(torch.int32) - offset, dim=1)
    return pack_int4(q, dim=0), qzeros, scales, g_idx.to(torch.int32)


# ----------------------------------------------------------------------------- reference

def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
               g_idx: torch.Tensor | None = None, *, checkpoint_format: str = "gptq",
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight of a GPTQ layer: the reference of every quantized path.

    Parameters
    ----------
    qweight : int32 [in / 8, out].
    qzeros : int32 [n_groups, out / 8], or None for a symmetric checkpoint (zero 8).
    scales : float [n_groups, out].
    g_idx : int [in], or None for the trivial grouping (see `check_layout`).
    checkpoint_format : "gptq" (stored zeros are zero - 1) or "gptq_v2".
    dtype : of the result; default scales.dtype. Computed in float32.

    Returns
    -------
    W : [out, in], contiguous.
    """
    w = dequantize_t(qweight, qzeros, scales, g_idx, checkpoint_format=checkpoint_format)
    return w.t().to(dtype or scales.dtype).contiguous()


def dequantize_t(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                 g_idx: torch.Tensor | None = None, *,
                 checkpoint_format: str = "gptq") -> torch.Tensor:
    """`dequantize(...).T` in float32 as the checkpoint lays it out: [in, out], contiguous."""
    offset = zero_offset(checkpoint_format)
    in_features, _, num_groups = check_layout(qweight, qzeros, scales, g_idx)
    groups = (g_idx.long() if g_idx is not None  # [in]
              else trivial_g_idx(in_features, in_features // num_groups,
                                 qweight.device).long())
    q = unpack_int4(qweight, dim=0)  # [in, out]
    if qzeros is None:
        zeros = torch.full_like(scales, SYM_ZERO, dtype=torch.int32)
    else:
        zeros = unpack_int4(qzeros, dim=1) + offset  # [G, out]
    return (q - zeros[groups]).float() * scales.float()[groups]


def check_layout(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                 g_idx: torch.Tensor | None) -> tuple[int, int, int]:
    """Validate the shapes, dtypes and devices of a GPTQ layer's tensors.

    g_idx None means the trivial grouping, k // (in / n_groups), which needs n_groups to
    divide in; a layer whose group size does not divide in must pass its g_idx. g_idx values
    are not checked (that would sync with the device).

    Returns
    -------
    (in_features, out_features, num_groups)
    """
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [in / 8, out], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    in_features, out_features = qweight.shape[0] * PACK, qweight.shape[1]
    if out_features % PACK:
        raise ValueError(f"out_features {out_features} is not a multiple of {PACK}")
    if scales.dim() != 2 or scales.shape[1] != out_features or not scales.is_floating_point():
        raise ValueError(f"scales must be float [n_groups, {out_features}], got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    num_groups = scales.shape[0]
    if num_groups == 0 or num_groups > in_features:
        raise ValueError(f"{num_groups} groups for {in_features} input features")
    if qzeros is not None and (qzeros.dtype != torch.int32
                               or qzeros.shape != (num_groups, out_features // PACK)):
        raise ValueError(f"qzeros must be int32 [{num_groups}, {out_features // PACK}], got "
                         f"{qzeros.dtype} {tuple(qzeros.shape)}")
    if g_idx is None:
        if in_features % num_groups:
            raise ValueError(f"{num_groups} groups do not divide {in_features} input features; "
                             "pass g_idx")
    elif g_idx.shape != (in_features,) or g_idx.is_floating_point():
        raise ValueError(f"g_idx must be int [{in_features}], got {g_idx.dtype} "
                         f"{tuple(g_idx.shape)}")
    for name, t in (("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
        if t is not None and t.device != qweight.device:
            raise ValueError(f"{name} is on {t.device}, qweight on {qweight.device}")
    return in_features, out_features, num_groups


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scales as a checkpoint stores them: fp16, and never 0 (a weight is divided by it)."""
    return scale.to(torch.float16).clamp(min=torch.finfo(torch.float16).tiny)


def zero_offset(checkpoint_format: str) -> int:
    """What a reader adds to a stored zero point: 1 for gptq (v1 stores zero - 1), 0 for gptq_v2."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format {checkpoint_format!r} is not one of "
                         f"{sorted(CHECKPOINT_FORMATS)}")
    return CHECKPOINT_FORMATS[checkpoint_format]
