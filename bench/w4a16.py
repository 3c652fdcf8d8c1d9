"""W4A16 GEMM (kernels/w4a16.py) against the bf16 GEMM of the same weight, on Llama-3.1-8B's
linear-layer shapes, at decode batch sizes.

    python bench/w4a16.py                                  # GPU: shapes x --batch-sizes 1,16
    python bench/w4a16.py --batch-sizes 1,16,64 --output bench/results/w4a16-h200.json
    python bench/w4a16.py --device cpu --quick             # CPU smoke run (torch reference)

Each layer's bf16 weight is random, quantized round-to-nearest into the GPTQ layout (4 bits,
group 128, symmetric); the bf16 GEMM multiplies the dequantized weight, so both compute the
same product, and their outputs are compared (relative error) before anything is timed. On
the GPU each call is timed inside a CUDA graph of --calls calls (launch costs excluded, as in
a decode step), median over --repeats replays. Reported per (layer, batch): microseconds per
call, weight GB/s (bytes read: packed weight and scales for W4A16, 2 bytes a weight for
bf16), and speedup = bf16 time / W4A16 time. On the CPU the W4A16 side is the torch reference
(dequantize, then matmul) and the figures only show that the script runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/w4a16.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import device_name, git_commit, write_json  # noqa: E402
import pd_serve  # noqa: E402,F401  (kernels.w4a16 imports pd_serve.model.gptq: import it first)
from kernels.w4a16 import w4a16_matmul  # noqa: E402
from pd_serve.model.gptq import dequantize_t, quantize_rtn  # noqa: E402

# (name, in_features K, out_features N) of Llama-3.1-8B's linear layers
LLAMA3_8B_LAYERS = [("qkv_proj", 4096, 6144), ("o_proj", 4096, 4096),
                    ("gate_up_proj", 4096, 28672), ("down_proj", 14336, 4096)]
QUICK_LAYERS = [("small", 256, 512)]
GROUP_SIZE = 128


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="1,16", help="comma list of M (default 1,16)")
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph (default 20)")
    p.add_argument("--repeats", type=int, default=10, help="timed replays (default 10)")
    p.add_argument("--quick", action="store_true", help="one small layer, batch 1 and 4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write a JSON result here")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(v) for v in args.batch_sizes.split(",") if v.strip()]
    except ValueError:
        p.error(f"--batch-sizes takes a comma list of integers, got {args.batch_sizes!r}")
    if args.quick:
        args.batch_sizes = [1, 4]
    if not args.batch_sizes or min(args.batch_sizes) < 1 or args.calls < 1 or args.repeats < 1:
        p.error("--batch-sizes, --calls and --repeats need positive integers")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (use --device cpu)")
    return args


def seconds_per_call(fn, device: torch.device, calls: int, repeats: int) -> float:
    """Median seconds per call: CUDA graph replays on the GPU, plain calls on the CPU."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls)
        return statistics.median(times)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def run_layer(name: str, k: int, n: int, args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator(args.device).manual_seed(args.seed)
    weight = torch.randn(n, k, generator=gen, device=args.device, dtype=torch.float32) * 0.02
    qweight, qzeros, scales = quantize_rtn(weight, GROUP_SIZE, sym=True)[:3]
    dense_t = dequantize_t(qweight, qzeros, scales, None).to(dtype)  # [K, N], the same weight
    w4_bytes = qweight.numel() * 4 + scales.numel() * scales.element_size() \
        + (qzeros.numel() * 4 if qzeros is not None else 0)
    bf16_bytes = dense_t.numel() * dense_t.element_size()
    rows = []
    for m in args.batch_sizes:
        x = torch.randn(m, k, generator=gen, device=args.device, dtype=torch.float32).to(dtype)
        got = w4a16_matmul(x, qweight, qzeros, scales, None)
        want = x @ dense_t
        rel_err = float((got.float() - want.float()).norm() / want.float().norm())
        t_w4 = seconds_per_call(lambda: w4a16_matmul(x, qweight, qzeros, scales, None),
                                args.device, args.calls, args.repeats)
        t_bf16 = seconds_per_call(lambda: x @ dense_t, args.device, args.calls, args.repeats)
        row = {"layer": name, "in_features": k, "out_features": n, "batch": m,
               "w4a16_us": t_w4 * 1e6, "bf16_us": t_bf16 * 1e6, "speedup": t_bf16 / t_w4,
               "w4a16_weight_gbps": w4_bytes / t_w4 / 1e9, "bf16_weight_gbps": bf16_bytes / t_bf16 / 1e9,
               "w4a16_weight_bytes": w4_bytes, "bf16_weight_bytes": bf16_bytes, "rel_err": rel_err}
        rows.append(row)
        print(f"{name:<13} {k:>6} x {n:<6} M {m:>4}: W4A16 {row['w4a16_us']:8.1f} us "
              f"({row['w4a16_weight_gbps']:7.1f} GB/s)  bf16 {row['bf16_us']:8.1f} us "
              f"({row['bf16_weight_gbps']:7.1f} GB/s)  speedup {row['speedup']:5.2f}x  "
              f"rel err {rel_err:.1e}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    layers = QUICK_LAYERS if args.quick else LLAMA3_8B_LAYERS
    rows = []
    for i, (name, k, n) in enumerate(layers):
        print(f"[{i + 1}/{len(layers)}] {name}", file=sys.stderr, flush=True)
        rows += run_layer(name, k, n, args, dtype)
    bad = [r for r in rows if not r["rel_err"] < 2e-2]
    for r in bad:
        print(f"MISMATCH: {r['layer']} M {r['batch']}: W4A16 vs the dense GEMM rel err "
              f"{r['rel_err']:.3g}", file=sys.stderr)
    if args.output:
        write_json(args.output, {
            "benchmark": "w4a16", "device": device_name(args.device), "dtype": str(dtype),
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
            "git_commit": git_commit(), "group_size": GROUP_SIZE, "calls_per_graph": args.calls,
            "repeats": args.repeats, "rows": rows})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
