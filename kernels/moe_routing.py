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

One program per token, all E <= MAX_EXPERTS experts in registers, K passes of one max over
keys that pack each logit's float32 bits above its id's complement, so a pass finds the
highest logit and, among equals, the lowest id (for the choice a NaN logit counts as -inf, so
every slot gets a distinct valid expert); no host sync, so CUDA graphs capture it. It
launches with programmatic dependent launch (kernels/_triton.py) and reads nothing before
the wait: the logits are the router's output.

`route_one_row` serves one token (decode at batch 1, --enable-batch1-kernels) from the layer's
hidden state before its post-attention RMSNorm: one launch does that norm (the residual add in
front, as kernels/norm.py's `rms_norm(x, w, eps, residual)` rounds it), the router's logits and
the routing, where three launches did. Each of E programs normalises the row (a few KB from
L2) and computes one logit, rounded to x's dtype as the router's linear layer rounds it;
program 0 stores the normalised row and the sum for the experts and the next layer. The
program that counts last on a per-device counter (an acquire-release atomic after a barrier
over the logit stores, as kernels/paged_attention.py merges its splits) routes the logits and
zeroes the counter, so launches sharing a device must not overlap (one stream per device).
Before the PDL wait a program loads its router row and the norm weight (no kernel writes them).
A program is one warp for every 2048 of the hidden size (rounded up to a power of 2): at
Qwen3-30B-A3B's 2048 one warp routes a layer in 3.7 us, against 4.4 with four (one H200, 48
launches in a CUDA graph, bench/probes/route_one_row.py), as its reductions stay inside
the warp.
The row's sum of squares is one reduction over the whole row here, another order than
`rms_norm`'s, so the normalised row may differ from it in the last bit.
It runs on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1 (Triton's interpreter);
otherwise the references.
"""

from __future__ import annotations

import torch

from kernels._triton import device_counters, launch_options, lazy_kernel, pdl

MAX_EXPERTS = 1024
MAX_TOP_K = 16
SCORING_FUNCS = ("softmax", "sigmoid")
MAX_ONE_ROW_HIDDEN = 8192  # route_one_row holds the row in registers
ONE_ROW_WARPS = 1  # warps of a route_one_row program per 2048 of the hidden size
_counters: dict[torch.device, torch.Tensor] = {}  # device -> int32 [1], zero between launches
tl = None  # triton.language, bound when _kernel is first built


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          scoring_func: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, K], topk_ids [T, K]): int32 from the
    kernel, int64 from the reference (`select_experts`) where the kernel does not run."""
    from kernels.fused_moe import select_experts

    num_tokens, num_experts = router_logits.shape
    _check(num_experts, top_k, scoring_func)
    if num_experts > MAX_EXPERTS or not _kernel.runs_on(router_logits):
        return select_experts(router_logits, top_k, renormalize, scoring_func)
    weights, ids = _outputs(num_tokens, top_k, router_logits.device)
    if num_tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _launch(num_tokens, logits, weights, ids, num_experts, logits.stride(0), top_k,
                scoring_func, renormalize)
    return weights, ids


def route_one_row(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, top_k: int, renormalize: bool,
                  scoring_func: str = "softmax"):
    """One token's post-attention RMSNorm, router and routing in one launch (module docstring).

    x, residual [1, H] and the router's weight [E, H], contiguous, in one dtype; norm_weight
    [H]. Returns (normed [1, H], x + residual [1, H], topk_weights float32 [1, K], topk_ids
    [1, K]): what `rms_norm(x, norm_weight, eps, residual)` then `route(normed @ weight.T, ...)`
    give (those references where the kernel does not run)."""
    from kernels.fused_moe import select_experts
    from kernels.norm import rms_norm

    num_experts, hidden = weight.shape
    _check(num_experts, top_k, scoring_func)
    if (x.shape != (1, hidden) or residual.shape != x.shape or norm_weight.shape != (hidden,)
            or weight.dtype != x.dtype or residual.dtype != x.dtype or hidden > MAX_ONE_ROW_HIDDEN):
        raise ValueError(f"x {x.dtype} {tuple(x.shape)}, residual {residual.dtype} "
                         f"{tuple(residual.shape)}, norm weight {tuple(norm_weight.shape)} and "
                         f"router {weight.dtype} {tuple(weight.shape)}: want [1, H], [1, H], [H] "
                         f"and [E, H] in one dtype, H <= {MAX_ONE_ROW_HIDDEN}")
    if num_experts > MAX_EXPERTS or not _kernel.runs_on(x):
        normed, summed = rms_norm(x, norm_weight, eps, residual)
        return normed, summed, *select_experts(normed @ weight.T, top_k, renormalize, scoring_func)
    weights, ids = _outputs(1, top_k, x.device)
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    logits = x.new_empty(num_experts)  # [E], the programs' stores, read by the last one
    _launch(num_experts, logits, weights, ids, num_experts, 0, top_k, scoring_func, renormalize,
            one_row=(x.contiguous(), residual.contiguous(), norm_weight.contiguous(), eps,
                     weight.contiguous(), normed, summed,
                     device_counters(_counters, x.device, 1, "route_one_row's counter")))
    return normed, summed, weights, ids


def _check(num_experts: int, top_k: int, scoring_func: str) -> None:
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func {scoring_func!r} must be one of {SCORING_FUNCS}")
    if not 0 < top_k <= min(num_experts, MAX_TOP_K):
        raise ValueError(f"top_k {top_k} must be in [1, min(E={num_experts}, {MAX_TOP_K})]")


def _outputs(num_tokens: int, top_k: int, device: torch.device):
    return (torch.empty(num_tokens, top_k, dtype=torch.float32, device=device),
            torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))


