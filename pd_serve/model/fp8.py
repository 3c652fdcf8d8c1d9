"""FP8 (e4m3) weights with per-channel scales, FP8 activations with per-token scales.

An FP8 linear layer of `in_features` inputs and `out_features` outputs holds

    weight        float8_e4m3fn [out, in]
    weight_scale  float32 [out]        W[n, k] = weight[n, k] * weight_scale[n]
    input_scale   float32 [1] or None  a static activation scale; None: dynamic, per token

A per-tensor checkpoint scale is spread over its channels at load (the same W), so fused
q/k/v parts with different scales need no requantization. Activations are quantized on the
fly: dynamically, token t's row is divided by s_t = max|x_t| / 448 and rounded to e4m3;
statically, by the checkpoint's `input_scale`. Then

    y[t, n] = s_t * weight_scale[n] * sum_k q[t, k] * weight[n, k]

`fp8_linear` runs one row on CUDA GPUs as kernels/gemv.py's GEMV when asked (gemv_one_row:
--enable-batch1-kernels): weight-only, x not rounded to FP8 (the GEMV's docstring says why).
On CUDA GPUs with FP8 tensor cores (compute capability 8.9+, bf16 activations) up to 64 rows
(a decode batch) run kernels/fp8_gemm.py, which reads the weight faster than cuBLAS there, and
more rows `torch._scaled_mm` (row-wise scales, float32 accumulation; K and N multiples of 16):
the same product, summed in another order. Everywhere else it runs
`fp8_linear_ref`: x quantized and dequantized per token, times the dequantized weight, so CPU
numbers carry the FP8 error of weights and activations alike.

Block-wise FP8 (quant_method "fp8" with `weight_block_size` [bn, bk], as DeepSeek-V3 and
Qwen3-FP8 ship) keeps `weight_scale_inv` float32 [ceil(out / bn), ceil(in / bk)] instead of
weight_scale and scales activations per token and bk-column group: kernels/fp8_block_gemm.py.

Checkpoints (what vLLM and SGLang load): config.json's `quantization_config` with
quant_method "fp8" (`activation_scheme` dynamic or static; per-tensor `weight_scale`, or
block-wise `weight_scale_inv`) or
"compressed-tensors" (format float-quantized: weights 8-bit float, strategy channel or tensor;
input activations 8-bit float, dynamic per token or static per tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import activation, fp8_gemm, fp8_quant
from kernels.fp8_quant import quantize_per_token
from kernels.gemv import gemv

# float8_e4m3fn, its largest value (448), the smallest scale (an all-zero row still gets a
# finite one): the activation kernel's, shared by the weights here
FP8_DTYPE, FP8_MAX, MIN_SCALE = fp8_quant.FP8_DTYPE, fp8_quant.FP8_MAX, fp8_quant.MIN_SCALE


@dataclass(frozen=True)
class Fp8Config:
    """How a model's FP8 layers are stored and fed."""

    checkpoint: bool = False  # weights stored in FP8; False: quantized at load (--quantization fp8)
    static_activation: bool = False  # activations scaled by the checkpoint's input_scale
    # block-wise weights ([bn, bk], e.g. [128, 128]: `weight_scale_inv` per block, activations
    # scaled per token and bk-column group, kernels/fp8_block_gemm.py); None: per channel
    weight_block_size: tuple[int, int] | None = None

    @classmethod
    def from_dict(cls, config: dict) -> Fp8Config:
        """Parse a checkpoint's `quantization_config` (quant_method "fp8" or
        "compressed-tensors"); ValueError names what is unsupported."""
        method = str(config.get("quant_method", "")).lower()
        if method == "fp8":
            scheme = config.get("activation_scheme", "dynamic")
            if scheme not in ("dynamic", "static"):
                raise ValueError(f"activation_scheme {scheme!r} is not dynamic or static")
            block = config.get("weight_block_size")
            if block is not None:
                if (not isinstance(block, (list, tuple)) or len(block) != 2
                        or not all(isinstance(b, int) and b > 0 for b in block)):
                    raise ValueError(f"weight_block_size {block!r} is not two positive ints")
                if scheme != "dynamic":
                    raise ValueError("block-wise FP8 weights take dynamic activation scales "
                                     f"(per token and group), not {scheme!r} ones")
                return cls(checkpoint=True, weight_block_size=(block[0], block[1]))
            return cls(checkpoint=True, static_activation=scheme == "static")
        if method == "compressed-tensors":
            return cls(checkpoint=True, static_activation=_compressed_tensors_static(config))
        raise ValueError(f"quant_method {method!r} is not fp8 or compressed-tensors")


def _compressed_tensors_static(config: dict) -> bool:
    """Whether a compressed-tensors FP8 config scales activations statically; ValueError for
    any scheme but FP8 weights (channel / tensor) with FP8 activations (token dynamic / tensor
    static)."""
    fmt = config.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; FP8 weights "
                         "(float-quantized) are")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors config has no config_groups")
    schemes = set()
    for name, group in groups.items():
        w, a = group.get("weights") or {}, group.get("input_activations")
        if not (w.get("num_bits") == 8 and w.get("type") == "float"
                and w.get("strategy") in ("channel", "tensor") and w.get("symmetric", True)):
            raise ValueError(f"compressed-tensors group {name!r}: weights {w} are not FP8 with "
                             "per-channel or per-tensor scales")
        if not a or a.get("num_bits") != 8 or a.get("type") != "float":
            raise ValueError(f"compressed-tensors group {name!r}: input_activations {a} are not "
                             "FP8 (weight-only FP8 is not supported)")
        if a.get("dynamic") is True and a.get("strategy") == "token":
            schemes.add(False)
        elif a.get("dynamic") is False and a.get("strategy") == "tensor":
            schemes.add(True)
        else:
            raise ValueError(f"compressed-tensors group {name!r}: activations {a} are neither "
                             "dynamic per token nor static per tensor")
    if len(schemes) > 1:
        raise ValueError("compressed-tensors groups mix static and dynamic activation scales")
    return schemes.pop()


