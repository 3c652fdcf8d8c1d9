"""DeepSeekMoE's routing: group-limited top-k, sigmoid scoring, a bias for the choice only.

The router's logits are float32 (x and the router weight both cast, as transformers keeps
DeepSeek's router in float32). Scores are their softmax (V2) or sigmoid (V3). The experts form
n_group equal groups; `topk_method` picks:
  greedy                the top_k scores;
  group_limited_greedy  (V2) the top_k among the topk_group groups of highest max score;
  noaux_tc              (V3) the top_k of score + e_score_correction_bias among the topk_group
                        groups of highest sum of their two best biased scores; the weights are
                        the unbiased scores of those experts.
The weights are renormalised to sum 1 where norm_topk_prob says (V3), then multiplied by
routed_scaling_factor. Masked experts score 0 (V2) or -inf (V3), as transformers masks them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pd_serve.model.config import ModelConfig


def grouped_topk(x: torch.Tensor, gate_weight: torch.Tensor, cfg: ModelConfig,
                 correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate_weight [E, H] -> (topk_weights float32 [T, K], topk_ids int64 [T, K])."""
    logits = F.linear(x.float(), gate_weight.float())  # [T, E]
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    num_experts, top_k = scores.shape[1], cfg.num_experts_per_tok
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.topk_method in ("group_limited_greedy", "noaux_tc"):
        grouped = choice.view(-1, cfg.n_group, num_experts // cfg.n_group)  # [T, G, E/G]
        group_scores = (grouped.max(dim=-1).values if cfg.topk_method == "group_limited_greedy"
                        else grouped.topk(2, dim=-1).values.sum(dim=-1))  # [T, G]
        group_ids = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
        expert_mask = group_mask.repeat_interleave(num_experts // cfg.n_group, dim=1).bool()
        masked = 0.0 if cfg.topk_method == "group_limited_greedy" else float("-inf")
        choice = choice.masked_fill(~expert_mask, masked)
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if cfg.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * cfg.routed_scaling_factor, topk_ids


def is_grouped(cfg: ModelConfig) -> bool:
    """Whether cfg routes as DeepSeekMoE (this module) rather than by kernels/fused_moe.py's
    softmax top-k (Mixtral, Qwen-MoE)."""
    return cfg.architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
