"""Probe (one H200, ~90 s): one-, two- and four-row GEMMs on Llama-3.1-8B's layer shapes, cuBLAS
against a sweep of Triton GEMV block configs, each timed in a CUDA graph over 32 distinct
weight copies (4 for the LM head) so L2 holds none; plus batch-1 decode attention at 1k context
(flashinfer with and without tensor cores, kernels/paged_attention.py). Writes
$OUT/gemv-probe-h200.json (committed as bench/results/probe-gemv-h200.json). What it found
chose kernels/gemv.py's block configs.

    PYTHONPATH=. python3 bench/probes/gemv_probe.py
"""
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from _graph_time import flashinfer_decode_one_row, graph_time  # noqa: E402 (bench/probes/)

dev = "cuda"
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}


# ceilings
big = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev).normal_()  # 1 GiB
dst = torch.empty_like(big)
t = graph_time(lambda: dst.copy_(big))
out["copy_gbps"] = 2 * big.numel() * 2 / t / 1e6
t = graph_time(lambda: big.sum(dtype=torch.float32))
out["read_sum_gbps"] = big.numel() * 2 / t / 1e6
del dst
print(out, flush=True)

@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    nmask = rn < N
    acc0 = tl.zeros((BN, BK), dtype=tl.float32)
    acc1 = tl.zeros((BN, BK), dtype=tl.float32)
    acc2 = tl.zeros((BN, BK), dtype=tl.float32)
    acc3 = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=nmask[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
        x0 = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc0 += w * x0[None, :]
        if M > 1:
            x1 = tl.load(x_ptr + K + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc1 += w * x1[None, :]
        if M > 2:
            x2 = tl.load(x_ptr + 2 * K + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc2 += w * x2[None, :]
        if M > 3:
            x3 = tl.load(x_ptr + 3 * K + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc3 += w * x3[None, :]
    tl.store(y_ptr + rn, tl.sum(acc0, axis=1).to(y_ptr.dtype.element_ty), mask=nmask)
    if M > 1:
        tl.store(y_ptr + N + rn, tl.sum(acc1, axis=1).to(y_ptr.dtype.element_ty), mask=nmask)
    if M > 2:
        tl.store(y_ptr + 2 * N + rn, tl.sum(acc2, axis=1).to(y_ptr.dtype.element_ty), mask=nmask)
    if M > 3:
        tl.store(y_ptr + 3 * N + rn, tl.sum(acc3, axis=1).to(y_ptr.dtype.element_ty), mask=nmask)

def tgemv(x, w, y, BN, BK, warps, stages):
    N, K = w.shape
    gemv_kernel[(triton.cdiv(N, BN),)](x, w, y, N, K, M=x.shape[0], BN=BN, BK=BK, num_warps=warps, num_stages=stages)

shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
res = []
for name, (N, K) in shapes.items():
    copies = 4 if name == "lm_head" else 32
    ws = [torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
    nbytes = N * K * 2
    for M in (1, 2, 4):
        x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
        ys = [torch.empty(M, N, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
        ref = F.linear(x, ws[0]).float()
        def cub():
            for w, y in zip(ws, ys): torch.matmul(x, w.t(), out=y)
        t = graph_time(cub); us = t * 1e3 / copies
        row = {"shape": name, "N": N, "K": K, "M": M, "method": "cublas", "us": us, "gbps": nbytes / us / 1e3}
        res.append(row); print(row, flush=True)
        best = None
        cfgs = list(itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8), (2, 4))) if M == 1 else \
               [(bn, bk, wp, st) for bn, bk, wp, st in itertools.product((4, 8, 16), (256, 512), (4, 8), (2, 4))]
        for BN, BK, warps, stages in cfgs:
            if BK > K or BN * BK > 16384: continue
            try:
                tgemv(x, ws[0], ys[0], BN, BK, warps, stages); torch.cuda.synchronize()
                err = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
                def tri():
                    for w, y in zip(ws, ys): tgemv(x, w, y, BN, BK, warps, stages)
                t = graph_time(tri); us = t * 1e3 / copies
            except Exception as e:
                print("fail", name, M, BN, BK, warps, stages, repr(e)[:200], flush=True); continue
            r = {"shape": name, "M": M, "method": "triton", "BN": BN, "BK": BK, "warps": warps, "stages": stages, "us": us, "gbps": nbytes / us / 1e3, "relerr": err}
            res.append(r)
            if best is None or us < best["us"]: best = r
        print("best", best, flush=True)
    del ws
out["gemv"] = res

# bs1 decode attention, 1k context, 32 layers cycled
try:
    L, P, S, Hq, Hkv, D = 32, 64 * 2, 16, 32, 8, 128
    ctx = 1024
    kc = [torch.randn(P, S, Hkv, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    vc = [torch.randn(P, S, Hkv, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    q = torch.randn(1, Hq, D, dtype=torch.bfloat16, device=dev)
    att = []
    for tc in (True, False):
        w = flashinfer_decode_one_row(ctx // S, S, Hq, Hkv, D, tensor_cores=tc, workspace_mib=128,
                                      device=dev)
        def fi():
            for i in range(L): w.run(q, (kc[i], vc[i]))
        fi(); torch.cuda.synchronize()
        t = graph_time(fi)
        r = {"attention": "flashinfer", "tensor_cores": tc, "us_per_layer": t * 1e3 / L}
        att.append(r); print(r, flush=True)
    sys.path.insert(0, ".")
    from kernels.paged_attention import paged_decode_attention
    pt = (torch.tensor([0, ctx // S], dtype=torch.int32, device=dev),
          torch.arange(ctx // S, dtype=torch.int32, device=dev))  # kv_indptr, kv_indices
    sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
    def tr():
        for i in range(L): paged_decode_attention(q, kc[i], vc[i], *pt, sl, 1 / D ** 0.5)
    try:
        tr(); torch.cuda.synchronize()
        t = graph_time(tr)
        r = {"attention": "triton", "us_per_layer": t * 1e3 / L}; att.append(r); print(r, flush=True)
    except Exception as e:
        print("triton attn fail", repr(e)[:300])
    out["attention"] = att
except Exception as e:
    print("attention probe failed", repr(e)[:300])
import os

json.dump(out, open(os.environ.get("OUT", ".") + "/gemv-probe-h200.json", "w"), indent=1)
