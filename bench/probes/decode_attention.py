"""Probe (GPU): the Triton decode attention at large batches, under tile-size variants.

Llama-3.1-8B's heads (32 query, 8 KV, head_dim 128, pages of 16), every row the same context,
pages shuffled over the cache; bf16 and FP8 (e4m3) caches. Per variant kernels/paged_attention.py's
decode tile constants (_DECODE_* and, for FP8 caches in one split, _DECODE_FP8_*) are patched, and the kernel
timed over enough layers' caches (cycled) that L2 holds none of them: K/V bytes read per
second, with the copy rate of a large device-to-device copy beside it. Rounds visit every
variant, alternately in and against list order, so drift falls on all alike.

    PYTHONPATH=. python3 bench/probes/decode_attention.py --batch-sizes 256,512 --context 1536 \
        --output OUT.json
"""
import argparse
import json
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

import kernels.paged_attention as pa  # noqa: E402
from bench._common import device_name, git_commit, sync  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
VARIANTS = ([(64, 4, 2), (64, 4, 3), (64, 2, 2), (64, 2, 3), (64, 2, 4), (128, 4, 3), (128, 4, 4),
             (128, 8, 3), (16, 1, 4), (16, 2, 4)]
            + [(32, w, s) for w in (1, 2, 4) for s in (2, 3, 4)])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="256,512")
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--dtypes", default="fp8,bf16")
    p.add_argument("--variants", default=None, help="BLOCK_N:warps:stages,... (default: a grid)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=20, help="timed calls a variant and round")
    p.add_argument("--device", default="cuda", help="cpu: a dry run under PD_SERVE_TRITON_CPU=1")
    p.add_argument("--output", required=True)
    return p.parse_args()


def copy_rate(device: torch.device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (start.elapsed_time(end) / 1e3)


def case(batch: int, context: int, dtype: str, device: torch.device):
    """(caches per layer, q, kv_indptr, kv_indices, seq_lens, bytes read a call)."""
    pages_per_row = -(-context // PAGE)
    num_pages = batch * pages_per_row
    cache_dtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    layer_bytes = 2 * num_pages * PAGE * HKV * D * cache_dtype.itemsize
    layers = max(2, -(-(1 << 30) // layer_bytes)) if device.type == "cuda" else 2  # >= 1 GiB in all: none of it stays in L2
    caches = []
    for _ in range(layers):
        kv = torch.randn(2, num_pages, PAGE, HKV, D, device=device).mul_(0.5).to(cache_dtype)
        caches.append((kv[0], kv[1]))
    q = torch.randn(batch, HQ, D, device=device, dtype=torch.bfloat16)
    kv_indices = torch.randperm(num_pages, device=device, dtype=torch.int64).to(torch.int32)
    kv_indptr = torch.arange(0, num_pages + 1, pages_per_row, device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    read = 2 * batch * context * HKV * D * cache_dtype.itemsize
    return caches, q, kv_indptr, kv_indices, seq_lens, read


def tiles(dtype: str) -> tuple[int, int, int]:
    """The tree's decode tiles for this cache dtype (one split: the batches here)."""
    if dtype == "fp8":
        return pa._DECODE_FP8_BLOCK_N, pa._DECODE_FP8_WARPS, pa._DECODE_FP8_STAGES
    return pa._DECODE_BLOCK_N, pa._DECODE_WARPS, pa._DECODE_STAGES


def set_tiles(variant: tuple[int, int, int]) -> None:
    pa._DECODE_BLOCK_N, pa._DECODE_WARPS, pa._DECODE_STAGES = variant
    pa._DECODE_FP8_BLOCK_N, pa._DECODE_FP8_WARPS, pa._DECODE_FP8_STAGES = variant


def time_variant(variant, caches, q, kv_indptr, kv_indices, seq_lens, calls: int) -> float:
    """Seconds a call, with the variant's constants in place."""
    set_tiles(variant)
    out = torch.empty_like(q)
    scale = D ** -0.5

    def run(i):
        k, v = caches[i % len(caches)]
        pa.paged_decode_attention(q, k, v, kv_indptr, kv_indices, seq_lens, scale, out=out,
                                  k_scale=0.9, v_scale=1.1)
    for i in range(len(caches)):
        run(i)
    sync(q.device)
    t0 = time.perf_counter()
    for i in range(calls):
        run(i)
    sync(q.device)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    defaults = {dtype: tiles(dtype) for dtype in ("fp8", "bf16")}
    variants = ([tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
                if args.variants else list(VARIANTS))
    variants += [v for v in defaults.values() if v not in variants]
    result = {"commit": git_commit(), "device": device_name(device), "heads": [HQ, HKV, D],
              "page_size": PAGE, "context": args.context,
              "defaults": {k: list(v) for k, v in defaults.items()},
              "copy_rate_tb_s": round(copy_rate(device) / 1e12, 3), "cases": []}
    print(f"copy rate {result['copy_rate_tb_s']} TB/s", flush=True)
    for dtype in args.dtypes.split(","):
        default = defaults[dtype]
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            caches, q, kv_indptr, kv_indices, seq_lens, read = case(batch, args.context, dtype,
                                                                    device)
            ref = pa.paged_decode_attention_ref(q[:4], *caches[0], kv_indptr[:5], kv_indices,
                                                seq_lens[:4], D ** -0.5, 0.9, 1.1)
            times = {v: [] for v in variants}
            for r in range(args.rounds):
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    try:
                        times[v].append(time_variant(v, caches, q, kv_indptr, kv_indices,
                                                     seq_lens, args.calls))
                    except Exception as e:  # noqa: BLE001 (a variant out of resources)
                        times[v].append(float("nan"))
                        print(f"{dtype} b{batch} {v}: {type(e).__name__}: {str(e)[:120]}")
            out = torch.empty_like(q)
            set_tiles(default)
            pa.paged_decode_attention(q, *caches[0], kv_indptr, kv_indices, seq_lens, D ** -0.5,
                                      out=out, k_scale=0.9, v_scale=1.1)
            err = (out[:4].float() - ref.float()).abs().max().item()
            rows = []
            for v in variants:
                best = min(times[v])
                rows.append({"block_n": v[0], "warps": v[1], "stages": v[2],
                             "ms": [round(t * 1e3, 4) for t in times[v]],
                             "tb_s": round(read / best / 1e12, 3)})
            rows.sort(key=lambda row: -row["tb_s"] if row["tb_s"] == row["tb_s"] else 0)
            base = next(r for r in rows if (r["block_n"], r["warps"], r["stages"]) == default)
            print(f"{dtype} batch {batch} ctx {args.context}: {read / 1e6:.0f} MB a call, "
                  f"default {default} {base['tb_s']} TB/s, max err vs ref {err:.2e}; best:")
            for row in rows[:6]:
                print(f"  {row['block_n']}:{row['warps']}:{row['stages']}  {row['tb_s']} TB/s  "
                      f"{min(row['ms'])} ms")
            result["cases"].append({"dtype": dtype, "batch": batch, "bytes": read,
                                    "max_abs_err_vs_ref": err, "variants": rows})
            del caches
            torch.cuda.empty_cache()
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
