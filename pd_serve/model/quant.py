"""Quantized linear layers, and how a checkpoint or `--quantization` chooses them.

Methods (named as vLLM and SGLang name them):

    gptq   INT4 weight-only GPTQ checkpoints (model/gptq.py), run by kernels/w4a16.py
    fp8    FP8 weights with FP8 activations (model/fp8.py): checkpoints whose quant_method is
           "fp8" or "compressed-tensors", or a 16/32-bit checkpoint quantized at load;
           "fp8" with weight_block_size: block-wise scales (Fp8BlockLinear)

The checkpoint's config.json (`quantization_config`, or GPTQ's quantize_config.json) decides;
`--quantization` may name the same method, or ask for `fp8` on an unquantized checkpoint.
Only the decoder's linear layers are quantized (qkv_proj, o_proj, gate_up_proj, down_proj);
embeddings, the LM head and norms stay in the model dtype, as biases do. A layer counts as
quantized in a checkpoint when its quantized tensors are there (`qweight`, `weight_scale`), so
a checkpoint's list of layers left in full precision needs no parsing.

On CUDA, GPTQ layers run the Triton W4A16 GEMM and FP8 layers `torch._scaled_mm`. Elsewhere
(the CPU) every layer runs its dequantized reference: the weight is dequantized once at load
(`QuantLinear.dense`, which costs the memory of the dense weight) and FP8 activations are
quantized and dequantized per token, so CPU figures carry the whole quantization error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels import activation
from kernels import fp8_block_gemm as block_gemm
from kernels.w4a16 import w4a16_matmul
from pd_serve.config import QUANTIZATIONS
from pd_serve.model import fp8
from pd_serve.model.layers import Linear
from pd_serve.model.gptq import (GPTQConfig, check_layout, dequantize_t, pack_int4,
                                 quantize_rtn, sort_act_order, trivial_g_idx, unpack_int4)

logger = logging.getLogger(__name__)
SUPPORTED = "gptq (4-bit), fp8, compressed-tensors (FP8 weights and activations)"


class QuantLinear(nn.Module):
    """`y = x @ W.T + bias` with W stored quantized, possibly several fused layers in one.

    Loading: `load(name, tensor, part)` for each checkpoint tensor of the layer (part: which
    of the fused layers, in `out_sizes` order, or None for all), then `finish_loading()` once.
    `missing()` names the tensors not loaded yet. The bias is an nn.Parameter in the model
    dtype; everything quantized is a buffer.
    """

    required: tuple[str, ...] = ()  # checkpoint tensor names every part must load

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_sizes = in_features, list(out_sizes)
        self.out_features = sum(out_sizes)
        self.dtype = dtype
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype)) if bias else None
        self.dense: torch.Tensor | None = None  # the dequantized weight [out, in], CPU only
        self._loaded: set[tuple[str, int]] = set()

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, part: int | None) -> None:
        """Copy one checkpoint tensor in; ValueError on a name or shape this layer lacks."""
        if name == "bias":
            if self.bias is None:
                if tensor.any():  # GPTQ writers store zero biases for bias-free layers
                    raise ValueError("a non-zero bias for a layer without one")
                return
            _copy(self._narrow(self.bias, 0, part), tensor)
        else:
            self._load(name, tensor, part)
        parts = range(len(self.out_sizes)) if part is None else [part]
        self._loaded.update((name, p) for p in parts)

    def missing(self) -> list[str]:
        names = self.required + (("bias",) if self.bias is not None else ())
        return [f"{n}#{p}" for n in names for p in range(len(self.out_sizes))
                if (n, p) not in self._loaded]

    def finish_loading(self, keep_dense: bool) -> None:
        """After every tensor is in: prepare the layer to run. keep_dense: dequantize the
        weight once and run the reference from it (the CPU)."""
        raise NotImplementedError

    def _load(self, name: str, tensor: torch.Tensor, part: int | None) -> None:
        raise NotImplementedError

    def _narrow(self, t: torch.Tensor, dim: int, part: int | None, pack: int = 1) -> torch.Tensor:
        """The slice of `t` along its output dim `dim` that holds `part` (divided by `pack`
        for packed dims)."""
        if part is None:
            return t
        start, size = sum(self.out_sizes[:part]), self.out_sizes[part]
        if start % pack or size % pack:
            raise ValueError(f"fused part of {size} outputs at {start} is not a multiple of {pack}")
        return t.narrow(dim, start // pack, size // pack)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_sizes={self.out_sizes}"


class GPTQLinear(QuantLinear):
    """A GPTQ INT4 layer: qweight, qzeros, scales, g_idx as model/gptq.py lays them out.

    Fused layers concatenate their parts along the output dim (one g_idx: the parts share
    their input). At load, an act-order g_idx is sorted away (`sort_act_order`: rows
    permuted, `perm` kept for x), and a trivial one is dropped so the kernel takes its fast
    path; a g_idx whose groups do not divide the input (576 inputs in groups of 128) stays.
    """

    required = ("qweight", "qzeros", "scales")

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 config: GPTQConfig, num_groups: int | None = None):
        """num_groups: the scales' rows, by default the config's for in_features (a shard of
        an act-order layer holds the groups its rows come from)."""
        super().__init__(in_features, out_sizes, bias, dtype)
        self.config = config
        num_groups, out = num_groups or config.num_groups(in_features), self.out_features
        self.register_buffer("qweight", torch.empty(in_features // 8, out, dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty(num_groups, out // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(num_groups, out, dtype=torch.float16))
        self.register_buffer("g_idx", None)
        self.register_buffer("perm", None)
        self._g_idx_parts: dict[int | None, torch.Tensor] = {}  # on the CPU until finish
        if config.desc_act:
            self.required = self.required + ("g_idx",)

    def _load(self, name, tensor, part):
        if name == "qweight":
            _copy(self._narrow(self.qweight, 1, part), tensor)
        elif name == "qzeros":
            _copy(self._narrow(self.qzeros, 1, part, pack=8), tensor)
        elif name == "scales":
            _copy(self._narrow(self.scales, 1, part), tensor)
        elif name == "g_idx":
            if tensor.shape != (self.in_features,) or tensor.is_floating_point():
                raise ValueError(f"g_idx must be int [{self.in_features}], got "
                                 f"{tensor.dtype} {tuple(tensor.shape)}")
            self._g_idx_parts[part] = tensor.to("cpu", torch.int32)
        else:
            raise ValueError(f"a GPTQ layer has no tensor {name!r}")

    @torch.no_grad()
    def finish_loading(self, keep_dense: bool) -> None:
        in_features, group_size = self.in_features, self.config.group_size_for(self.in_features)
        trivial = trivial_g_idx(in_features, group_size)
        parts = list(self._g_idx_parts.values())
        if any(not torch.equal(g, parts[0]) for g in parts[1:]):
            raise ValueError("the fused layers' g_idx differ")
        g_idx = parts[0] if parts else trivial
        if not torch.equal(g_idx, trivial):  # act-order
            self.qweight, self.g_idx, self.perm = sort_act_order(
                self.qweight, g_idx.to(self.qweight.device))
        elif in_features % group_size:
            self.g_idx = trivial.to(self.qweight.device)
        self._g_idx_parts = {}
        check_layout(self.qweight, self.qzeros, self.scales, self.g_idx)
        if keep_dense:
            w_t = dequantize_t(self.qweight, self.qzeros, self.scales, self.g_idx,
                               checkpoint_format=self.config.checkpoint_format)  # [in, out]
            if self.perm is not None:  # row j of w_t is input perm[j]
                w_t = torch.empty_like(w_t).index_copy_(0, self.perm.long(), w_t)
            self.dense = w_t.t().to(self.dtype).contiguous()  # [out, in]

    @torch.no_grad()
    def shard(self, rows: list[int] | None = None,
              columns: tuple[int, int] | None = None) -> GPTQLinear:
        """A tensor-parallel shard: output rows `rows` (runs of 8 from a multiple of 8, as
        qzeros packs them) with their scales, zeros and bias, or input columns [start,
        start + size) on group boundaries (their packed rows and their groups' scales and
        zeros; no bias: the row-parallel caller adds it after the all-reduce). ValueError for
        rows or columns off those boundaries. An act-order layer (or one whose groups do not
        divide its input) shards as its checkpoint would: `_shard_grouped`."""
        if self.perm is not None or self.g_idx is not None:
            return self._shard_grouped(rows, columns)
        qweight, qzeros, scales, bias = self.qweight, self.qzeros, self.scales, self.bias
        if rows is not None:
            qweight, qzeros, scales, bias = _gptq_rows(rows, qweight, qzeros, scales, bias)
        in_features = self.in_features
        if columns is not None:
            (start, in_features), group = columns, self.config.group_size_for(self.in_features)
            if self.config.group_size != -1:  # else one group: every shard keeps it
                if start % group or in_features % group:
                    raise ValueError(f"input columns [{start}, {start + in_features}) of a GPTQ "
                                     f"layer do not fall on its {group}-column groups; choose a "
                                     "--tp that splits the layer's input at group boundaries")
                scales = scales[start // group:(start + in_features) // group]
                qzeros = qzeros[start // group:(start + in_features) // group]
            qweight, bias = qweight[start // 8:(start + in_features) // 8], None
        g_idx = (trivial_g_idx(in_features, self.config.group_size_for(in_features))
                 if self.config.desc_act else None)  # a trivial g_idx, as this layer's was
        return self._new_shard(in_features, qweight, qzeros, scales, g_idx, bias)

    @torch.no_grad()
    def _shard_grouped(self, rows: list[int] | None, columns: tuple[int, int] | None) -> GPTQLinear:
        """`shard` of a layer with a g_idx: its rows back in the checkpoint's input order with
        their groups, sliced as the checkpoint would be, then loaded as a new layer, which
        sorts them by group again (finish_loading). A column shard's inputs may come from any
        group (act-order), so it keeps the groups its rows use, renumbered in order; they are
        then of unequal sizes, which the W4A16 kernel reads through g_idx row by row."""
        qweight, qzeros, scales, bias = self.qweight, self.qzeros, self.scales, self.bias
        g_idx = self.g_idx if self.g_idx is not None else trivial_g_idx(
            self.in_features, self.config.group_size_for(self.in_features), qweight.device)
        if self.perm is not None:  # sorted row j holds input perm[j]
            order = torch.argsort(self.perm.long())
            qweight, g_idx = pack_int4(unpack_int4(qweight, dim=0)[order], dim=0), g_idx[order]
        if rows is not None:
            qweight, qzeros, scales, bias = _gptq_rows(rows, qweight, qzeros, scales, bias)
        in_features = self.in_features
        if columns is not None:
            start, in_features = columns
            if start % 8 or in_features % 8:
                raise ValueError(f"input columns [{start}, {start + in_features}) of a GPTQ layer "
                                 "do not fall on its packing (8 rows to an int32)")
            qweight, g_idx, bias = qweight[start // 8:(start + in_features) // 8], \
                g_idx[start:start + in_features], None
            used = torch.unique(g_idx)  # sorted
            scales, qzeros = scales[used], qzeros[used]
            g_idx = torch.searchsorted(used, g_idx).to(torch.int32)
        return self._new_shard(in_features, qweight, qzeros, scales, g_idx, bias)

    def _new_shard(self, in_features: int, qweight, qzeros, scales, g_idx, bias) -> GPTQLinear:
        """A layer of this one's config loaded with a shard's tensors (g_idx, bias optional)."""
        with torch.device(qweight.device):
            layer = GPTQLinear(in_features, [qweight.shape[1]], bias is not None, self.dtype,
                               self.config, num_groups=scales.shape[0])
        tensors = (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx),
                   ("bias", bias))
        for name, tensor in tensors:
            if tensor is not None:
                layer.load(name, tensor.contiguous(), None)
        layer.finish_loading(keep_dense=self.dense is not None)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return F.linear(x, self.dense, self.bias)
        out = w4a16_matmul(x, self.qweight, self.qzeros, self.scales, self.g_idx, perm=self.perm,
                           checkpoint_format=self.config.checkpoint_format)
        return out if self.bias is None else out + self.bias

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, out_sizes: list[int], config: GPTQConfig,
                    keep_dense: bool) -> GPTQLinear:
        """Round-to-nearest quantization of a dense layer (random-weight benchmarks)."""
        w = linear.weight
        with torch.device(w.device):
            layer = cls(linear.in_features, out_sizes, linear.bias is not None, w.dtype, config)
        qweight, qzeros, scales, g_idx = quantize_rtn(
            w, config.group_size, config.sym, checkpoint_format=config.checkpoint_format)
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales),
                        ("g_idx", g_idx)) + ((("bias", linear.bias),) if linear.bias is not None else ()):
            layer.load(name, t, None)
        layer.finish_loading(keep_dense)
        return layer


def _gptq_rows(rows: list[int], qweight, qzeros, scales, bias):
    """Output rows `rows` of a GPTQ layer's tensors (runs of 8 from a multiple of 8, as qzeros
    packs them); ValueError otherwise."""
    if len(rows) % 8 or any(rows[i] % 8 or rows[i + 7] != rows[i] + 7
                            for i in range(0, len(rows), 8)):
        raise ValueError("a GPTQ layer's output rows shard in runs of 8 from a multiple "
                         "of 8 (its zeros are packed 8 to an int32)")
    index = torch.tensor(rows, device=qweight.device)
    return (qweight[:, index], qzeros[:, index[::8] // 8], scales[:, index],
            None if bias is None else bias[index])


class Fp8Linear(QuantLinear):
    """An FP8 layer: weight float8_e4m3fn [out, in], weight_scale float32 [out] and, with
    static activation scales, input_scale (one per fused part in the checkpoint; their max
    at run time, as vLLM does)."""

    required = ("weight", "weight_scale")
    batch1_kernels = False  # one-row calls on the GEMV kernel (llama.use_batch1_kernels)

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 config: fp8.Fp8Config):
        super().__init__(in_features, out_sizes, bias, dtype)
        self.config = config
        self.register_buffer("weight", torch.empty(self.out_features, in_features,
                                                   dtype=fp8.FP8_DTYPE))
        self.register_buffer("weight_scale", torch.empty(self.out_features, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty(len(out_sizes), dtype=torch.float32)
                             if config.static_activation else None)
        if config.static_activation:
            self.required = self.required + ("input_scale",)

    def _load(self, name, tensor, part):
        if name == "weight":
            if tensor.dtype != fp8.FP8_DTYPE:
                raise ValueError(f"weight is {tensor.dtype}; FP8 layers hold float8_e4m3fn")
            _copy(self._narrow(self.weight, 0, part), tensor)
        elif name == "weight_scale":
            dst = self._narrow(self.weight_scale, 0, part)
            scale = tensor.float().reshape(-1)
            if scale.numel() not in (1, dst.numel()):
                raise ValueError(f"weight_scale has {scale.numel()} values for {dst.numel()} "
                                 "channels; per-tensor and per-channel scales are supported")
            dst.copy_(scale.expand(dst.numel()))
        elif name == "input_scale":
            if self.input_scale is not None:  # a dynamic scheme ignores stored input scales
                if tensor.numel() != 1:
                    raise ValueError(f"input_scale has {tensor.numel()} values, not 1")
                dst = self.input_scale if part is None else self.input_scale[part:part + 1]
                dst.copy_(tensor.float().reshape(1).expand_as(dst))
        elif name == "weight_scale_inv":
            raise ValueError("block-wise FP8 scales (weight_scale_inv) in a checkpoint whose "
                             "quantization_config gives no weight_block_size")
        else:
            raise ValueError(f"an FP8 layer has no tensor {name!r}")

    @torch.no_grad()
    def finish_loading(self, keep_dense: bool) -> None:
        if self.input_scale is not None:
            self.input_scale = self.input_scale.max().reshape(1)
        if keep_dense:
            self.dense = fp8.dequantize_weight(self.weight, self.weight_scale, self.dtype)
        elif self.weight.is_cuda and not fp8.scaled_mm_supported(self.weight.device, self.dtype):
            logger.warning("FP8 layers run the dequantized reference on this GPU (slow): "
                           "_scaled_mm needs compute capability 8.9+ and --dtype bfloat16")

    def forward(self, x: torch.Tensor, silu_and_mul: bool = False) -> torch.Tensor:
        """The layer on x; silu_and_mul: a [gate | up] layer's activation too (fp8_linear)."""
        return fp8.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias,
                              dense=self.dense, gemv_one_row=self.batch1_kernels,
                              silu_and_mul=silu_and_mul)

    @torch.no_grad()
    def shard(self, rows: list[int] | None = None,
              columns: tuple[int, int] | None = None) -> Fp8Linear:
        """A tensor-parallel shard: output rows `rows` with their per-channel scales and bias,
        or input columns [start, start + size) (every channel's scale; no bias: the
        row-parallel caller adds it after the all-reduce). A static input scale is the
        layer's, on every shard; dynamic activation scales come from each shard's input."""
        weight, scale, bias = self.weight, self.weight_scale, self.bias
        if rows is not None:
            weight, scale, bias = _take_rows(rows, weight, scale, bias)
        in_features = self.in_features
        if columns is not None:
            start, in_features = columns
            weight, bias = weight[:, start:start + in_features], None
        with torch.device(weight.device):
            layer = Fp8Linear(in_features, [weight.shape[0]], bias is not None, self.dtype,
                              self.config)
        layer.load("weight", weight.contiguous(), None)
        layer.load("weight_scale", scale, None)
        if self.input_scale is not None:
            layer.load("input_scale", self.input_scale, None)
        if bias is not None:
            layer.load("bias", bias, None)
        layer.finish_loading(keep_dense=self.dense is not None)
        layer.batch1_kernels = self.batch1_kernels
        return layer

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, out_sizes: list[int], config: fp8.Fp8Config,
                    keep_dense: bool) -> Fp8Linear:
        """Quantize a dense layer: per-channel weight scales, dynamic activation scales."""
        w = linear.weight
        with torch.device(w.device):
            layer = cls(linear.in_features, out_sizes, linear.bias is not None, w.dtype, config)
        weight, scale = fp8.quantize_weight(w)
        layer.load("weight", weight, None)
        layer.load("weight_scale", scale, None)
        if linear.bias is not None:
            layer.load("bias", linear.bias, None)
        layer.finish_loading(keep_dense)
        return layer


