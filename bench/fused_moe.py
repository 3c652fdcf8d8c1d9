"""The fused MoE (kernels/fused_moe.py, Triton) against its torch reference, on one MoE layer
of Qwen3-30B-A3B's shape (hidden 2048, 128 experts of 768, top 8), at decode and prefill
token counts.

    python bench/fused_moe.py                                   # GPU: tokens 1, 64, 8192
    python bench/fused_moe.py --output bench/results/fused-moe-h200.json
    python bench/fused_moe.py --fp8 --output bench/results/fused-moe-h200.json  # + FP8 experts
    python bench/fused_moe.py --device cpu --quick              # CPU smoke run
    python bench/fused_moe.py --tokens 1 --fp8 --batch1-sweep   # kernels/moe_batch1.py's blocks

Random weights and router logits (routing as the model routes: select_experts); the two
outputs are compared (relative error) before anything is timed. The fused side is timed in a
CUDA graph of --calls calls (it never syncs with the host, so a decode step's graph holds it),
the reference eagerly (it syncs); medians over --repeats. Reported per token count:
microseconds per call, the experts hit, the bytes of their weights, and the rate the fused
side reads them at (the floor at small batches: only the hit experts' weights are read).
--fp8 adds a row per token count with the experts in FP8 (per-channel scales, weight-only:
kernels/fused_moe.py), against the reference of the same FP8 weights; its weight bytes are one
per weight plus the float32 scales.
--batch1 adds a row per 1-token case with the batch-1 kernels (kernels/moe_batch1.py, what
--enable-batch1-kernels runs), --batch1-sweep one per block configuration of theirs,
--batch1-down-sweep one per configuration of the down kernel (gate/up at its default).
Each call in the graph routes the tokens anew (--calls routings), so at one token each call
reads other experts' weights, as a model's layers do, not weights left in L2 by the call before.
On the CPU the fused side is the reference too, and the figures only show that the script runs.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/fused_moe.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import device_name, git_commit, sync, write_json  # noqa: E402
from bench.w4a16 import seconds_per_call  # noqa: E402
from kernels.fused_moe import fused_moe, fused_moe_ref, select_experts  # noqa: E402
from kernels.moe_batch1 import moe_batch1  # noqa: E402
from pd_serve.model.fp8 import quantize_experts  # noqa: E402

QWEN3_30B_A3B = dict(hidden=2048, inter=768, experts=128, top_k=8)
QUICK = dict(hidden=64, inter=32, experts=8, top_k=2)
# kernels/moe_batch1.py block configurations for --batch1-sweep: gate/up and down (SLOTS,
# BLOCK_N, BLOCK_K, warps, stages); down with SLOTS < 8 splits the top k over programs
BATCH1_SWEEP = [{"gate_up": g, "down": d}
                for g in [(1, 1, 1024, 4, 2), (1, 2, 1024, 4, 2), (2, 1, 1024, 4, 2),
                          (4, 1, 1024, 8, 2), (8, 1, 512, 8, 2), (8, 1, 1024, 8, 1)]
                for d in [(8, 1, 1024, 4, 1), (8, 1, 1024, 8, 1), (8, 2, 1024, 8, 1),
                          (8, 2, 256, 4, 1), (8, 4, 1024, 8, 1), (8, 4, 256, 8, 1)]]
# --batch1-down-sweep: gate/up at its default, down over SLOTS 1..8
BATCH1_DOWN_SWEEP = [{"gate_up": (1, 1, 1024, 4, 2), "down": d}
                     for d in [(8, 4, 256, 8, 1), (8, 2, 256, 4, 1), (4, 4, 256, 4, 1),
                               (4, 2, 256, 4, 1), (2, 4, 256, 4, 1), (2, 8, 256, 4, 1),
                               (2, 2, 1024, 4, 1), (1, 4, 256, 4, 1), (1, 8, 256, 4, 1),
                               (1, 2, 1024, 4, 1), (1, 4, 1024, 4, 1), (1, 16, 256, 4, 1)]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="1,64,8192", help="comma list of token counts")
    p.add_argument("--calls", type=int, default=10, help="calls per CUDA graph (default 10)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    p.add_argument("--quick", action="store_true", help="a tiny layer, tokens 1 and 16")
    p.add_argument("--fp8", action="store_true", help="also FP8 experts (a row per token count)")
    p.add_argument("--batch1", action="store_true",
                   help="1-token cases also on the batch-1 kernels (kernels/moe_batch1.py)")
    p.add_argument("--batch1-sweep", action="store_true",
                   help="1-token cases on every batch-1 block configuration in BATCH1_SWEEP")
    p.add_argument("--batch1-down-sweep", action="store_true",
                   help="1-token cases on the down kernel's configurations in BATCH1_DOWN_SWEEP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write a JSON result here")
    args = p.parse_args(argv)
    try:
        args.tokens = [int(v) for v in args.tokens.split(",") if v.strip()]
    except ValueError:
        p.error(f"--tokens takes a comma list of integers, got {args.tokens!r}")
    if args.quick:
        args.tokens = [1, 16]
    if not args.tokens or min(args.tokens) < 1 or args.calls < 1 or args.repeats < 1:
        p.error("--tokens, --calls and --repeats need positive integers")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (use --device cpu)")
    return args


def eager_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of one call, run eagerly (the reference syncs with the host)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(shape: dict, tokens: int, args: argparse.Namespace, dtype: torch.dtype,
        fp8: bool = False, batch1: dict | None = None) -> dict:
    """One row; batch1: the batch-1 kernels with these block sizes ({} their defaults)."""
    hidden, inter, experts, top_k = (shape[k] for k in ("hidden", "inter", "experts", "top_k"))
    gen = torch.Generator(args.device).manual_seed(args.seed)
    cast = dict(device=args.device, dtype=dtype)
    x = torch.randn(tokens, hidden, generator=gen, device=args.device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=args.device) * 0.02).to(**cast)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=args.device) * 0.02).to(**cast)
    # a routing per call of the graph, so at small token counts each call reads other experts'
    # weights (as each layer of a model does), not what the call before left in L2
    routings = [select_experts(torch.randn(tokens, experts, generator=gen, device=args.device),
                               top_k, renormalize=True) for _ in range(args.calls)]
    weights, ids = routings[0]
    scales = {}
    if fp8:
        (w13, scales["w13_scale"]), (w2, scales["w2_scale"]) = quantize_experts(w13), quantize_experts(w2)
    turn = itertools.cycle(routings)
    fused = lambda: fused_moe(x, w13, w2, *next(turn), **scales)  # noqa: E731
    if batch1 is not None:
        fused = lambda: moe_batch1(x, w13, w2, *next(turn), **scales,  # noqa: E731
                                   config=batch1 or None)
    ref = lambda: fused_moe_ref(x, w13, w2, weights, ids, **scales)  # noqa: E731
    got, want = fused(), ref()  # the first routing's
    rel_err = float((got.float() - want.float()).norm() / want.float().norm())
    t_fused = seconds_per_call(fused, args.device, args.calls, args.repeats)
    t_ref = eager_seconds(ref, args.device, args.repeats)
    hit = int(ids.unique().numel())
    per_expert = 3 * hidden * inter * w13.element_size() + (2 * inter + hidden) * 4 * fp8
    weight_bytes = hit * per_expert
    row = {"tokens": tokens, **shape, "weights": "fp8" if fp8 else str(dtype).removeprefix("torch."),
           "kernels": "fused" if batch1 is None else "batch1", "batch1_blocks": batch1 or None,
           "experts_hit": hit, "fused_us": t_fused * 1e6,
           "torch_us": t_ref * 1e6, "speedup": t_ref / t_fused, "hit_weight_bytes": weight_bytes,
           "fused_weight_gbps": weight_bytes / t_fused / 1e9, "rel_err": rel_err}
    print(f"{row['weights']:>8} {row['kernels']:>6} T {tokens:>6}: fused {row['fused_us']:9.1f} us ({row['fused_weight_gbps']:7.1f} GB/s "
          f"of {hit} experts' weights)  torch {row['torch_us']:9.1f} us  speedup "
          f"{row['speedup']:6.2f}x  rel err {rel_err:.1e}", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    shape = QUICK if args.quick else QWEN3_30B_A3B
    batch1 = ([{}] * args.batch1 + BATCH1_SWEEP * args.batch1_sweep
              + BATCH1_DOWN_SWEEP * args.batch1_down_sweep)
    rows = [run(shape, tokens, args, dtype, fp8, config)
            for fp8 in [False] + [True] * args.fp8 for tokens in args.tokens
            for config in [None] + (batch1 if tokens == 1 and args.device.type == "cuda" else [])]
    bad = [r for r in rows if not r["rel_err"] < 2e-2]
    for r in bad:
        print(f"MISMATCH: T {r['tokens']}: fused vs torch rel err {r['rel_err']:.3g}", file=sys.stderr)
    if args.output:
        write_json(args.output, {
            "benchmark": "fused_moe", "device": device_name(args.device), "dtype": str(dtype),
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
            "git_commit": git_commit(), "calls_per_graph": args.calls, "repeats": args.repeats,
            "rows": rows})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
