"""A mixture-of-experts layer's experts: top-k routing, then each token through its experts.

    x [T, H], w13 [E, 2I, H] (each expert's [gate | up]), w2 [E, H, I],
    topk_weights float32 [T, K], topk_ids [T, K]
    out[t] = sum_k  topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
             e = topk_ids[t, k]

The rounding is transformers' (its default grouped-GEMM experts): each (token, expert) pair's
gate/up and down outputs are rounded to the dtype, the routing weight multiplies in float32,
and a token's K products are summed in float32 in top-k order, then rounded once.

FP8 experts (w13_scale / w2_scale given): w13 and w2 are float8_e4m3fn with per-channel
float32 scales, w13_scale [E, 2I] and w2_scale [E, H], W[e, n, k] = w[e, n, k] * scale[e, n].
Weight-only (W8A16): the weights are widened to x's dtype as they are loaded (exact: e4m3 fits
in float16 and bfloat16), the GEMM accumulates in float32, and the channel's scale multiplies
the float32 sum in the epilogue, before the output rounds to the dtype. A decode step reads
half the bytes; activations keep the model dtype's precision.

`select_experts` is the routing (softmax over the router's logits in float32, torch.topk, so
ties go as transformers' go; renormalised to sum 1 where the config says), `fused_moe_ref`
the torch reference (a loop over the experts that received tokens: it syncs with the host).

`fused_moe` runs two Triton kernels over the (token, expert) pairs sorted by expert, each
expert's run padded to the block size (kernels/moe_align.py, as SGLang's and vLLM's
moe_align_block_size), so every block of rows reads one expert's weights:
  1. gate/up: a grouped GEMM of the block's tokens with their expert's [gate | up] rows, both
     halves accumulated side by side, SiLU-and-mul in the epilogue -> [T*K, I];
  2. down: a grouped GEMM with the expert's down rows, each row times its routing weight ->
     float32 [T*K, H];
  3. reduce: each token's K rows summed in float32 in top-k order (rows of pairs routed to
     another rank's experts skipped), rounded to the dtype once -> [T, H]. One launch for what
     torch does in three (zero-fill, sum, cast); reduce=False returns the float32 rows, zeros
     where another rank's experts were chosen.
Nothing syncs with the host (the padded length is read on the device, the grid is sized for
the worst case), so CUDA graphs capture it. With batch1 set, one token takes
kernels/moe_batch1.py's two GEMV-form launches instead of the alignment and these three
(--enable-batch1-kernels). It runs on CUDA tensors, or on CPU tensors when
PD_SERVE_TRITON_CPU=1 (Triton's interpreter); otherwise the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import lazy_kernel
from kernels.activation import silu_and_mul_ref
from kernels.moe_align import moe_align
from kernels.moe_batch1 import moe_batch1

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
tl = None  # triton.language, bound when _kernels is first built


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   scoring_func: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, K], topk_ids int64 [T, K]).

    Softmax in float32 over all experts (or the sigmoid), the K largest (torch.topk: the order
    and the choice among equal values are transformers'), renormalised to sum 1 when
    `renormalize`. kernels/moe_routing.py is its one-launch Triton version."""
    if scoring_func == "sigmoid":
        probs = router_logits.float().sigmoid()
    else:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_offset: int = 0,
                  reduce: bool = True, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of the experts (shapes in the module docstring); [T, H] in x's dtype.

    Expert parallelism: w13 / w2 hold experts [expert_offset, expert_offset + E) only; pairs
    routed elsewhere add zero. reduce=False returns the weighted pairs, float32 [T, K, H], for
    the ranks to sum before the sum over K (then any EP size rounds as one rank does).
    w13_scale / w2_scale: FP8 experts' per-channel scales (module docstring)."""
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    local = topk_ids.reshape(-1) - expert_offset  # [T*K]: pair p is token p // K's k-th choice
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=num_experts + 1).tolist()  # host sync
    pairs = x.new_zeros(num_tokens * top_k, x.shape[1])  # [T*K, H]
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        rows = order[start:start + count]
        start += count
        h = silu_and_mul_ref(_linear(x[rows // top_k], w13[expert], w13_scale, expert))  # [n, I]
        pairs[rows] = _linear(h, w2[expert], w2_scale, expert)
    weighted = pairs.float() * topk_weights.reshape(-1, 1)  # [T*K, H] float32
    return sum_topk(weighted.view(num_tokens, top_k, x.shape[1]), x.dtype, reduce)


def _linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
            expert: int) -> torch.Tensor:
    """x @ w.T in x's dtype; FP8 w: in float32, times the expert's channel scales, then
    rounded once (as the kernel's epilogue)."""
    if scale is None:
        return F.linear(x, w)
    return (F.linear(x.float(), w.float()) * scale[expert]).to(x.dtype)


def sum_topk(weighted: torch.Tensor, dtype: torch.dtype, reduce: bool) -> torch.Tensor:
    """float32 [T, K, H] -> the sum over K in top-k order, one add after another as the Triton
    reduce adds (torch's sum over K adds in another order on CUDA), rounded once; or as it is."""
    if not reduce:
        return weighted
    total = weighted[:, 0]
    for k in range(1, weighted.shape[1]):
        total = total + weighted[:, k]
    return total.to(dtype)


# ----------------------------------------------------------------------------- Triton

def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_offset: int = 0,
              reduce: bool = True, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, batch1: bool = False) -> torch.Tensor:
    """The experts (shapes in the module docstring) by the fused Triton kernels where they run,
    else `fused_moe_ref` (expert_offset, reduce and the FP8 scales as there). Returns [T, H]
    in x's dtype. batch1: one token, all experts here, summed, runs kernels/moe_batch1.py."""
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    if not _kernels.runs_on(x):
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, expert_offset, reduce,
                             w13_scale, w2_scale)
    if batch1 and x.shape[0] == 1 and reduce and expert_offset == 0:
        return moe_batch1(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    global triton_launches
    gate_up_kernel, down_kernel, reduce_kernel = _kernels.load()
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return sum_topk(x.new_zeros(0, top_k, hidden, dtype=torch.float32), x.dtype, reduce)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    block_m, block_n, block_k, num_warps, num_stages = block_config(num_tokens * top_k, num_experts,
                                                                    hidden, inter)
    sorted_ids, block_experts, num_padded = moe_align(topk_ids, num_experts, block_m,
                                                      expert_offset)
    num_pairs = num_tokens * top_k
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    fp8 = w13_scale is not None
    if fp8:
        w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    else:  # unread (W_FP8 False): any float32 pointer
        w13_scale = w2_scale = topk_weights
    h = x.new_empty(num_pairs, inter)  # [T*K, I]
    grid = (block_experts.numel(), -(-inter // block_n))
    gate_up_kernel[grid](x, w13, w13_scale, h, sorted_ids, block_experts, num_padded, num_pairs,
                         top_k, hidden, inter, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_K=block_k, PRECISION=precision, W_FP8=fp8, num_warps=num_warps,
                         num_stages=num_stages)
    # [T*K, H]: reduce skips the rows the down kernel leaves unwritten; unreduced, they are 0
    out = (torch.empty if reduce else torch.zeros)(num_pairs, hidden, dtype=torch.float32,
                                                   device=x.device)
    grid = (block_experts.numel(), -(-hidden // block_n))
    down_kernel[grid](h, w2, w2_scale, out, topk_weights.float().contiguous(), sorted_ids,
                      block_experts, num_padded, num_pairs, hidden, inter, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, W_FP8=fp8,
                      num_warps=num_warps, num_stages=num_stages)
    triton_launches += 2
    if not reduce:
        return out.view(num_tokens, top_k, hidden)
    reduced = x.new_empty(num_tokens, hidden)  # [T, H]
    block_h = min(1024, _pow2(hidden))
    reduce_kernel[(num_tokens, -(-hidden // block_h))](
        out, topk_ids.contiguous(), reduced, top_k, hidden, expert_offset, num_experts,
        BLOCK_H=block_h, num_warps=4)
    triton_launches += 1
    return reduced


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def block_config(num_pairs: int, num_experts: int, hidden: int = 1 << 30,
                 inter: int = 1 << 30) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for num_pairs (token, expert) pairs,
    from a sweep on one H200 at Qwen3-30B-A3B's layer shape (bench/results/fused-moe-block-sweep-h200.json):
    16-row blocks while experts get a few rows each (decode), 32 up to ~32 rows an expert, then
    128-row blocks with 8 warps (prefill, 1.6x the 64-row blocks at 8192 tokens). Blocks never
    exceed the layer's dimensions (small test models)."""
    if num_pairs <= 4 * num_experts:
        config = [16, 64, 128, 4, 3]
    elif num_pairs <= 32 * num_experts:
        config = [32, 64, 128, 4, 3]
    else:
        config = [128, 128, 64, 8, 3]
    fit = max(16, 1 << (min(hidden, inter) - 1).bit_length())  # a power of two >= min dim
    config[1], config[2] = min(config[1], fit), min(config[2], fit)
    return tuple(config)


@lazy_kernel("the fused MoE")
def _kernels(triton):
    """(gate/up + SiLU-and-mul kernel, down + routing-weight kernel, sum-over-K kernel)."""
    @triton.jit
    def gate_up_kernel(x_ptr, w_ptr, scale_ptr, h_ptr, sorted_ptr, experts_ptr, num_padded_ptr,
                       num_pairs, top_k, hidden, inter, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                       W_FP8: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        valid = pairs < num_pairs
        tokens = (pairs // top_k).to(tl.int64)
        expert = tl.load(experts_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of I
        col_ok = cols < inter
        w_base = w_ptr + expert * 2 * inter * hidden
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            a = tl.load(x_ptr + tokens[:, None] * hidden + ks[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            w_mask = k_ok[:, None] & col_ok[None, :]
            w_gate = tl.load(w_base + cols[None, :] * hidden + ks[:, None], mask=w_mask, other=0.0)
            w_up = tl.load(w_base + (inter + cols[None, :]) * hidden + ks[:, None], mask=w_mask,
                           other=0.0)  # [BK, BN]
            if W_FP8:  # widened to x's dtype: exact
                w_gate, w_up = w_gate.to(x_ptr.dtype.element_ty), w_up.to(x_ptr.dtype.element_ty)
            acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        if W_FP8:  # the channels' scales on the float32 sums
            s_base = scale_ptr + expert * 2 * inter
            acc_gate = acc_gate * tl.load(s_base + cols, mask=col_ok, other=0.0)[None, :]
            acc_up = acc_up * tl.load(s_base + inter + cols, mask=col_ok, other=0.0)[None, :]
        dtype = h_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)  # the GEMM's output rounds to the dtype ...
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # ... then silu_and_mul's arithmetic
        out = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(h_ptr + pairs.to(tl.int64)[:, None] * inter + cols[None, :], out,
                 mask=valid[:, None] & col_ok[None, :])

    @triton.jit
    def down_kernel(h_ptr, w_ptr, scale_ptr, out_ptr, weights_ptr, sorted_ptr, experts_ptr,
                    num_padded_ptr, num_pairs, hidden, inter, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    W_FP8: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = pairs < num_pairs
        expert = tl.load(experts_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of H
        col_ok = cols < hidden
        w_base = w_ptr + expert * hidden * inter
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inter
            a = tl.load(h_ptr + pairs[:, None] * inter + ks[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            w = tl.load(w_base + cols[None, :] * inter + ks[:, None],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
            if W_FP8:
                w = w.to(h_ptr.dtype.element_ty)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if W_FP8:
            acc = acc * tl.load(scale_ptr + expert * hidden + cols, mask=col_ok, other=0.0)[None, :]
        routing = tl.load(weights_ptr + pairs, mask=valid, other=0.0)  # float32 [BM]
        out = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * routing[:, None]
        tl.store(out_ptr + pairs[:, None] * hidden + cols[None, :], out,
                 mask=valid[:, None] & col_ok[None, :])

    @triton.jit
    def reduce_kernel(pairs_ptr, ids_ptr, out_ptr, top_k, hidden, expert_offset, num_experts,
                      BLOCK_H: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        col_ok = cols < hidden
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in range(0, top_k):  # in top-k order, as the reference's sum
            pair = token * top_k + k
            expert = tl.load(ids_ptr + pair).to(tl.int64) - expert_offset
            here = (expert >= 0) & (expert < num_experts)  # else nothing: all columns masked
            acc += tl.load(pairs_ptr + pair * hidden + cols,
                           mask=cols < tl.where(here, hidden, 0), other=0.0)
        tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)

    return gate_up_kernel, down_kernel, reduce_kernel


# ----------------------------------------------------------------------------- validation

def _check(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [T, H] float32/float16/bfloat16, got {x.dtype} {tuple(x.shape)}")
    num_experts, two_inter, hidden = w13.shape
    if hidden != x.shape[1] or two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x "
                         f"{tuple(x.shape)}: want [E, 2I, H] and [E, H, I]")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("FP8 experts need both w13_scale and w2_scale")
    want = x.dtype if w13_scale is None else torch.float8_e4m3fn
    if w13.dtype != want or w2.dtype != want:
        raise ValueError(f"weights {w13.dtype}/{w2.dtype}: want {want} (x is {x.dtype}, "
                         f"{'no ' if w13_scale is None else ''}FP8 scales given)")
    if w13_scale is not None and (
            w13_scale.shape != (num_experts, two_inter) or w2_scale.shape != (num_experts, hidden)
            or w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32):
        raise ValueError(f"FP8 scales {w13_scale.dtype} {tuple(w13_scale.shape)} / "
                         f"{w2_scale.dtype} {tuple(w2_scale.shape)}: want float32 [E, 2I], [E, H]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T, K] with T = {x.shape[0]}")
