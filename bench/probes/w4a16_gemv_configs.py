"""Probe (one H200, ~1 min): the one-row W4A16 kernel of kernels/w4a16.py over a sweep of its
(BLOCK_N, packed rows a step, num_warps) and split-K target (programs per SM), on Llama-3.1-8B's
layer shapes (GPTQ 4-bit, group 128), timed as bench/w4a16.py times them (CUDA graph of 20
calls), against the bf16 GEMM of the dequantized weight. Writes $OUT/w4a16-gemv-configs-h200.json.

    PYTHONPATH=. python3 bench/probes/w4a16_gemv_configs.py
"""
import itertools
import json
import os
import sys

sys.path.insert(0, ".")
import torch
import triton

import pd_serve  # noqa: F401  (kernels.w4a16 imports pd_serve.model.gptq)
from bench.w4a16 import LLAMA3_8B_LAYERS, GROUP_SIZE, seconds_per_call
from kernels import w4a16
from pd_serve.model.gptq import dequantize_t, quantize_rtn

dev = torch.device("cuda")
configs = [(32, 16, 4), (64, 16, 4), (128, 16, 4), (64, 8, 4), (128, 8, 4), (256, 8, 8),
           (64, 16, 2), (128, 16, 8), (256, 4, 4), (32, 16, 1), (64, 16, 1), (128, 16, 2),
           (64, 8, 2), (32, 32, 2)]
programs = [int(p) for p in os.environ.get("PROGRAMS_PER_SM", "2,4,8").split(",")]
configs = configs[int(os.environ.get("FIRST_CONFIG", 0)):]
rows, best = [], {}
for name, k, n in LLAMA3_8B_LAYERS:
    gen = torch.Generator(dev).manual_seed(0)
    weight = torch.randn(n, k, generator=gen, device=dev) * 0.02
    qweight, qzeros, scales = quantize_rtn(weight, GROUP_SIZE, sym=True)[:3]
    dense_t = dequantize_t(qweight, qzeros, scales, None).to(torch.bfloat16)
    x = torch.randn(1, k, generator=gen, device=dev).to(torch.bfloat16)
    want = (x.float() @ dense_t.float())
    bf16_us = seconds_per_call(lambda: x @ dense_t, dev, 20, 10) * 1e6
    rows.append({"layer": name, "method": "bf16", "us": bf16_us})
    for cfg, per_sm in itertools.product(configs, programs):
        w4a16._GEMV_CONFIG, w4a16._GEMV_PROGRAMS_PER_SM = cfg, per_sm
        try:
            got = w4a16.w4a16_matmul(x, qweight, qzeros, scales, None)
            err = float((got.float() - want).norm() / want.norm())
            us = seconds_per_call(lambda: w4a16.w4a16_matmul(x, qweight, qzeros, scales, None),
                                  dev, 20, 10) * 1e6
        except Exception as e:  # a config Triton cannot build
            print("fail", name, cfg, per_sm, repr(e)[:160], flush=True)
            continue
        r = {"layer": name, "method": "gemv", "cfg": cfg, "programs_per_sm": per_sm, "us": us,
             "speedup_vs_bf16": bf16_us / us, "rel_err": err}
        rows.append(r)
        if err < 2e-2 and (name not in best or us < best[name]["us"]):
            best[name] = r
    print(name, "bf16", round(bf16_us, 1), "best", best.get(name), flush=True)
out = {"device": torch.cuda.get_device_name(),
       "versions": {"torch": torch.__version__, "triton": triton.__version__},
       "git_commit": os.environ.get("PD_SERVE_COMMIT", "unknown"),
       "best": list(best.values()), "rows": rows}
json.dump(out, open(os.environ.get("OUT", ".") + "/w4a16-gemv-configs-h200.json", "w"), indent=1)
