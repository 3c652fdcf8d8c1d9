"""kernels/gemv.py block configs at Qwen3-30B-A3B and Llama-3.1-8B one-row layer shapes (bf16), on
distinct weights per call (so L2 does not hold them), in a CUDA graph; GB/s per (shape, config).

    python bench/probes/gemv_blocks.py out.json   (bench/results/gemv-blocks-h200.json)
"""
import itertools
import json
import sys

import torch

from bench.w4a16 import seconds_per_call
from kernels import gemv

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048),
          "llama_qkv": (6144, 4096), "llama_o": (4096, 4096)}
CONFIGS = ([(bn, bk, 4, 2) for bn, bk in itertools.product((1, 2, 4, 8), (512, 1024, 2048))]
           + [(2, 1024, 8, 2), (4, 1024, 8, 2), (4, 2048, 8, 1), (8, 1024, 8, 3), (2, 1024, 4, 3), (4, 1024, 4, 3)])
dev = torch.device("cuda")
real = gemv._block_config
rows = []
for name, (n, k) in SHAPES.items():
    copies = max(2, min(24, (1 << 30) // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    default = real(n, k, False)
    best = None
    for cfg in [default[:4]] + CONFIGS:
        if cfg[1] > k:
            continue
        gemv._block_config = lambda n_, k_, fp8, c=cfg: (*c, False)
        try:
            t = seconds_per_call(lambda: [gemv.gemv(x, w) for w in ws], dev, 4, 5) / copies
        except Exception as e:
            print(name, cfg, "failed", type(e).__name__, file=sys.stderr)
            continue
        gbps = n * k * 2 / t / 1e9
        rows.append({"shape": name, "n": n, "k": k, "config": cfg, "default": cfg == default[:4], "us": t * 1e6, "gbps": gbps})
        if best is None or gbps > best[1]:
            best = (cfg, gbps)
    gemv._block_config = real
    d = [r for r in rows if r["shape"] == name and r["default"]][0]
    print(f"{name:8s} default {d['config']} {d['us']:7.2f} us {d['gbps']:6.0f} GB/s; best {best[0]} {best[1]:6.0f} GB/s", flush=True)
    del ws
    torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
