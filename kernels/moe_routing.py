"""Top-k routing of a mixture-of-experts layer in one Triton launch (Mixtral, Qwen-MoE).

    router_logits [T, E] -> topk_weights float32 [T, K], topk_ids int32 [T, K]

The scores are the softmax of the logits over the experts in float32 (or their sigmoid); the
K experts of highest score in descending order, renormalised to sum 1 where `renormalize`
says. kernels/fused_moe.py's `select_experts` is the torch reference (softmax, torch.topk,
divide: four or five launches, ~14 us a layer at batch 1 on an H200, against one here).

The choice is made on the float32 logits (softmax and sigmoid keep their order, and no
rounding of exp can merge two distinct logits). Equal logits go to the lowest expert id
first. torch.topk has no such rule: its order among equal values is whatever its selection
algorithm leaves (on CPU [3, 3, 3] at ids 1, 4, 6 comes back as 4, 6, 1), so ties match the
reference as a set of equal weights, not id for id. Real routers tie only on rows of zeros
(CUDA-graph padding), whose output is discarded.

One program per token, all E <= MAX_EXPERTS experts in registers, K passes of max-then-lowest-
index; no host sync, so CUDA graphs capture it. It launches with programmatic dependent launch
(kernels/_triton.py) and reads nothing before the wait: the logits are the router's output. It runs on CUDA tensors, or on CPU tensors
when PD_SERVE_TRITON_CPU=1 (Triton's interpreter); otherwise the reference.
"""

from __future__ import annotations

import torch

from kernels._triton import launch_options, lazy_kernel, pdl

MAX_EXPERTS = 1024
MAX_TOP_K = 16
SCORING_FUNCS = ("softmax", "sigmoid")
tl = None  # triton.language, bound when _kernel is first built


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          scoring_func: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, K], topk_ids [T, K]): int32 from the
    kernel, int64 from the reference (`select_experts`) where the kernel does not run."""
    from kernels.fused_moe import select_experts

    num_tokens, num_experts = router_logits.shape
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func {scoring_func!r} must be one of {SCORING_FUNCS}")
    if not 0 < top_k <= min(num_experts, MAX_TOP_K):
        raise ValueError(f"top_k {top_k} must be in [1, min(E={num_experts}, {MAX_TOP_K})]")
    if num_experts > MAX_EXPERTS or not _kernel.runs_on(router_logits):
        return select_experts(router_logits, top_k, renormalize, scoring_func)
    kernel = _kernel.load()
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0),
                              EXPERTS=_pow2(num_experts), TOP_K=top_k, SLOTS=_pow2(top_k),
                              SIGMOID=scoring_func == "sigmoid", RENORMALIZE=renormalize,
                              num_warps=1 if num_experts <= 256 else 4,
                              **launch_options(pdl(logits)))
    return weights, ids


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@lazy_kernel("the MoE routing")
def _kernel(triton):
    @triton.jit
    def route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride,
                     EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                     SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        if PDL:  # see kernels/_triton.py: the router done, then let the next start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        experts = tl.arange(0, EXPERTS)
        valid = experts < num_experts
        logits = tl.load(logits_ptr + token * stride + experts, mask=valid,
                         other=float("-inf")).to(tl.float32)  # [EXPERTS]
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-logits))
        else:
            exps = tl.where(valid, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
            scores = exps / tl.sum(exps, axis=0)
        slots = tl.arange(0, SLOTS)
        top_ids = tl.zeros((SLOTS,), dtype=tl.int32)
        top_weights = tl.zeros((SLOTS,), dtype=tl.float32)
        taken = ~valid  # padding lanes are never chosen
        for k in tl.static_range(TOP_K):
            free = tl.where(taken, float("-inf"), logits)
            best = tl.max(free, axis=0)
            pick = tl.min(tl.where((free == best) & ~taken, experts, EXPERTS), axis=0)
            chosen = experts == pick
            top_ids = tl.where(slots == k, pick, top_ids)
            top_weights = tl.where(slots == k, tl.sum(tl.where(chosen, scores, 0.0), axis=0),
                                   top_weights)
            taken = taken | chosen
        if RENORMALIZE:
            top_weights = top_weights / tl.sum(top_weights, axis=0)
        out = token * TOP_K + slots
        tl.store(ids_ptr + out, top_ids, mask=slots < TOP_K)
        tl.store(weights_ptr + out, top_weights, mask=slots < TOP_K)

    return route_kernel
