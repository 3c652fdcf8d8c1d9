"""Block-scaled FP8 GEMM (kernels/fp8_block_gemm.py) against bf16 torch.matmul of the same
weight, at DeepSeek-V2-Lite and DeepSeek-V3 linear-layer shapes.

    python bench/fp8_block_gemm.py --output bench/results/fp8-block-gemm-h200.json   # GPU
    python bench/fp8_block_gemm.py --device cpu --quick                             # CPU smoke run

Each weight is random bf16, quantized block-wise ([128, 128], weight_scale_inv); the bf16 side
multiplies the dequantized weight, so both compute the same product, and the relative error
of the FP8 side is reported. Timed per (model, layer, M): `fp8_us` the whole layer (activation
quantization per token and 128-column group + the GEMM), `gemm_us` the GEMM alone (GPU only), `bf16_us`
torch.matmul; TFLOP/s = 2 M N K / time; GB/s = bytes of weight (+ scales), input and output
over time. GPU calls are timed in CUDA graphs (bench/w4a16.py's seconds_per_call).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/fp8_block_gemm.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import gemm_parser, parse_gemm_args  # noqa: E402
from bench.w4a16 import seconds_per_call  # noqa: E402
from kernels import fp8_block_gemm as bg  # noqa: E402

BLOCK = (128, 128)
# (N, K) of each linear layer: attention (MLA) projections and the dense MLP
SHAPES = {
    "deepseek-v2-lite": {"q_proj": (3072, 2048), "kv_a_proj_with_mqa": (576, 2048),
                         "kv_b_proj": (4096, 512), "o_proj": (2048, 2048),
                         "gate_up_proj": (21888, 2048), "down_proj": (2048, 10944)},
    "deepseek-v3": {"q_a_proj": (1536, 7168), "q_b_proj": (24576, 1536),
                    "kv_a_proj_with_mqa": (576, 7168), "kv_b_proj": (32768, 512),
                    "o_proj": (7168, 16384), "gate_up_proj": (36864, 7168),
                    "down_proj": (7168, 18432)},
}


def parse_args(argv):
    return parse_gemm_args(gemm_parser(__doc__, m="1,64,2048", calls=20), argv)


def run_layer(model: str, name: str, n: int, k: int, m: int, args) -> dict:
    dev, dtype = args.device, torch.bfloat16 if args.device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(n + k)
    weight, scale_inv = bg.quantize_blocks(torch.randn(n, k, generator=g) * 0.02, BLOCK)
    weight, scale_inv = weight.to(dev), scale_inv.to(dev)
    dense = bg.dequantize_blocks(weight, scale_inv, BLOCK, dtype)  # [N, K]
    dense_t = dense.t().contiguous()  # [K, N]: torch.matmul's x @ W^T as one GEMM
    x = torch.randn(m, k, generator=g).to(dev, dtype)
    fp8 = bg.block_linear(x, weight, scale_inv, BLOCK)
    ref = x.float() @ dense.float().t()
    error = float((fp8.float() - ref).norm() / ref.norm())
    q, a = bg.quantize_per_group(x, BLOCK[1])
    times = {} if dev.type != "cuda" else {  # the CPU has the reference only
        "gemm_us": seconds_per_call(lambda: bg.block_gemm(q, a, weight, scale_inv, BLOCK, dtype),
                                    dev, args.calls, args.repeats)}
    times |= {
        "fp8_us": seconds_per_call(lambda: bg.block_linear(x, weight, scale_inv, BLOCK), dev,
                                   args.calls, args.repeats),
        "bf16_us": seconds_per_call(lambda: torch.matmul(x, dense_t), dev, args.calls, args.repeats),
    }
    flops, io = 2 * m * n * k, m * k * x.element_size() + m * n * x.element_size()
    fp8_bytes = n * k + scale_inv.numel() * 4 + io
    bf16_bytes = n * k * dense.element_size() + io
    row = {"model": model, "layer": name, "N": n, "K": k, "M": m, "rel_error": error}
    for key, t in times.items():
        side = key.split("_")[0]
        row[key] = t * 1e6
        row[f"{side}_tflops"] = flops / t / 1e12
        row[f"{side}_gbps"] = (bf16_bytes if side == "bf16" else fp8_bytes) / t / 1e9
    row["speedup"] = times["bf16_us"] / times["fp8_us"]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for model, layers in SHAPES.items():
        items = list(layers.items())[2:3] if args.quick else layers.items()
        for name, (n, k) in items:
            for m in ([1, 7] if args.quick else args.m):
                row = run_layer(model, name, n, k, m, args)
                rows.append(row)
                print(f"{model:17s} {name:19s} M={m:5d} fp8 {row['fp8_us']:9.1f} us "
                      f"({row['fp8_tflops']:6.1f} TF/s, {row['fp8_gbps']:7.1f} GB/s)  "
                      f"bf16 {row['bf16_us']:9.1f} us  x{row['speedup']:.2f}  "
                      f"err {row['rel_error']:.3g}", flush=True)
    device = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    result = {"bench": "fp8_block_gemm", "device": device, "block": list(BLOCK), "rows": rows}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