def _launch(programs, logits, weights, ids, num_experts, stride, top_k, scoring_func, renormalize,
            one_row: tuple | None = None) -> None:
    """one_row: route_one_row's (x, residual, norm weight, eps, router weight, normed out, sum
    out, counter); else the logits are given."""
    kernel = _kernel.load()
    with_row = one_row is not None
    if not with_row:  # unread without ONE_ROW: any pointers, no hidden size
        one_row = (logits, logits, logits, 0.0, logits, logits, logits, logits)
    x, residual, norm_w, eps, w, normed, summed, counter = one_row
    hidden = x.shape[-1] if with_row else 1
    kernel[(programs,)](logits, weights, ids, x, residual, norm_w, w, normed, summed, counter,
                        num_experts, stride, hidden, eps, EXPERTS=_pow2(num_experts), TOP_K=top_k,
                        SLOTS=_pow2(top_k), SIGMOID=scoring_func == "sigmoid",
                        RENORMALIZE=renormalize, ONE_ROW=with_row, BLOCK_H=_pow2(hidden),
                        num_warps=(_pow2(ONE_ROW_WARPS * -(-hidden // 2048)) if with_row
                                   else 4 if num_experts > 256 else 1),
                        **launch_options(pdl(logits)))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@lazy_kernel("the MoE routing")
def _kernel(triton):
    @triton.jit
    def route_kernel(logits_ptr, weights_ptr, ids_ptr, x_ptr, res_ptr, norm_w_ptr, w_ptr,
                     normed_ptr, sum_ptr, counter_ptr, num_experts, stride, hidden, eps,
                     EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                     SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, ONE_ROW: tl.constexpr,
                     BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        # Grid: one program per token; ONE_ROW: one per expert (one token), the last one routes.
        token = tl.program_id(0).to(tl.int64)
        if ONE_ROW:  # this program's router row and the norm weight: no kernel writes them
            cols = tl.arange(0, BLOCK_H)
            col_ok = cols < hidden
            w_row = tl.load(w_ptr + token * hidden + cols, mask=col_ok, other=0.0)
            norm_w = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0)
        if PDL:  # see kernels/_triton.py: the kernel before done, then let the next start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if ONE_ROW:  # kernels/norm.py's rounding: the sum, the normalised row, the weight product
            dtype = x_ptr.dtype.element_ty
            s = (tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                 + tl.load(res_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)).to(dtype)
            sf = s.to(tl.float32)
            # tl.reduce with the add combiner, not tl.sum (kernels/norm.py: the interpreter)
            inv = tl.math.rsqrt(tl.reduce(sf * sf, 0, tl.standard._sum_combine) / hidden + eps)
            xn = ((sf * inv).to(dtype).to(tl.float32) * norm_w.to(dtype).to(tl.float32)).to(dtype)
            if token == 0:
                tl.store(normed_ptr + cols, xn, mask=col_ok)
                tl.store(sum_ptr + cols, s, mask=col_ok)
            logit = tl.reduce(w_row.to(tl.float32) * xn.to(tl.float32), 0,
                              tl.standard._sum_combine)
            tl.store(logits_ptr + token, logit.to(logits_ptr.dtype.element_ty))
            tl.debug_barrier()  # the stores before the release below
            if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") != num_experts - 1:
                return
            tl.store(counter_ptr, 0)  # zero again for the next launch
            token = token * 0  # the one row
        experts = tl.arange(0, EXPERTS)
        valid = experts < num_experts
        logits = tl.load(logits_ptr + token * stride + experts, mask=valid, other=float("-inf"),
                         cache_modifier=".cg").to(tl.float32)  # [EXPERTS], from L2
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-logits))
        else:
            exps = tl.where(valid, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
            scores = exps / tl.sum(exps, axis=0)
        # The choice: one int64 max a pass over keys that order as (logit, lowest id): the
        # logit's float32 bits made to order as signed ints (NaN as -inf, -0.0 as 0.0) above,
        # the id's complement below. The weights: the chosen scores, in one pass after.
        key = tl.where(logits == logits, logits, float("-inf"))
        bits = tl.where(key == 0.0, 0.0, key).to(tl.int32, bitcast=True)
        bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        keys = (bits.to(tl.int64) << 32) | (EXPERTS - 1 - experts).to(tl.int64)
        lowest = -9223372036854775807 - 1
        keys = tl.where(valid, keys, lowest)  # padding lanes are never chosen
        slots = tl.arange(0, SLOTS)
        top_ids = tl.zeros((SLOTS,), dtype=tl.int32)
        for k in tl.static_range(TOP_K):
            best = tl.max(keys, axis=0)
            pick = EXPERTS - 1 - (best & 0xFFFFFFFF).to(tl.int32)
            top_ids = tl.where(slots == k, pick, top_ids)
            keys = tl.where(experts == pick, lowest, keys)
        chosen = (top_ids[:, None] == experts[None, :]) & (slots < TOP_K)[:, None]
        top_weights = tl.sum(tl.where(chosen, scores[None, :], 0.0), axis=1)  # [SLOTS]
        if RENORMALIZE:
            top_weights = top_weights / tl.sum(top_weights, axis=0)
        out = token * TOP_K + slots
        tl.store(ids_ptr + out, top_ids, mask=slots < TOP_K)
        tl.store(weights_ptr + out, top_weights, mask=slots < TOP_K)

    return route_kernel
