"""MLA decode attention (kernels/mla_decode.py) against its torch reference and flashinfer's MLA
paged decode, at DeepSeek-V2-Lite (16 heads) and DeepSeek-V3 (128 heads) shapes.

    python bench/mla_decode.py        # GPU only: bench/results/mla-decode-<gpu>.json
    python bench/mla_decode.py --heads 16 --batch 1 --context 1024 --output /tmp/one.json

Per case (heads, page size, batch, context): R 512, Dr 64, bf16, every row `context` tokens
on shuffled pages of one cache [P, S, 1, 576]. Ours and flashinfer's
(flashinfer.mla.BatchMLAPagedAttentionWrapper, planned once per case outside the timing, given
contiguous copies of q_nope / q_pe and of the cache's latent / k_pe parts) are timed in CUDA
graphs of --calls calls (bench/w4a16.py's seconds_per_call), the reference eagerly (it syncs);
medians over --repeats. `bytes` is the rows' cached entries, (R + Dr) x 2 bytes a token, each
read once; GB/s = bytes / time. Errors are max abs differences from the reference computed on
float32 copies of the inputs. When flashinfer does not import or fails on a case, its fields
are null and `flashinfer_error` says why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/mla_decode.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import device_name, git_commit, write_json  # noqa: E402
from bench.fused_moe import eager_seconds  # noqa: E402
from bench.w4a16 import seconds_per_call  # noqa: E402
from kernels import mla_decode  # noqa: E402
from kernels.mla_decode import mla_decode_attention, mla_decode_attention_ref  # noqa: E402

RANK, ROPE = 512, 64  # DeepSeek-V2/V3's kv_lora_rank and rope dims
SCALE = 192 ** -0.5  # their softmax scale: qk head dim 128 + 64 before absorption
DTYPE = torch.bfloat16


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=_ints, default=[16, 128], help="comma list (default 16,128)")
    p.add_argument("--page-sizes", type=_ints, default=[64, 16], help="default 64,16")
    p.add_argument("--batch", type=_ints, default=[1, 8, 64], help="default 1,8,64")
    p.add_argument("--context", type=_ints, default=[1024, 4096], help="default 1024,4096")
    p.add_argument("--num-splits", type=int, default=None,
                   help="our kernel's splits (default: its shape rule)")
    p.add_argument("--configs", default=None,
                   help="our kernel's tilings to time, KEYSxWARPSxSTAGES[xHEADS] comma list "
                        "(default: the module's own); ours_us is the first's, ours_by_config has "
                        "them all")
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph (default 20)")
    p.add_argument("--repeats", type=int, default=20, help="timed replays (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", "--out", default=None,
                   help="JSON path (default bench/results/mla-decode-<gpu>.json)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the kernels and flashinfer are timed on one)")
    args.device = torch.device("cuda")
    default = f"{mla_decode._BLOCK_N}x{mla_decode._WARPS}x{mla_decode._STAGES}x{mla_decode._BLOCK_H}"
    args.configs = [c.strip() for c in (args.configs or default).split(",")]
    if args.output is None:
        gpu = torch.cuda.get_device_name(args.device).split()[-1].lower()
        args.output = str(Path(__file__).parent / "results" / f"mla-decode-{gpu}.json")
    return args


def make_case(batch: int, context: int, heads: int, page_size: int, device, seed: int):
    """q [B, H, 576] and a cache of the rows' pages only, shuffled; int32 page lists."""
    gen = torch.Generator(device).manual_seed(seed)
    pages_per_row = -(-context // page_size)
    num_pages = batch * pages_per_row
    cache = torch.randn(num_pages, page_size, 1, RANK + ROPE, generator=gen,
                        device=device).to(DTYPE)
    q = torch.randn(batch, heads, RANK + ROPE, generator=gen, device=device).to(DTYPE)
    kv_indices = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages_per_row
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, cache, kv_indptr, kv_indices, seq_lens


def flashinfer_call(q, cache, kv_indptr, kv_indices, seq_lens):
    """flashinfer's MLA decode of the case, planned: a call that writes its output."""
    import flashinfer.mla
    batch, heads, _ = q.shape
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, seq_lens, heads, RANK, ROPE, cache.shape[1],
                 False, SCALE, q.dtype, cache.dtype)
    q_nope, q_pe = q[..., :RANK].contiguous(), q[..., RANK:].contiguous()
    ckv, kpe = cache[:, :, 0, :RANK].contiguous(), cache[:, :, 0, RANK:].contiguous()
    out = torch.empty(batch, heads, RANK, dtype=q.dtype, device=q.device)
    return out, lambda: wrapper.run(q_nope, q_pe, ckv, kpe, out=out)


