"""A mixture-of-experts layer's experts: top-k routing, then each token through its experts.

    x [T, H], w13 [E, 2I, H] (each expert's [gate | up]), w2 [E, H, I],
    topk_weights float32 [T, K], topk_ids [T, K]
    out[t] = sum_k  topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
             e = topk_ids[t, k]

The rounding is transformers' (its default grouped-GEMM experts): each (token, expert) pair's
gate/up and down outputs are rounded to the dtype, the routing weight multiplies in float32,
and a token's K products are summed in float32 in top-k order, then rounded once.

`select_experts` is the routing (softmax over the router's logits in float32, torch.topk, so
ties go as transformers' go; renormalised to sum 1 where the config says), `fused_moe_ref`
the torch reference (a loop over the experts that received tokens: it syncs with the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, K], topk_ids int64 [T, K]).

    Softmax in float32 over all experts, the K largest (torch.topk: the order and the choice
    among equal values are transformers'), renormalised to sum 1 when `renormalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Torch reference of the experts (shapes in the module docstring); [T, H] in x's dtype."""
    _check(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [T*K]: pair p is token p // K's k-th choice
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # host sync
    pairs = x.new_empty(num_tokens * top_k, x.shape[1])  # [T*K, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        start += count
        h = silu_and_mul_ref(F.linear(x[rows // top_k], w13[expert]))  # [n, I]
        pairs[rows] = F.linear(h, w2[expert])
    weighted = pairs.float() * topk_weights.reshape(-1, 1)  # [T*K, H] float32
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [T, H] float32/float16/bfloat16, got {x.dtype} {tuple(x.shape)}")
    num_experts, two_inter, hidden = w13.shape
    if hidden != x.shape[1] or two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x "
                         f"{tuple(x.shape)}: want [E, 2I, H] and [E, H, I]")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights {w13.dtype}/{w2.dtype} differ from x's {x.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T, K] with T = {x.shape[0]}")
