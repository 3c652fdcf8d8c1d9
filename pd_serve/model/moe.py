"""The sparse MoE block of Mixtral, Qwen2-MoE and Qwen3-MoE decoder layers.

A router (`gate`, a bias-free linear layer) scores the experts; each token goes through its
top-k experts (kernels/fused_moe.py: softmax routing as transformers does it, renormalised
where the config's norm_topk_prob says, Mixtral always) and their outputs are summed with the
routing weights. Qwen2-MoE adds a shared expert, a dense MLP every token takes, scaled by a
sigmoid gate of its own. Experts are stored fused as transformers 5 stores them:
`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (model/loader.py fills
them from per-expert checkpoint tensors). FP8 experts (`--quantization fp8` at load, or an
FP8 checkpoint's per-expert `weight` + `weight_scale`) hold them in float8_e4m3fn with
per-channel scales beside, and run weight-only (kernels/fused_moe.py); the router stays dense.

`backend` is `--moe-runner-backend`: "triton" (kernels/fused_moe.py's fused kernel; no host
sync, so CUDA graphs capture it) or "torch" (its reference, a loop over the experts hit).
Under expert parallelism (`--ep-size`, model/parallel.py) a block holds a slice of the experts
from `expert_offset`; the ranks all-reduce their weighted (token, expert) pairs before the sum
over the top k, so the result rounds as on one rank.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fused_moe import fused_moe, fused_moe_ref, select_experts
from pd_serve.config import MOE_RUNNER_BACKENDS
from pd_serve.model import fp8 as fp8_format
from pd_serve.model.config import ModelConfig


class Experts(nn.Module):
    """Every expert's weights, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I].

    fp8: the weights in float8_e4m3fn with per-channel scales, gate_up_proj_scale float32
    [E, 2I] and down_proj_scale [E, H] (W[e, n, k] = weight[e, n, k] * scale[e, n]); else the
    scales are None."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 fp8: bool = False):
        super().__init__()
        dtype = fp8_format.FP8_DTYPE if fp8 else None
        shapes = {"gate_up_proj": (num_experts, 2 * intermediate_size, hidden_size),
                  "down_proj": (num_experts, hidden_size, intermediate_size)}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=not fp8))
            self.register_parameter(f"{name}_scale", nn.Parameter(
                torch.empty(shape[:2], dtype=torch.float32), requires_grad=False) if fp8 else None)

    @property
    def scales(self) -> dict:
        """fused_moe's FP8 keyword arguments (None for dense experts)."""
        return {"w13_scale": self.gate_up_proj_scale, "w2_scale": self.down_proj_scale}

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """`--quantization fp8` at load: the dense weights to FP8, per-channel scales."""
        for name in ("gate_up_proj", "down_proj"):
            weight, scale = fp8_format.quantize_experts(getattr(self, name))
            setattr(self, name, nn.Parameter(weight, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None):
        """shared_expert: Qwen2-MoE's dense MLP beside the experts (None: none)."""
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.backend = "torch"  # set_moe_backend
        # Expert parallelism (model/parallel.py): the group whose ranks hold the other experts,
        # and the first expert this one holds.
        self.ep = None
        self.expert_offset = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self._run_experts()(x, self.experts.gate_up_proj, self.experts.down_proj,
                                  topk_weights, topk_ids, self.expert_offset,
                                  reduce=self.ep is None, **self.experts.scales)
        if self.ep is not None:  # every rank's pairs [T, K, H], then the sum over K
            out = self.ep.all_reduce(out).sum(dim=1).to(x.dtype)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _run_experts(self):
        return fused_moe if self.backend == "triton" else fused_moe_ref


def resolve_moe_backend(name: str, device: torch.device) -> str:
    """--moe-runner-backend: auto is triton on CUDA, torch elsewhere. Triton on the CPU runs in
    its interpreter under PD_SERVE_TRITON_CPU=1, else the reference (kernels/fused_moe.py)."""
    if name not in MOE_RUNNER_BACKENDS:
        raise ValueError(f"--moe-runner-backend {name!r} must be one of "
                         f"{', '.join(MOE_RUNNER_BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def set_moe_backend(model: nn.Module, backend: str) -> bool:
    """Every MoE block of `model` runs its experts on `backend` (triton or torch); returns
    whether the model has any."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        block.backend = backend
    return bool(blocks)

