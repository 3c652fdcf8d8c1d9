"""The decoder's leaf layers, shared by llama.py's attention and MLP and mla.py's latent
attention: RMSNorm (kernels/norm.py, the residual add fused) and Linear (cuBLAS, or
kernels/gemv.py's GEMV for one-row calls under --enable-batch1-kernels; on CPU, MKL or oneDNN
on a packed copy of the weight: cpu_linear)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import activation
from kernels.gemv import linear, linear_silu_and_mul
from kernels.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual)


# Calls whose rows run on the packed weight. MKL's sgemm packs the weight anew on every call,
# which at decode's few rows costs more than the product itself (SmolLM2-135M's decoder at 16
# rows, 2 cores: 37 against 28 ms a step); at one row and at prefill's thousands F.linear is as
# fast or faster.
CPU_PACKED_ROWS = range(2, 65)
_PACK_ROWS_HINT = 16  # the row count oneDNN lays the packed weight out for


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed layout of a float32 CPU weight [N, K] for cpu_linear (a second copy of
    it), or None: other dtypes and devices, or a torch built without oneDNN."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32
            or not torch.backends.mkldnn.is_available()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), on the packed weight for 2-D x of CPU_PACKED_ROWS rows.

    oneDNN sums in another order than MKL (1e-4 apart on SmolLM2's layers), the same order for
    every row count: a row's result does not depend on the rows beside it."""
    if packed is not None and x.dim() == 2 and x.shape[0] in CPU_PACKED_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear; with batch1_kernels set, one-row calls run the GEMV kernel on GPU; with
    cpu_packed set (llama.pack_cpu_weights), CPU calls go through cpu_linear."""

    batch1_kernels = False
    cpu_packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, silu_and_mul: bool = False) -> torch.Tensor:
        """The layer on x; silu_and_mul: a [gate | up] layer (no bias) with its activation, in
        the GEMV's epilogue for one-row calls."""
        if self.batch1_kernels:
            return (linear_silu_and_mul(x, self.weight) if silu_and_mul
                    else linear(x, self.weight, self.bias))
        y = cpu_linear(x, self.weight, self.bias, self.cpu_packed)
        return activation.silu_and_mul(y) if silu_and_mul else y
