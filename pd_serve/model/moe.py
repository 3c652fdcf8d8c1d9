"""The sparse MoE block of Mixtral, Qwen2-MoE and Qwen3-MoE decoder layers.

A router (`gate`, a bias-free linear layer) scores the experts; each token goes through its
top-k experts (kernels/fused_moe.py: softmax routing as transformers does it, renormalised
where the config's norm_topk_prob says, Mixtral always) and their outputs are summed with the
routing weights. Qwen2-MoE adds a shared expert, a dense MLP every token takes, scaled by a
sigmoid gate of its own. DeepSeek-V2/V3 route by groups (moe_routing.py; V3's
`gate.e_score_correction_bias`, float32 as transformers keeps it) and add their shared experts
ungated. Experts are stored fused as transformers 5 stores them: `experts.gate_up_proj`
[E, 2I, H] and `experts.down_proj` [E, H, I] (model/loader.py fills them from per-expert
checkpoint tensors).

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
from pd_serve.model.config import ModelConfig
from pd_serve.model.moe_routing import grouped_topk, is_grouped


class Experts(nn.Module):
    """Every expert's weights, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None):
        """shared_expert: Qwen2-MoE's dense MLP beside the experts (None: none)."""
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.grouped_cfg = cfg if is_grouped(cfg) else None  # DeepSeekMoE routing
        if cfg.topk_method == "noaux_tc":  # V3: a per-expert bias on the scores of the choice
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = shared_expert
        if shared_expert is not None and cfg.shared_experts_gated:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.backend = "torch"  # set_moe_backend
        # Expert parallelism (model/parallel.py): the group whose ranks hold the other experts,
        # and the first expert this one holds.
        self.ep = None
        self.expert_offset = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        if self.grouped_cfg is not None:
            topk_weights, topk_ids = grouped_topk(x, self.gate.weight, self.grouped_cfg,
                                                  getattr(self.gate, "e_score_correction_bias", None))
        else:
            topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self._run_experts()(x, self.experts.gate_up_proj, self.experts.down_proj,
                                  topk_weights, topk_ids, self.expert_offset,
                                  reduce=self.ep is None)
        if self.ep is not None:  # every rank's pairs [T, K, H], then the sum over K
            out = self.ep.all_reduce(out).sum(dim=1).to(x.dtype)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = getattr(self, "shared_expert_gate", None)
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
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