# ----------------------------------------------------------------------------- quantize

def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 quantization of a dense weight.

    Parameters
    ----------
    weight : [out, in] float.

    Returns
    -------
    weight float8_e4m3fn [out, in]; weight_scale float32 [out] (max |row| / 448).
    """
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)  # [out]
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8 quantization of stacked experts: weight [E, out, in] -> (float8_e4m3fn
    [E, out, in], float32 scales [E, out]), each expert's rows as `quantize_weight`'s."""
    num_experts, out, inner = weight.shape
    q, scale = quantize_weight(weight.reshape(num_experts * out, inner))
    return q.reshape(num_experts, out, inner), scale.reshape(num_experts, out)


def quantize_activation(x: torch.Tensor, input_scale: torch.Tensor | None = None):
    """FP8 activations: x [T, K] -> (q float8_e4m3fn [T, K], scale float32 [T, 1], contiguous
    as _scaled_mm's row-wise scales must be).

    Dynamic (input_scale None): each token's own scale, max |x_t| / 448. Static: the scalar
    input_scale [1] for every token. No host syncs (CUDA-graph safe). One Triton kernel on
    GPU (kernels/fp8_quant.py), its torch reference elsewhere: the same bits either way.
    """
    x = x if x.stride(-1) == 1 else x.contiguous()
    return quantize_per_token(x, None if input_scale is None else input_scale.float())


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [out, in] weight of an FP8 layer, in `dtype` (computed in float32)."""
    return (weight.float() * weight_scale.float()[:, None]).to(dtype)


# ----------------------------------------------------------------------------- linear

def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
               dense: torch.Tensor | None = None, gemv_one_row: bool = False,
               silu_and_mul: bool = False) -> torch.Tensor:
    """`x @ W.T + bias` for an FP8 layer, with x quantized to FP8 per token (or statically).

    Parameters
    ----------
    x : [..., K] in the model dtype.
    weight : float8_e4m3fn [N, K]; weight_scale float32 [N]; input_scale float32 [1] or None.
    bias : [N] in the model dtype, or None.
    gemv_one_row : run a one-row x on CUDA through kernels/gemv.py (--enable-batch1-kernels),
        weight-only (x is not quantized there).
    dense : the layer's dequantized weight [N, K] in x's dtype, if the caller keeps one (the
        CPU does): the reference then skips dequantizing the weight on every call.
    silu_and_mul : the layer is the MLP's [gate | up] (N = 2I, no bias): return
        silu(gate) * up, [..., I]; the one-row GEMV computes it in its epilogue.

    Returns
    -------
    [..., N] (or [..., N / 2] with silu_and_mul) in x's dtype.
    """
    x2 = x.reshape(-1, x.shape[-1])  # [T, K]
    if gemv_one_row and dense is None and x2.shape[0] == 1 and x2.is_cuda:  # decode at batch 1
        # weight-only: no input scale
        out = gemv(x2, weight, weight_scale, bias, silu_and_mul=silu_and_mul)
    else:
        if dense is None and _use_few_rows_gemm(x2, weight):  # a decode batch of 2-64
            q, a_scale = quantize_activation(x2, input_scale)
            out = fp8_gemm.fp8_gemm(q, a_scale, weight, weight_scale, x2.dtype)
            out = out if bias is None else out + bias
        elif dense is None and _use_scaled_mm(x2, weight):
            out = fp8_linear_scaled_mm(x2, weight, weight_scale, input_scale, bias)
        else:
            out = fp8_linear_ref(x2, weight, weight_scale, input_scale, bias, dense=dense)
        if silu_and_mul:
            out = activation.silu_and_mul(out)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W.T on FP8 tensor cores: `torch._scaled_mm` with row-wise scales.

    weight.t() is the column-major [K, N] operand _scaled_mm wants. The bias is added after
    the product, in x's dtype. (torch also runs this on the CPU, which is how it is tested
    without a GPU.)
    """
    q, scale = quantize_activation(x, input_scale)  # [T, K], [T, 1]
    out = torch._scaled_mm(q, weight.t(), scale_a=scale,
                           scale_b=weight_scale.float().reshape(1, -1),  # [1, N]
                           out_dtype=x.dtype)
    return out if bias is None else out + bias


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                   dense: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of `fp8_linear`: x quantized to FP8 and back (per token or static),
    times the dequantized weight, in x's dtype."""
    q, scale = quantize_activation(x, input_scale)
    xq = (q.float() * scale).to(x.dtype)  # [T, K]: x with its FP8 rounding error
    w = dense if dense is not None else dequantize_weight(weight, weight_scale, x.dtype)
    return F.linear(xq, w, bias)


def scaled_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fp8_linear` runs on FP8 tensor cores for activations of `dtype` on `device`:
    CUDA, compute capability 8.9+, bf16 (row-wise scaled _scaled_mm writes bf16)."""
    return (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (8, 9))


def _use_few_rows_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """kernels/fp8_gemm.py for up to its MAX_ROWS rows on a GPU with FP8 tensor cores."""
    return (x.shape[0] <= fp8_gemm.MAX_ROWS and weight.is_contiguous()
            and scaled_mm_supported(x.device, x.dtype))


def _use_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`scaled_mm_supported`, and K and N multiples of 16."""
    return (scaled_mm_supported(x.device, x.dtype)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)
