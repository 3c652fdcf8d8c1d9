"""One token's experts in GEMV form: the MoE layer of a decode step at batch 1.

    x [1, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights float32 [1, K], topk_ids [1, K]
    -> out [1, H] = sum_k topk_weights[k] * w2[e_k] @ (silu(w13[e_k, :I] @ x) * (w13[e_k, I:] @ x))

kernels/fused_moe.py's kernels serve any number of tokens: an alignment launch sorts the
(token, expert) pairs into blocks of 16 rows, the GEMMs run on those blocks (one real row of
16 at batch 1), and a third launch sums each token's K rows. At batch 1 the K experts are
distinct, so none of that is needed: two launches read the K experts' weights as
kernels/gemv.py reads a linear layer's (a program owns BLOCK_N output channels and walks the
whole input in BLOCK_K steps, products kept in a float32 tile):
  1. gate/up: grid (I / BLOCK_N, K / SLOTS), a program reads SLOTS experts' gate and up rows
     of its channels in one [SLOTS, BLOCK_N, BLOCK_K] tile and writes
     h[k] = silu(gate) * up -> [K, I];
  2. down: grid (H / BLOCK_N, K / SLOTS), a program reads SLOTS experts' rows of its channels
     in one tile, so their loads are in flight together, and the block's outputs times the
     routing weights are summed in float32 in top-k order, rounded once -> [1, H]. With
     SLOTS < K the programs store their slots' float32 products and the block's last program
     (an acquire-release atomic on a per-block counter after a barrier over the stores, as
     kernels/moe_routing.py's route_one_row) sums all K in that order and zeroes the counter:
     more, smaller programs with the same sum, bit for bit. Launches sharing a device must not
     overlap (one stream per device).
The rounding is fused_moe's (gate/up and down outputs to the dtype, the weighted sum in
float32 in top-k order), but the GEMVs sum over the input in another order than its GEMMs, so
a token computed here may differ from a batched one in the last bit (as kernels/gemv.py's rows
differ from cuBLAS's): the model uses it under --enable-batch1-kernels only. FP8 experts
(per-channel scales) widen the weight tile to float32 and scale the channel's sum, as
fused_moe does.
Both kernels launch with programmatic dependent launch (kernels/_triton.py). Gate/up reads
nothing before its wait: the expert ids come from the routing launch just before it. Down
reads the ids and its first weight tile before its wait: the routing is two launches back,
and gate/up's programs let down start only after their own wait on the routing has returned,
so the ids are final by then; only h, gate/up's output, waits.
"""

from __future__ import annotations

import torch

from kernels._triton import device_counters, launch_options, lazy_kernel, pdl

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0
_COUNTERS = 1 << 14  # down-kernel counters per device: channel blocks of one launch
_counter_buffers: dict[torch.device, torch.Tensor] = {}  # device -> int32, zero between launches

tl = None  # triton.language, bound when _kernels is first built


def block_config(fp8: bool) -> dict:
    """Block sizes of the two kernels: gate/up and down (SLOTS experts, BLOCK_N output
    channels, BLOCK_K inputs a step, warps, stages). Gate/up's: the fastest of
    bench/fused_moe.py --batch1-sweep on an H100 (fused-moe-batch1-sweep-h100.json). Down's:
    the fastest in the model's step (bench/probes/step_configs.py --set down, Qwen3-30B-A3B
    at batch 1 on an H100, one-batch-qwen3-30b-a3b-bs1-step-configs-h100.json): all K
    experts in one program, two channels, 128 inputs a step, 2.959 ms a step against 3.001
    with two experts of four channels and 256 inputs (bf16), 2.302 against 2.375 (FP8)."""
    down = (8, 2, 128, 4, 1)
    if fp8:
        return {"gate_up": (1, 2, 1024, 4, 2), "down": down}
    return {"gate_up": (1, 1, 1024, 4, 2), "down": down}


def runs_on(x: torch.Tensor) -> bool:
    return _kernels.runs_on(x)


