"""The decoder's leaf layers, shared by llama.py's attention and MLP and mla.py's latent
attention: RMSNorm (kernels/norm.py, the residual add fused) and Linear (cuBLAS, or
kernels/gemv.py's GEMV for one-row calls under --enable-batch1-kernels)."""

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


class Linear(nn.Linear):
    """nn.Linear; with batch1_kernels set, one-row calls run the GEMV kernel on GPU."""

    batch1_kernels = False

    def forward(self, x: torch.Tensor, silu_and_mul: bool = False) -> torch.Tensor:
        """The layer on x; silu_and_mul: a [gate | up] layer (no bias) with its activation, in
        the GEMV's epilogue for one-row calls."""
        if silu_and_mul:
            return (linear_silu_and_mul(x, self.weight) if self.batch1_kernels
                    else activation.silu_and_mul(F.linear(x, self.weight)))
        return (linear if self.batch1_kernels else F.linear)(x, self.weight, self.bias)
