"""The FP8 GEMM for few rows (kernels/fp8_gemm.py) against cuBLAS's `torch._scaled_mm` and bf16
`torch.matmul` on the same weights, at Llama-3.1-8B's linear layers.

    python bench/fp8_gemm.py --output bench/results/fp8-gemm-h200.json            # GPU
    python bench/fp8_gemm.py --sweep --m 16,64 --output sweep.json                # + block sweep
    PD_SERVE_TRITON_CPU=1 TRITON_INTERPRET=1 python bench/fp8_gemm.py --device cpu --quick

Per (layer, M): `triton_us` and `scaled_mm_us` time the GEMM alone on the same quantized
activations (the activation quantization, shared by both, is `quant_us`); `bf16_us` is
torch.matmul of the dequantized weight. GB/s = weight bytes / time (the weight is the read that
matters at few rows). Each timed call reads another copy of the weight (copies beyond the L2
cache), so no weight is read from L2. GPU calls are timed in CUDA graphs.
`--sweep` times every block configuration of SWEEP for the layer and M as well.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/fp8_gemm.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import gemm_parser, parse_gemm_args  # noqa: E402
from bench.w4a16 import seconds_per_call  # noqa: E402
from kernels import fp8_gemm as fg  # noqa: E402
from kernels.fp8_quant import quantize_per_token  # noqa: E402
from pd_serve.model import fp8  # noqa: E402

# (N, K) of Llama-3.1-8B's linear layers (q/k/v and gate/up fused, as the engine runs them)
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336)}
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); BLOCK_M 0: the rows' power of 2
SWEEP = [(bm, bn, bk, sk, 4, st) for bm, bn, bk, sk, st in itertools.product(
    (0, 64), (32, 64, 128), (128, 256), (1, 2, 4), (4,))]
L2_BYTES = 128 * 2**20  # weight bytes to cycle through: more than an H100's / H200's L2


def parse_args(argv):
    p = gemm_parser(__doc__, m="2,8,16,32,64", calls=24)
    p.add_argument("--sweep", action="store_true", help="time SWEEP's block configurations too")
    return parse_gemm_args(p, argv)


def cycling(fn, copies: list):
    """fn(copy) over the copies in turn, one a call."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(copies)
        return fn(copies[state["i"]])
    return call


def run_layer(name: str, n: int, k: int, args) -> list[dict]:
    dev = args.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(n + k)
    weight, scale = fp8.quantize_weight(torch.randn(n, k, generator=g) * 0.02)
    on_gpu = dev.type == "cuda"
    copies = [(weight.to(dev), scale.to(dev))
              for _ in range(-(-L2_BYTES // (n * k)) if on_gpu else 1)]
    dense = fp8.dequantize_weight(weight, scale, dtype).t().contiguous().to(dev)  # [K, N]
    dense = [dense.clone() for _ in range(-(-L2_BYTES // (2 * n * k)) if on_gpu else 1)]
    rows = []
    for m in args.m:
        x = torch.randn(m, k, generator=g).to(dev, dtype)
        q, a = quantize_per_token(x, None)
        ref = fg.fp8_gemm_ref(q, a, *copies[0], torch.float32)
        out = fg.fp8_gemm(q, a, *copies[0], dtype)
        error = float((out.float() - ref).norm() / ref.norm())
        time = lambda fn: seconds_per_call(fn, dev, args.calls, args.repeats) * 1e6  # noqa: E731
        row = {"layer": name, "N": n, "K": k, "M": m, "rel_error_vs_ref": error,
               "config": list(fg.block_config(m, n, k, dev)),
               "triton_us": time(cycling(lambda c: fg.fp8_gemm(q, a, *c, dtype), copies)),
               "quant_us": time(lambda: quantize_per_token(x, None)),
               "bf16_us": time(cycling(lambda d: x @ d, dense))}
        if fp8.scaled_mm_supported(dev, dtype):
            row["scaled_mm_us"] = time(cycling(lambda c: torch._scaled_mm(
                q, c[0].t(), scale_a=a, scale_b=c[1].reshape(1, -1), out_dtype=dtype), copies))
        for key in [key for key in row if key.endswith("_us") and key != "quant_us"]:
            weight_bytes = n * k * (2 if key == "bf16_us" else 1)
            row[key.replace("_us", "_gbps")] = weight_bytes / row[key] / 1e3
        if args.sweep and on_gpu:
            row["sweep"] = []
            for config in SWEEP:
                if config[0] and config[0] < m:
                    continue
                try:
                    us = time(cycling(lambda c, cfg=config: fg.fp8_gemm(q, a, *c, dtype, cfg),
                                      copies))
                except Exception as e:  # a configuration past the shared memory, for one
                    row["sweep"].append({"config": list(config), "error": type(e).__name__})
                    continue
                row["sweep"].append({"config": list(config), "us": us, "gbps": n * k / us / 1e3})
            best = min((r for r in row["sweep"] if "us" in r), key=lambda r: r["us"])
            row["best_config"], row["best_us"] = best["config"], best["us"]
        rows.append(row)
        print(f"{name:13s} M={m:3d}  triton {row['triton_us']:7.1f} us "
              f"({row['triton_gbps']:5.0f} GB/s)  scaled_mm {row.get('scaled_mm_us', 0):7.1f}  "
              f"bf16 {row['bf16_us']:7.1f}  quant {row['quant_us']:5.1f}"
              + (f"  best {row['best_us']:7.1f} {row['best_config']}" if "best_us" in row else "")
              + f"  err {error:.1e}", flush=True)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    shapes = {"o_proj": (256, 512)} if args.quick else SHAPES
    result = {"bench": "fp8_gemm", "device": (torch.cuda.get_device_name(args.device)
                                              if args.device.type == "cuda" else "cpu"),
              "rows": [row for name, (n, k) in shapes.items()
                       for row in run_layer(name, n, k, args)]}
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