def moe_batch1(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
               w2_scale: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """The experts of one token (shapes in the module docstring; arguments checked by
    fused_moe, which calls this); [1, H] in x's dtype. config: block sizes other than
    `block_config`'s (the bench's sweep)."""
    global triton_launches
    gate_up_kernel, down_kernel = _kernels.load()
    num_experts, two_inter, hidden = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    fp8 = w13_scale is not None
    cfg = config or block_config(fp8)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    if not fp8:  # unread (W_FP8 False): any float32 pointer
        w13_scale = w2_scale = topk_weights
    opts = launch_options(pdl(x))
    h = x.new_empty(top_k, inter)  # [K, I]
    slots, block_n, block_k, warps, stages = cfg["gate_up"]
    slots = min(slots, _pow2(top_k))
    gate_up_kernel[(-(-inter // block_n), -(-top_k // slots))](
        x, w13, w13_scale.contiguous(), h, ids, hidden, inter, top_k, SLOTS=slots,
        BLOCK_N=block_n, BLOCK_K=min(block_k, _pow2(hidden)), W_FP8=fp8, num_warps=warps,
        num_stages=stages, **opts)
    out = x.new_empty(1, hidden)
    slots, block_n, block_k, warps, stages = cfg["down"]
    slots = min(slots, _pow2(top_k))
    blocks, groups = -(-hidden // block_n), -(-top_k // slots)
    partial = x.new_empty(top_k, hidden, dtype=torch.float32) if groups > 1 else out
    down_kernel[(blocks, groups)](
        h, w2, w2_scale.contiguous(), out, topk_weights.reshape(-1).float().contiguous(), ids,
        partial, _counters(x.device, blocks), hidden, inter, TOP_K=top_k, SLOTS=slots,
        ALL_SLOTS=_pow2(top_k), GROUPS=groups, BLOCK_N=block_n,
        BLOCK_K=min(block_k, _pow2(inter)), W_FP8=fp8, num_warps=warps, num_stages=stages,
        **opts)
    triton_launches += 2
    return out


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """The device's down-kernel counters, one per channel block (kernels/_triton.py)."""
    if blocks > _COUNTERS:
        raise ValueError(f"{blocks} channel blocks exceed the down kernel's {_COUNTERS} counters")
    return device_counters(_counter_buffers, device, _COUNTERS, "moe_batch1's counters")


@lazy_kernel("the batch-1 MoE")
def _kernels(triton):
    """(gate/up + SiLU-and-mul kernel, down + weighted sum over the top k)."""
    @triton.jit
    def expert_gate_up_gemv_kernel(x_ptr, w_ptr, scale_ptr, h_ptr, ids_ptr, hidden, inter, top_k,
                                   SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr, W_FP8: tl.constexpr, PDL: tl.constexpr):
        slots = tl.program_id(1) * SLOTS + tl.arange(0, SLOTS)  # [S] of K
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of I
        ok = (slots < top_k)[:, None] & (cols < inter)[None, :]  # [S, BN]
        rk = tl.arange(0, BLOCK_K)
        if PDL:  # see kernels/_triton.py: the routing done, then let the next start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        experts = tl.load(ids_ptr + slots, mask=slots < top_k, other=0).to(tl.int64)
        gate_at = (experts * 2 * inter)[:, None] + cols[None, :]  # [S, BN]: w13's row
        gate_rows = (gate_at * hidden)[:, :, None]  # [S, BN, 1]
        up_rows = gate_rows + inter * hidden
        acc_gate = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + rk
            k_ok = ks < hidden
            xs = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, None, :]
            mask = ok[:, :, None] & k_ok[None, None, :]
            w_gate = tl.load(w_ptr + gate_rows + ks[None, None, :], mask=mask, other=0.0)
            w_up = tl.load(w_ptr + up_rows + ks[None, None, :], mask=mask, other=0.0)
            acc_gate += w_gate.to(tl.float32) * xs
            acc_up += w_up.to(tl.float32) * xs
        # tl.reduce with the add combiner, not tl.sum (kernels/norm.py: the interpreter)
        gate = tl.reduce(acc_gate, 2, tl.standard._sum_combine)  # [S, BN]
        up = tl.reduce(acc_up, 2, tl.standard._sum_combine)
        if W_FP8:  # the channels' scales on the float32 sums
            gate = gate * tl.load(scale_ptr + gate_at, mask=ok, other=0.0)
            up = up * tl.load(scale_ptr + gate_at + inter, mask=ok, other=0.0)
        dtype = h_ptr.dtype.element_ty
        gate = gate.to(dtype).to(tl.float32)  # the GEMV's output rounds to the dtype ...
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # ... then silu_and_mul's arithmetic
        out = (act.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(h_ptr + slots[:, None] * inter + cols[None, :], out, mask=ok)

    @triton.jit
    def expert_down_gemv_kernel(h_ptr, w_ptr, scale_ptr, out_ptr, weights_ptr, ids_ptr,
                                partial_ptr, counter_ptr, hidden, inter, TOP_K: tl.constexpr,
                                SLOTS: tl.constexpr, ALL_SLOTS: tl.constexpr,
                                GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, W_FP8: tl.constexpr, PDL: tl.constexpr):
        slots = tl.program_id(1) * SLOTS + tl.arange(0, SLOTS)  # [S] of the top k
        block = tl.program_id(0)
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of H
        ok = (slots < TOP_K)[:, None] & (cols < hidden)[None, :]  # [S, BN]
        rk = tl.arange(0, BLOCK_K)
        # the ids and the first weight tile ahead of the wait (module docstring: the routing
        # is two launches back)
        experts = tl.load(ids_ptr + slots, mask=slots < TOP_K, other=0).to(tl.int64)
        row_at = (experts * hidden)[:, None] + cols[None, :]  # [S, BN]: w2's row
        rows = (row_at * inter)[:, :, None]  # [S, BN, 1]
        w = tl.load(w_ptr + rows + rk[None, None, :],
                    mask=ok[:, :, None] & (rk < inter)[None, None, :], other=0.0)
        if PDL:  # see kernels/_triton.py: gate/up done, then let the next start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + rk
            hs = tl.load(h_ptr + slots[:, None] * inter + ks[None, :],
                         mask=(slots < TOP_K)[:, None] & (ks < inter)[None, :], other=0.0)
            acc += w.to(tl.float32) * hs.to(tl.float32)[:, None, :]
            ks = ks + BLOCK_K  # the next step's tile (masked off after the last)
            w = tl.load(w_ptr + rows + ks[None, None, :],
                        mask=ok[:, :, None] & (ks < inter)[None, None, :], other=0.0)
        y = tl.reduce(acc, 2, tl.standard._sum_combine)  # [S, BN]
        if W_FP8:
            y = y * tl.load(scale_ptr + row_at, mask=ok, other=0.0)
        y = y.to(h_ptr.dtype.element_ty).to(tl.float32)  # each pair's output, rounded
        y = y * tl.load(weights_ptr + slots, mask=slots < TOP_K, other=0.0)[:, None]
        if GROUPS > 1:  # the last of the block's programs sums all K (module docstring)
            tl.store(partial_ptr + slots[:, None] * hidden + cols[None, :], y, mask=ok)
            tl.debug_barrier()  # the stores before the release below
            if tl.atomic_add(counter_ptr + block, 1, sem="acq_rel", scope="gpu") != GROUPS - 1:
                return
            tl.store(counter_ptr + block, 0)  # zero again for the next launch
            slots = tl.arange(0, ALL_SLOTS)
            y = tl.load(partial_ptr + slots[:, None] * hidden + cols[None, :],
                        mask=(slots < TOP_K)[:, None] & (cols < hidden)[None, :], other=0.0,
                        cache_modifier=".cg")  # [K, BN], from L2
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for slot in tl.static_range(TOP_K):  # in top-k order, as the reference's sum
            total += tl.reduce(tl.where(slots[:, None] == slot, y, 0.0), 0,
                               tl.standard._sum_combine)
        tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cols < hidden)

    return expert_gate_up_gemv_kernel, expert_down_gemv_kernel