class Fp8BlockLinear(QuantLinear):
    """A block-wise FP8 layer (`weight_block_size` [bn, bk], DeepSeek-V3 / Qwen3-FP8): weight
    float8_e4m3fn [out, in] and the checkpoint's `weight_scale_inv` [ceil(out / bn),
    ceil(in / bk)], kept per row here, [out, ceil(in / bk)] (a fused part need not start on a
    bn boundary), run by kernels/fp8_block_gemm.py with activations scaled per token and
    bk-column group. Stored input scales are ignored (dynamic activations)."""

    required = ("weight", "weight_scale_inv")

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 config: fp8.Fp8Config):
        super().__init__(in_features, out_sizes, bias, dtype)
        self.config, self.block = config, config.weight_block_size
        self.register_buffer("weight", torch.empty(self.out_features, in_features,
                                                   dtype=fp8.FP8_DTYPE))
        self.register_buffer("weight_scale_inv", torch.empty(
            self.out_features, -(-in_features // self.block[1]), dtype=torch.float32))

    def _load(self, name, tensor, part):
        if name == "weight":
            if tensor.dtype != fp8.FP8_DTYPE:
                raise ValueError(f"weight is {tensor.dtype}; FP8 layers hold float8_e4m3fn")
            _copy(self._narrow(self.weight, 0, part), tensor)
        elif name == "weight_scale_inv":
            dst = self._narrow(self.weight_scale_inv, 0, part)
            want = (-(-dst.shape[0] // self.block[0]), dst.shape[1])
            if tuple(tensor.shape) != want:
                raise ValueError(f"weight_scale_inv has shape {tuple(tensor.shape)}; blocks "
                                 f"{list(self.block)} of a [{dst.shape[0]}, {self.in_features}] "
                                 f"weight need {want}")
            dst.copy_(block_gemm.row_scales(tensor, dst.shape[0], self.block))
        elif name != "input_scale":
            raise ValueError(f"a block-wise FP8 layer has no tensor {name!r}")

    @torch.no_grad()
    def finish_loading(self, keep_dense: bool) -> None:
        if keep_dense:
            self.dense = block_gemm.dequantize_blocks(self.weight, self.weight_scale_inv,
                                                      self.block, self.dtype)

    @torch.no_grad()
    def shard(self, rows: list[int] | None = None,
              columns: tuple[int, int] | None = None) -> Fp8BlockLinear:
        """A tensor-parallel shard: output rows `rows` (any: the scales are kept per row;
        the bias goes with them) or input columns [start, start + size) (no bias: the
        row-parallel caller adds it after the all-reduce). A column shard must start on a bk
        block boundary and end on one or at the last column, so that no activation group
        straddles two ranks: ValueError otherwise."""
        weight, scale, bias = self.weight, self.weight_scale_inv, self.bias
        if rows is not None:
            weight, scale, bias = _take_rows(rows, weight, scale, bias)
        in_features = self.in_features
        if columns is not None:
            (start, size), bk = columns, self.block[1]
            if start % bk or ((start + size) % bk and start + size != self.in_features):
                raise ValueError(f"input columns [{start}, {start + size}) of a block-wise FP8 "
                                 f"layer do not fall on its {bk}-column blocks; choose a --tp "
                                 "that splits the layer's input at block boundaries")
            weight = weight[:, start:start + size]
            scale = scale[:, start // bk:-(-(start + size) // bk)]
            in_features, bias = size, None
        with torch.device(weight.device):
            layer = Fp8BlockLinear(in_features, [weight.shape[0]], bias is not None, self.dtype,
                                   self.config)
        layer.load("weight", weight.contiguous(), None)
        layer.weight_scale_inv.copy_(scale)
        layer._loaded.add(("weight_scale_inv", 0))
        if bias is not None:
            layer.load("bias", bias, None)
        layer.finish_loading(keep_dense=self.dense is not None)
        return layer

    @torch.no_grad()
    def to_dense(self) -> nn.Module:
        """The layer as a plain Linear of its dequantized weight (MLA's kv_b_proj, whose
        weight the attention backend reads itself)."""
        dense = Linear(self.in_features, self.out_features, bias=self.bias is not None,
                       device=self.weight.device, dtype=self.dtype)
        dense.weight.copy_(block_gemm.dequantize_blocks(self.weight, self.weight_scale_inv,
                                                        self.block, self.dtype))
        if self.bias is not None:
            dense.bias.copy_(self.bias)
        return dense.requires_grad_(False)

    def forward(self, x: torch.Tensor, silu_and_mul: bool = False) -> torch.Tensor:
        """The layer on x; silu_and_mul: a [gate | up] layer's activation too."""
        out = block_gemm.block_linear(x, self.weight, self.weight_scale_inv, self.block,
                                      self.bias, dense=self.dense)
        return activation.silu_and_mul(out) if silu_and_mul else out

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, out_sizes: list[int], config: fp8.Fp8Config,
                    keep_dense: bool) -> Fp8BlockLinear:
        """Quantize a dense layer block-wise (benchmarks, tests)."""
        w = linear.weight
        with torch.device(w.device):
            layer = cls(linear.in_features, out_sizes, linear.bias is not None, w.dtype, config)
        weight, scale_inv = block_gemm.quantize_blocks(w, config.weight_block_size)
        layer.load("weight", weight, None)
        layer.load("weight_scale_inv", scale_inv, None)
        if linear.bias is not None:
            layer.load("bias", linear.bias, None)
        layer.finish_loading(keep_dense)
        return layer


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


# ----------------------------------------------------------------------------- methods

def _take_rows(rows: list[int], weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None) -> tuple:
    """Output rows `rows` of an FP8 weight [out, in], of its per-row scales and of its bias."""
    index = torch.tensor(rows, device=weight.device)
    return weight[index], scale[index], None if bias is None else bias[index]


@dataclass(frozen=True)
class QuantMethod:
    """A model's quantization: which layer class, and whether the checkpoint holds the
    quantized tensors (else the dense weights are quantized once loaded)."""

    name: str  # "gptq" or "fp8"
    config: GPTQConfig | fp8.Fp8Config

    @property
    def checkpoint_quantized(self) -> bool:
        return self.name == "gptq" or self.config.checkpoint

    def in_checkpoint(self, hf_prefix: str, keys: set[str]) -> bool:
        """Whether the checkpoint stores layer `hf_prefix` (e.g. model.layers.0.mlp.up_proj)
        quantized."""
        marker = "qweight" if self.name == "gptq" else self.scale_name
        return f"{hf_prefix}.{marker}" in keys

    @property
    def block_wise(self) -> bool:
        return self.name == "fp8" and self.config.weight_block_size is not None

    @property
    def scale_name(self) -> str:
        """An FP8 layer's weight-scale tensor in the checkpoint."""
        return "weight_scale_inv" if self.block_wise else "weight_scale"

    @property
    def layer_class(self) -> type[QuantLinear]:
        return GPTQLinear if self.name == "gptq" else Fp8BlockLinear if self.block_wise else Fp8Linear

    def empty_linear(self, in_features: int, out_sizes: list[int], bias: bool,
                     dtype: torch.dtype) -> QuantLinear:
        return self.layer_class(in_features, out_sizes, bias, dtype, self.config)

    def quantize_linear(self, linear: nn.Linear, out_sizes: list[int],
                        keep_dense: bool) -> QuantLinear:
        return self.layer_class.from_linear(linear, out_sizes, self.config, keep_dense)


def quantization_method(model_dir: str | Path, requested: str | None) -> QuantMethod | None:
    """The quantization of a model folder under `--quantization requested` (None: whatever
    the checkpoint says). ValueError, naming the folder, for an unsupported quant_method or a
    flag that contradicts the checkpoint."""
    model_dir = Path(model_dir)
    if requested not in (None, *QUANTIZATIONS):
        raise ValueError(f"--quantization {requested!r} must be one of {', '.join(QUANTIZATIONS)}")
    quant = _checkpoint_quant_config(model_dir)
    if quant is None:
        if requested == "gptq":
            raise ValueError(f"--quantization gptq: {model_dir} is not a GPTQ checkpoint (no "
                             "quantization_config in config.json, no quantize_config.json)")
        return QuantMethod("fp8", fp8.Fp8Config()) if requested == "fp8" else None
    method = str(quant.get("quant_method", "")).lower()
    name = {"gptq": "gptq", "fp8": "fp8", "compressed-tensors": "fp8"}.get(method)
    if name is None:
        raise ValueError(f"{model_dir}: quant_method {method!r} is not supported; "
                         f"supported: {SUPPORTED}")
    if requested not in (None, name):
        raise ValueError(f"--quantization {requested} does not match {model_dir}, a {method} "
                         "checkpoint; leave --quantization out to use the checkpoint's")
    try:
        config = GPTQConfig.from_dict(quant) if name == "gptq" else fp8.Fp8Config.from_dict(quant)
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    return QuantMethod(name, config)


def _checkpoint_quant_config(model_dir: Path) -> dict | None:
    """config.json's quantization_config, else quantize_config.json (AutoGPTQ's, GPTQ)."""
    config_path = model_dir / "config.json"
    quant = json.loads(config_path.read_text()).get("quantization_config") \
        if config_path.is_file() else None
    if quant is None and (model_dir / "quantize_config.json").is_file():
        quant = {"quant_method": "gptq",
                 **json.loads((model_dir / "quantize_config.json").read_text())}
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(f"{model_dir}: quantization_config must be a JSON object")
    return quant
