"""Probe (one H200, ~3 min): the batch-1 FP8 GEMV (W8A16) with its sum over K taken every
step into a [BLOCK_N] accumulator ("rowsum"), against kernels/gemv.py, which keeps float32
products in a [BLOCK_N, BLOCK_K] tile and sums it once at the end ("tile"). The tile form
holds 168 registers a thread at its FP8 configurations (ptxas for sm_90a, from the Triton
compile on a CPU machine): 3 programs of 4 warps an SM, 24 KB of weight loads in flight an
SM. The row sum frees the tile's registers for more programs or larger loads, at the cost of
a cross-thread sum every step. Both load their first weight tile before the PDL wait, as
kernels/gemv.py does. Each timed under a CUDA graph over 32 distinct copies of each
Llama-3.1-8B layer (bench/probes/_graph_time.py), checked against the dequantized torch
reference. Writes $OUT/fp8-gemv-rowsum-h200.json.

    PYTHONPATH=. python3 bench/probes/fp8_gemv_rowsum.py
"""
import json
import os
import sys
import time

sys.path.insert(0, ".")
import torch
import triton
import triton.language as tl

from kernels import gemv
from kernels._triton import launch_options, pdl
from pd_serve.model import fp8
from _graph_time import graph_time  # noqa: E402 (bench/probes/)


@triton.jit
def gemv_rowsum(x_ptr, w_ptr, out_ptr, s_ptr, N, K, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    rows = rn.to(tl.int64)[:, None] * K
    w = tl.load(w_ptr + rows + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    xs = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * xs[None, :], 1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        xs = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xs[None, :], 1)
    y = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def rowsum(x, w, s, cfg):
    n, k = w.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps = cfg
    gemv_rowsum[(triton.cdiv(n, bn),)](x, w, out, s, n, k, BLOCK_N=bn, BLOCK_K=bk,
                                       num_warps=warps, num_stages=1, **launch_options(pdl(x)))
    return out


# The configurations without spills that keep the most weight loads in flight an SM, by
# ptxas's register counts for sm_90a (32 KB a step at 4 warps: (4, 1024) 64 registers, (8, 512)
# 63, (8, 1024) 126, (4, 2048) 113), and a few around them.
CFGS = [(4, 512, 4), (4, 1024, 4), (4, 2048, 4), (8, 512, 4), (8, 1024, 4), (4, 1024, 8),
        (8, 1024, 8), (8, 2048, 8), (16, 512, 4)]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BUDGET_S = float(os.environ.get("PROBE_BUDGET_S", 200))  # then what was measured is written


def main():
    dev = "cuda"
    torch.manual_seed(0)
    rows, best, t0 = [], {}, time.time()
    out_path = os.environ.get("OUT", ".") + "/fp8-gemv-rowsum-h200.json"

    def write():
        json.dump({"device": torch.cuda.get_device_name(),
                   "versions": {"torch": torch.__version__, "triton": triton.__version__},
                   "git_commit": os.environ.get("PD_SERVE_COMMIT", "unknown"),
                   "best": list(best.values()), "rows": rows}, open(out_path, "w"), indent=1)

    for name, (n, k) in SHAPES.items():
        ws = [fp8.quantize_weight(torch.randn(n, k, device=dev) * 0.02) for _ in range(32)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        ref = x.float() @ (ws[0][0].float() * ws[0][1][:, None]).t()
        scale = ref.abs().max().item()
        calls = [("tile", gemv._block_config(k, True), lambda w, s: gemv.gemv(x, w, s))]
        calls += [("rowsum", cfg, lambda w, s, cfg=cfg: rowsum(x, w, s, cfg)) for cfg in CFGS]
        for method, cfg, call in calls:
            if time.time() - t0 > BUDGET_S:
                break
            try:
                err = (call(*ws[0]).float() - ref).abs().max().item() / scale
                us = graph_time(lambda: [call(w, s) for w, s in ws]) * 1e3 / 32
            except Exception as e:  # a config Triton cannot build
                print("fail", name, method, cfg, repr(e)[:160], flush=True)
                continue
            r = {"shape": name, "method": method, "cfg": list(cfg), "us": round(us, 2),
                 "tbps": round(n * k / us / 1e6, 3), "max_err_rel": err}
            rows.append(r)
            if err < 2e-2 and ((name, method) not in best or us < best[(name, method)]["us"]):
                best[(name, method)] = r
        print(name, best.get((name, "tile")), best.get((name, "rowsum")),
              f"{time.time() - t0:.0f}s", flush=True)
        del ws
        write()


if __name__ == "__main__":
    main()
