"""Probe (one H200, ~1 min): kernels/gemv.py's GEMV at each Llama-3.1-8B layer shape, FP8 and
bf16 weights (PROBE_DTYPES), in both of its ways of summing over K (ROWSUM: products summed
every step into [BLOCK_N]; tile: float32 products kept in [BLOCK_N, BLOCK_K] and summed at the
end), over a set of block configurations (each layer's first row: _block_config's choice).
gate/up runs two ways: the fused [gate | up] weight with silu_and_mul in the epilogue (block_n
counts the rows of both halves), as the model runs it (FP8 too since aaffda0); and
("gate_up_then_act") a plain GEMV over the same rows, then kernels/activation.py's silu_and_mul
(how the FP8 model ran it before: the epilogue was slower for FP8 in the tile form). Each
configuration is timed under a CUDA graph over 32 distinct copies of the layer
(bench/probes/_graph_time.py) in ROUNDS interleaved rounds, its median kept, and checked against
the torch reference. Writes $OUT/gemv-forms-h200.json.
(Until ac49a71 a stand-alone FP8 row-sum kernel, bench/probes/fp8_gemv_rowsum.py, one sample
each: ../results/probe-fp8-gemv-rowsum-h200-ac49a71.json.)

    PYTHONPATH=. python3 bench/probes/gemv_forms.py
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, ".")
import torch
import triton

from kernels import activation, gemv
from pd_serve.model import fp8
from _graph_time import graph_time  # noqa: E402 (bench/probes/)

# gate_up: the GEMV with silu_and_mul in its epilogue (the bf16 model's); gate_up_then_act: a
# plain GEMV over the same rows, then kernels/activation.py's silu_and_mul (the FP8 model's)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "gate_up_then_act": (28672, 4096), "down": (4096, 14336)}
# (BLOCK_N, BLOCK_K, num_warps) tried in each form, besides _block_config's choice. Row-sum
# registers for sm_90a (bench/probes/gemv_registers.py, FP8): (4, 1024, 4w) 64, (8, 512, 4w) 63,
# (4, 2048, 4w) 113, (8, 1024, 4w) 126, (8, 1024, 8w) 64.
CFGS = {"tile": [(4, 1024, 4), (2, 2048, 4), (4, 2048, 8), (8, 2048, 8), (8, 1024, 8),
                 (16, 1024, 8), (2, 4096, 8)],
        "rowsum": [(4, 512, 4), (4, 1024, 4), (4, 2048, 4), (8, 512, 4), (8, 1024, 4),
                   (8, 1024, 8), (8, 2048, 8), (16, 1024, 8), (16, 512, 4), (2, 2048, 4),
                   (2, 4096, 4), (4, 2048, 8), (4, 4096, 8), (8, 4096, 8), (16, 2048, 8)]}
DTYPES = os.environ.get("PROBE_DTYPES", "fp8 bf16").split()
ROUNDS = int(os.environ.get("PROBE_ROUNDS", 3))
BUDGET_S = float(os.environ.get("PROBE_BUDGET_S", 240))  # then what was measured is written


def forced(cfg):
    """_block_config that answers cfg, (BLOCK_N, BLOCK_K, warps, stages, ROWSUM), for any layer."""
    return lambda n, k, is_fp8: cfg


def main():
    dev = "cuda"
    torch.manual_seed(0)
    chosen = gemv._block_config
    rows, t0 = [], time.time()
    out_path = os.environ.get("OUT", ".") + "/gemv-forms-h200.json"

    def write():
        best = {}
        for r in rows:
            key = (r["dtype"], r["shape"], r["form"])
            if r["ok"] and (key not in best or r["us"] < best[key]["us"]):
                best[key] = r
        json.dump({"device": torch.cuda.get_device_name(),
                   "versions": {"torch": torch.__version__, "triton": triton.__version__},
                   "git_commit": os.environ.get("PD_SERVE_COMMIT", "unknown"), "rounds": ROUNDS,
                   "best": list(best.values()), "rows": rows}, open(out_path, "w"), indent=1)
        return best

    for dtype in DTYPES:
        for name, (n, k) in SHAPES.items():
            if time.time() - t0 > BUDGET_S:
                break
            glu, act_after = name == "gate_up", name == "gate_up_then_act"
            w32 = [torch.randn(n, k, device=dev) * 0.02 for _ in range(32)]
            ws = ([fp8.quantize_weight(w) for w in w32] if dtype == "fp8"
                  else [(w.to(torch.bfloat16), None) for w in w32])
            del w32
            x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
            w0, s0 = ws[0]
            ref = x.float() @ (w0.float() * (s0[:, None] if s0 is not None else 1)).t()
            if glu or act_after:
                ref = activation.silu_and_mul_ref(ref.to(torch.bfloat16)).float()
            scale = ref.abs().max().item()
            now = chosen(n, k, dtype == "fp8")
            cfgs = [("rowsum" if now[4] else "tile", now)]
            cfgs += [(form, (bn, bk, warps, 1 if form == "rowsum" else 2, form == "rowsum"))
                     for form, listed in CFGS.items() for bn, bk, warps in listed
                     if (bn, bk, warps) != now[:3] or (form == "rowsum") != now[4]]
            times = {i: [] for i in range(len(cfgs))}
            errs = {}
            for _ in range(ROUNDS):
                for i, (form, cfg) in enumerate(cfgs):
                    gemv._block_config = forced(cfg)
                    call = ((lambda w, s: activation.silu_and_mul(gemv.gemv(x, w, s))) if act_after
                            else (lambda w, s: gemv.gemv(x, w, s, silu_and_mul=glu)))
                    try:
                        if i not in errs:
                            errs[i] = (call(w0, s0).float() - ref).abs().max().item() / scale
                        times[i].append(graph_time(lambda: [call(w, s) for w, s in ws]) * 1e3 / 32)
                    except Exception as e:  # a configuration Triton cannot build
                        print("fail", dtype, name, form, cfg, repr(e)[:160], flush=True)
                        errs[i] = float("inf")
            gemv._block_config = chosen
            for i, (form, cfg) in enumerate(cfgs):
                if times[i]:
                    us = statistics.median(times[i])
                    rows.append({"dtype": dtype, "shape": name, "form": form, "cfg": list(cfg[:3]),
                                 "chosen": i == 0,
                                 "us": round(us, 2), "us_rounds": [round(t, 2) for t in times[i]],
                                 "tbps": round(n * k * (1 if dtype == "fp8" else 2) / us / 1e6, 3),
                                 "max_err_rel": errs[i], "ok": errs[i] < 2e-2})
            best = write()
            print(dtype, name, {f: (b["cfg"], b["us"]) for (d, s, f), b in best.items()
                                if (d, s) == (dtype, name)}, f"{time.time() - t0:.0f}s", flush=True)
            del ws


if __name__ == "__main__":
    main()
