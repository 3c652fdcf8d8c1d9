"""The fused MoE's block configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) swept on one GPU at
Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of 768, top 8), per token count, each
timed in a CUDA graph with moe_align and routing alone beside them; block_config() in
kernels/fused_moe.py takes the best. Writes $OUT/moe-sweep.json.

    OUT=/tmp python bench/probes/fused_moe_blocks.py
"""
import itertools, json, sys, os
import torch
sys.path.insert(0, os.getcwd())
import kernels.fused_moe as fm
from bench.w4a16 import seconds_per_call

dev = torch.device("cuda")
H, I, E, K = 2048, 768, 128, 8
g = torch.Generator(dev).manual_seed(0)
w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) * 0.02).bfloat16()
w2 = (torch.randn(E, H, I, generator=g, device=dev) * 0.02).bfloat16()
out = {}
for T in (1, 8, 64, 256, 8192):
    x = torch.randn(T, H, generator=g, device=dev).bfloat16()
    logits = torch.randn(T, E, generator=g, device=dev)
    wts, ids = fm.select_experts(logits, K, renormalize=True)
    want = fm.fused_moe_ref(x, w13, w2, wts, ids).float()
    base = fm.block_config
    bm0 = base(T * K, E)[0]
    t_align = seconds_per_call(lambda: fm.moe_align(ids, E, bm0), dev, 10, 5)
    t_route = seconds_per_call(lambda: fm.select_experts(logits, K, renormalize=True), dev, 10, 5)
    rows = []
    if T <= 256:
        grid = itertools.product([16] if T <= 64 else [16, 32], [32, 64, 128], [64, 128, 256], [4], [3, 4])
    else:
        grid = itertools.product([64, 128], [64, 128], [32, 64], [4, 8], [3, 4])
    for cfg in [base(T * K, E)] + list(grid):
        fm.block_config = lambda *shape, cfg=cfg: cfg
        try:
            got = fm.fused_moe(x, w13, w2, wts, ids).float()
            err = float((got - want).norm() / want.norm())
            t = seconds_per_call(lambda: fm.fused_moe(x, w13, w2, wts, ids), dev, 10, 5)
        except Exception as e:  # out of shared memory etc.
            print(T, cfg, "failed", repr(e)[:100], flush=True)
            continue
        finally:
            fm.block_config = base
        rows.append((t * 1e6, cfg, err))
    rows.sort()
    out[T] = {"align_us": t_align * 1e6, "route_us": t_route * 1e6, "default": [r for r in rows if r[1] == base(T * K, E)][0],
              "best": rows[:5]}
    print(f"T={T}: align {t_align*1e6:.1f} us route {t_route*1e6:.1f} us; default {out[T]['default'][0]:.1f} us; best:",
          [(round(r[0], 1), r[1], f"{r[2]:.1e}") for r in rows[:5]], flush=True)
json.dump(out, open(os.environ.get("OUT", ".") + "/moe-sweep.json", "w"), indent=1)