def run_case(heads: int, page_size: int, batch: int, context: int, args) -> dict:
    q, cache, *pages = make_case(batch, context, heads, page_size, args.device, args.seed)
    want = mla_decode_attention_ref(q.float(), cache.float(), *pages, SCALE, RANK)
    ours = torch.empty(batch, heads, RANK, dtype=DTYPE, device=args.device)
    ours_call = lambda: mla_decode_attention(q, cache, *pages, SCALE, RANK, out=ours,  # noqa: E731
                                             num_splits=args.num_splits)
    num_bytes = batch * context * (RANK + ROPE) * cache.element_size()
    by_config, errors = {}, {}
    for name in args.configs:
        keys, warps, stages, *per_program = map(int, name.split("x"))
        mla_decode._BLOCK_N, mla_decode._WARPS, mla_decode._STAGES = keys, warps, stages
        mla_decode._BLOCK_H = per_program[0] if per_program else 16
        ours.zero_()
        ours_call()  # compiles outside the graph
        errors[name] = _err(ours, want)
        by_config[name] = seconds_per_call(ours_call, args.device, args.calls, args.repeats) * 1e6
    t_ours = by_config[args.configs[0]] / 1e6
    t_ref = eager_seconds(lambda: mla_decode_attention_ref(q, cache, *pages, SCALE, RANK),
                          args.device, min(args.repeats, 5))
    row = {"heads": heads, "page_size": page_size, "batch": batch, "context": context,
           "bytes": num_bytes, "ours_us": t_ours * 1e6, "ours_gbps": num_bytes / t_ours / 1e9,
           "torch_us": t_ref * 1e6, "ours_max_abs_err": max(errors.values()),
           "ours_by_config": by_config, "best_config": min(by_config, key=by_config.get),
           "flashinfer_us": None, "flashinfer_gbps": None, "flashinfer_max_abs_err": None,
           "flashinfer_error": None}
    try:
        fi_out, fi_call = flashinfer_call(q, cache, *pages)
        fi_call()
        row["flashinfer_max_abs_err"] = _err(fi_out, want)
        t_fi = seconds_per_call(fi_call, args.device, args.calls, args.repeats)
        row |= {"flashinfer_us": t_fi * 1e6, "flashinfer_gbps": num_bytes / t_fi / 1e9}
    except Exception as e:  # not installed, or this case unsupported: record why, go on
        row["flashinfer_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    fi = (f"flashinfer {row['flashinfer_us']:8.1f} us ({row['flashinfer_gbps']:6.0f} GB/s, "
          f"err {row['flashinfer_max_abs_err']:.1e})" if row["flashinfer_us"] is not None
          else f"flashinfer -- {row['flashinfer_error'][:60]}")
    print(f"H {heads:3d} S {page_size:2d} B {batch:2d} ctx {context:4d}: ours "
          f"{row['ours_us']:8.1f} us ({row['ours_gbps']:6.0f} GB/s, err "
          f"{row['ours_max_abs_err']:.1e}; best {row['best_config']} "
          f"{by_config[row['best_config']]:.1f} us)  torch {row['torch_us']:9.1f} us  {fi}",
          file=sys.stderr, flush=True)
    return row


def _err(out: torch.Tensor, want: torch.Tensor) -> float:
    return (out.float() - want).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import flashinfer
        flashinfer_version = getattr(flashinfer, "__version__", "unknown")
    except Exception as e:
        flashinfer_version = f"not importable: {type(e).__name__}: {e}"
    rows = [run_case(h, s, b, c, args) for h in args.heads for s in args.page_sizes
            for b in args.batch for c in args.context]
    write_json(args.output, {
        "benchmark": "mla_decode", "device": device_name(args.device), "dtype": "bfloat16",
        "kv_lora_rank": RANK, "rope_dims": ROPE, "scale": SCALE, "num_splits": args.num_splits,
        "configs": args.configs,
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "flashinfer_version": flashinfer_version, "git_commit": git_commit(),
        "calls_per_graph": args.calls, "repeats": args.repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
