"""The sparse MoE block of Mixtral, Qwen2-MoE and Qwen3-MoE decoder layers.

A router (`gate`, a bias-free linear layer) scores the experts; each token goes through its
top-k experts (kernels/fused_moe.py: softmax routing as transformers does it, renormalised
where the config's norm_topk_prob says, Mixtral always) and their outputs are summed with the
routing weights. Qwen2-MoE adds a shared expert, a dense MLP every token takes, scaled by a
sigmoid gate of its own. DeepSeek-V2/V3 route by groups (moe_routing.py; V3's
`gate.e_score_correction_bias`, float32 as transformers keeps it) and add their shared experts
ungated. Experts are stored fused as transformers 5 stores them: `experts.gate_up_proj`
[E, 2I, H] and `experts.down_proj` [E, H, I] (model/loader.py fills them from per-expert
checkpoint tensors). FP8 experts (`--quantization fp8` at load, or an FP8 checkpoint's
per-expert `weight` + `weight_scale`) hold them in float8_e4m3fn with per-channel scales
beside, and run weight-only (kernels/fused_moe.py); the router stays dense.

`backend` is `--moe-runner-backend`: "triton" (kernels/moe_routing.py's one-launch top-k, then
kernels/fused_moe.py's fused kernel; no host sync, so CUDA graphs capture them) or "torch" (its reference, a loop over the experts hit).
Under expert parallelism (`--ep-size`, model/parallel.py) a block holds a slice of the experts
from `expert_offset`, and every rank has the same tokens (attention is split by --tp or
replicated). Each rank takes its share of the tokens, dispatches their (token, expert) pairs to
the ranks holding those experts by all-to-all, runs the pairs it receives through its experts,
sends each pair's output back by a second all-to-all, and combines its tokens' pairs with their
routing weights; an all-gather gives every rank every token again. An expert sees its pairs in
token order, as on one rank, and the combine is fused_moe's, so the tokens round as on one
rank. The counts cross to the host: no CUDA graphs under EP.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fused_moe import fused_moe, fused_moe_ref, select_experts, sum_topk
from kernels.moe_routing import route, route_one_row
from pd_serve.config import MOE_RUNNER_BACKENDS
from pd_serve.model import fp8 as fp8_format
from pd_serve.model.config import ModelConfig
from pd_serve.model.layers import Linear
from pd_serve.model.moe_routing import grouped_topk, is_grouped


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
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # GEMV at batch 1
        self.grouped_cfg = cfg if is_grouped(cfg) else None  # DeepSeekMoE routing
        if cfg.topk_method == "noaux_tc":  # V3: a per-expert bias on the scores of the choice
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = shared_expert
        if shared_expert is not None and cfg.shared_experts_gated:
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.backend = "torch"  # set_moe_backend
        self.batch1_kernels = False  # forward_one_row (llama.use_batch1_kernels)
        # Expert parallelism (model/parallel.py): the group whose ranks hold the other experts,
        # and the first expert this one holds.
        self.ep = None
        self.expert_offset = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        if self.grouped_cfg is not None:
            topk_weights, topk_ids = grouped_topk(x, self.gate.weight, self.grouped_cfg,
                                                  getattr(self.gate, "e_score_correction_bias", None))
        else:  # triton: one routing launch (kernels/moe_routing.py); torch: the reference
            routing = route if self.backend == "triton" else select_experts
            topk_weights, topk_ids = routing(self.gate(x), self.top_k, self.renormalize)
        return self._experts(x, topk_weights, topk_ids)

    def takes_one_row(self, x: torch.Tensor) -> bool:
        """Whether `forward_one_row` serves x: one token, --enable-batch1-kernels, the Triton
        backend, softmax routing."""
        return (self.batch1_kernels and self.backend == "triton" and x.shape[0] == 1
                and self.grouped_cfg is None)

    def forward_one_row(self, x: torch.Tensor, residual: torch.Tensor,
                        norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's post-attention `norm` and this block for one token: (out, x + residual).
        The norm, the router and the routing are one launch (kernels/moe_routing.py's
        route_one_row), the experts two (kernels/moe_batch1.py)."""
        x, residual, topk_weights, topk_ids = route_one_row(
            x, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.renormalize)
        return self._experts(x, topk_weights, topk_ids, batch1=True), residual

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 batch1: bool = False) -> torch.Tensor:
        """The routed experts (and the shared one) for x [T, H] -> [T, H]."""
        if self.ep is None:
            one_token = {"batch1": True} if batch1 else {}  # fused_moe's (batch1: triton)
            out = self._run_experts()(x, self.experts.gate_up_proj, self.experts.down_proj,
                                      topk_weights, topk_ids, **self.experts.scales, **one_token)
        else:
            out = self._expert_parallel(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = getattr(self, "shared_expert_gate", None)
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out

    def _run_experts(self):
        return fused_moe if self.backend == "triton" else fused_moe_ref

    def _expert_parallel(self, x: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts over the EP ranks (module docstring): dispatch, experts, combine,
        all-gather. x [T, H] the same on every rank -> [T, H]."""
        ep, (num_tokens, top_k), hidden = self.ep, topk_ids.shape, x.shape[1]
        chunk = -(-num_tokens // ep.size)  # this rank's tokens: [start, start + chunk)
        mine = slice(ep.rank * chunk, (ep.rank + 1) * chunk)
        ids = topk_ids[mine].reshape(-1)  # [n * K]: pair p is token p // K's k-th choice
        dest = torch.div(ids, self.experts.gate_up_proj.shape[0], rounding_mode="floor")
        order = dest.argsort(stable=True)  # pairs by rank, token order within one
        send = torch.bincount(dest, minlength=ep.size)  # [ep]
        send_counts, recv_counts = send.tolist(), ep.all_to_all(send).tolist()  # host sync
        recv_x = ep.all_to_all(x[mine][order // top_k], send_counts, recv_counts)  # [m, H]
        recv_ids = ep.all_to_all(ids[order], send_counts, recv_counts)  # [m]
        ones = torch.ones(recv_ids.shape[0], 1, dtype=torch.float32, device=x.device)
        pairs = self._run_experts()(recv_x, self.experts.gate_up_proj, self.experts.down_proj,
                                    ones, recv_ids[:, None], self.expert_offset, reduce=False,
                                    **self.experts.scales)  # float32 [m, 1, H], exact in x's dtype
        back = ep.all_to_all(pairs[:, 0].to(x.dtype), recv_counts, send_counts)  # [n * K, H]
        outputs = torch.empty_like(back)
        outputs[order] = back  # pair order again
        weighted = outputs.float() * topk_weights[mine].reshape(-1, 1)
        combined = sum_topk(weighted.view(-1, top_k, hidden), x.dtype, True)  # [n, H], as fused_moe adds
        padded = x.new_zeros(chunk, hidden)
        padded[:combined.shape[0]] = combined
        return ep.all_gather(padded)[:num_tokens]


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

