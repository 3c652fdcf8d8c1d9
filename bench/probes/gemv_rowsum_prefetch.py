"""Probe (one H200, ~1 min): the FP8 GEMV's row-sum form (kernels/gemv.py, ROWSUM) with the
next weight tile loaded before the current one is summed (PREFETCH: twice the weight bytes in
flight a program, which the row-sum form's 64-113 registers a thread leave room for; the tile
form's 168 did not, bench/results/probe-fp8-gemv-prefetch-h200-117d036.json). A kernel of its
own here, the same arithmetic as kernels/gemv.py's row-sum form; gate/up fused with
silu_and_mul as the model runs it. Each configuration against kernels/gemv.py's choice, timed
under a CUDA graph over 32 distinct copies of each Llama-3.1-8B layer (_graph_time.py), PDL on,
medians of ROUNDS interleaved rounds. Writes $OUT/gemv-rowsum-prefetch-h200.json.

    PYTHONPATH=. python3 bench/probes/gemv_rowsum_prefetch.py
"""
import json
import os
import statistics
import sys

sys.path.insert(0, ".")
import torch
import triton
import triton.language as tl

from kernels import activation, gemv
from kernels._triton import launch_options, pdl
from pd_serve.model import fp8
from _graph_time import graph_time  # noqa: E402 (bench/probes/)


@triton.jit
def _tile_sum(w, xs):
    return tl.sum(w.to(tl.float32) * xs[None, :], 1)


@triton.jit
def gemv_rowsum(x_ptr, w_ptr, out_ptr, s_ptr, N, K, GLU: tl.constexpr, PREFETCH: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    up_ptrs = ptrs + N.to(tl.int64) * K
    mask = n_mask[:, None] & (rk < K)[None, :]
    w = tl.load(ptrs, mask=mask, other=0.0)
    w_up = w
    if GLU:
        w_up = tl.load(up_ptrs, mask=mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    xs = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if not PREFETCH:
        acc = _tile_sum(w, xs)
        if GLU:
            acc_up = _tile_sum(w_up, xs)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        kmask = n_mask[:, None] & (kk < K)[None, :]
        w_new = tl.load(ptrs + k0, mask=kmask, other=0.0)
        w_up_new = w_new
        if GLU:
            w_up_new = tl.load(up_ptrs + k0, mask=kmask, other=0.0)
        if PREFETCH:  # this tile's loads are out: sum the one before, then its x
            acc += _tile_sum(w, xs)
            if GLU:
                acc_up += _tile_sum(w_up, xs)
            xs = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        else:
            xs = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc += _tile_sum(w_new, xs)
            if GLU:
                acc_up += _tile_sum(w_up_new, xs)
        w = w_new
        w_up = w_up_new
    if PREFETCH:
        acc += _tile_sum(w, xs)
        if GLU:
            acc_up += _tile_sum(w_up, xs)
    y = (acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)).to(out_ptr.dtype.element_ty)
    if GLU:
        up = acc_up * tl.load(s_ptr + N + rn, mask=n_mask, other=0.0)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
        y = (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rn, y, mask=n_mask)


def probe(x, w, s, cfg, prefetch, glu):
    n, k = w.shape
    if glu:
        n //= 2
    bn, bk, warps = cfg
    if glu:
        bn = max(1, bn // 2)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    gemv_rowsum[(triton.cdiv(n, bn),)](x, w, out, s, n, k, GLU=glu, PREFETCH=prefetch,
                                       BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1,
                                       **launch_options(pdl(x)))
    return out


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CFGS = [(2, 2048, 4), (4, 1024, 4), (4, 2048, 4), (8, 512, 4), (8, 1024, 4), (8, 1024, 8),
        (8, 2048, 8), (16, 512, 4), (16, 1024, 8), (4, 512, 4)]
ROUNDS = int(os.environ.get("PROBE_ROUNDS", 3))


def main():
    dev = "cuda"
    torch.manual_seed(0)
    rows, best = [], {}
    out_path = os.environ.get("OUT", ".") + "/gemv-rowsum-prefetch-h200.json"
    for name, (n, k) in SHAPES.items():
        glu = name == "gate_up"
        ws = [fp8.quantize_weight(torch.randn(n, k, device=dev) * 0.02) for _ in range(32)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        w0, s0 = ws[0]
        ref = x.float() @ (w0.float() * s0[:, None]).t()
        if glu:
            ref = activation.silu_and_mul_ref(ref.to(torch.bfloat16)).float()
        scale = ref.abs().max().item()
        calls = [("gemv.py", gemv._block_config(n, k, True)[:3],
                  lambda w, s: gemv.gemv(x, w, s, silu_and_mul=glu))]
        calls += [(f"prefetch={p}", cfg, lambda w, s, cfg=cfg, p=p: probe(x, w, s, cfg, p, glu))
                  for cfg in CFGS for p in (False, True)]
        times, errs = {i: [] for i in range(len(calls))}, {}
        for _ in range(ROUNDS):
            for i, (label, cfg, call) in enumerate(calls):
                try:
                    if i not in errs:
                        errs[i] = (call(w0, s0).float() - ref).abs().max().item() / scale
                    times[i].append(graph_time(lambda: [call(w, s) for w, s in ws]) * 1e3 / 32)
                except Exception as e:  # a configuration Triton cannot build
                    print("fail", name, label, cfg, repr(e)[:160], flush=True)
                    errs[i] = float("inf")
        for i, (label, cfg, _) in enumerate(calls):
            if not times[i]:
                continue
            r = {"shape": name, "variant": label, "cfg": list(cfg),
                 "us": round(statistics.median(times[i]), 2),
                 "us_rounds": [round(t, 2) for t in times[i]], "max_err_rel": errs[i],
                 "ok": errs[i] < 2e-2}
            rows.append(r)
            key = (name, label.split("=")[0] if i else label, label)
            if r["ok"] and (key not in best or r["us"] < best[key]["us"]):
                best[key] = r
        print(name, [(b["variant"], b["cfg"], b["us"]) for (s, _, _), b in best.items()
                     if s == name], flush=True)
        del ws
        json.dump({"device": torch.cuda.get_device_name(),
                   "versions": {"torch": torch.__version__, "triton": triton.__version__},
                   "git_commit": os.environ.get("PD_SERVE_COMMIT", "unknown"), "rounds": ROUNDS,
                   "best": list(best.values()), "rows": rows}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
