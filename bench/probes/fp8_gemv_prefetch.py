"""Probe (one H200, ~1 min): the batch-1 FP8 GEMV of kernels/gemv.py (weight-only, float32 FMA)
against the same kernel with the next weight tile loaded before the current one is multiplied
(PREFETCH: twice the bytes in flight per program; Triton pipelines only loads that feed a
tl.dot, so num_stages did nothing in bench/results/probe-fp8-gemv-variants-h200-3852923.json)
and with the weight loads marked evict-first (EVICT: each weight byte is read once a step).
Llama-3.1-8B's layer shapes, CUDA graphs over 32 distinct copies of each layer, PDL on as in
the model. Writes $OUT/fp8-gemv-prefetch-h200.json.

    PYTHONPATH=. python3 bench/probes/fp8_gemv_prefetch.py
"""
import itertools
import json
import os
import sys

sys.path.insert(0, ".")
import torch
import triton
import triton.language as tl

from kernels import gemv
from kernels._triton import launch_options, pdl
from pd_serve.model import fp8
from _graph_time import graph_time  # noqa: E402 (bench/probes/)


@triton.jit
def gemv_fp8(x_ptr, w_ptr, out_ptr, s_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PREFETCH: tl.constexpr, POLICY: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_next = tl.load(ptrs, mask=n_mask[:, None] & (rk[None, :] < K), other=0.0,
                     eviction_policy=POLICY)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        w = w_next
        if PREFETCH:
            nk = kk + BLOCK_K
            w_next = tl.load(ptrs + k0 + BLOCK_K, mask=n_mask[:, None] & (nk[None, :] < K),
                             other=0.0, eviction_policy=POLICY)
        else:
            w = tl.load(ptrs + k0, mask=n_mask[:, None] & (kk[None, :] < K), other=0.0,
                        eviction_policy=POLICY)
        xs = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xs[None, :]
    y = tl.sum(acc, 1) * tl.load(s_ptr + rn, mask=n_mask, other=0.0)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def run(x, w, s, cfg, prefetch, evict):
    n, k = w.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps = cfg
    gemv_fp8[(triton.cdiv(n, bn),)](x, w, out, s, n, k, BLOCK_N=bn, BLOCK_K=bk, PREFETCH=prefetch,
                                    POLICY="evict_first" if evict else "", num_warps=warps, num_stages=1,
                                    **launch_options(pdl(x)))
    return out


dev = "cuda"
torch.manual_seed(0)
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
cfgs = [(8, 1024, 4), (4, 2048, 4), (16, 1024, 8), (4, 1024, 4), (8, 512, 4), (16, 512, 4),
        (16, 512, 8), (32, 256, 4)]
rows, best = [], {}
for name, (n, k) in shapes.items():
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    ws = [fp8.quantize_weight(torch.randn(n, k, device=dev) * 0.02) for _ in range(32)]
    ref = (x.float() @ (ws[0][0].float() * ws[0][1][:, None]).t())
    scale = ref.abs().max().item()
    us = graph_time(lambda: [gemv.gemv(x, w, s) for w, s in ws]) * 1e3 / 32
    rows.append({"shape": name, "method": "kernels/gemv.py", "cfg": gemv._block_config(k, True),
                 "us": us, "gbps": n * k / us / 1e3})
    print(rows[-1], flush=True)
    for cfg, prefetch, evict in itertools.product(cfgs, (False, True), (False, True)):
        call = lambda w, s, cfg=cfg, p=prefetch, e=evict: run(x, w, s, cfg, p, e)
        try:
            err = (call(*ws[0]).float() - ref).abs().max().item() / scale
            us = graph_time(lambda: [call(w, s) for w, s in ws]) * 1e3 / 32
        except Exception as e:  # a config Triton cannot build
            print("fail", name, cfg, prefetch, evict, repr(e)[:160], flush=True)
            continue
        r = {"shape": name, "method": "probe", "cfg": cfg, "prefetch": prefetch, "evict": evict,
             "us": us, "gbps": n * k / us / 1e3, "max_err_rel": err}
        rows.append(r)
        key = (name, prefetch, evict)
        if err < 2e-2 and (key not in best or us < best[key]["us"]):
            best[key] = r
    for key in [kk for kk in best if kk[0] == name]:
        print("best", best[key], flush=True)
    del ws
out = {"device": torch.cuda.get_device_name(),
       "versions": {"torch": torch.__version__, "triton": triton.__version__},
       "git_commit": os.environ.get("PD_SERVE_COMMIT", "unknown"),
       "best": list(best.values()), "rows": rows}
json.dump(out, open(os.environ.get("OUT", ".") + "/fp8-gemv-prefetch-h200.json", "w"), indent=1)
