"""Tensor parallelism per pool, measured: one long prefill with TP 2 against TP 1, and a 1P1D
cluster whose prefill worker has TP 2 and decode worker TP 1, with the hand-off's transfer rate.

    python bench/tp_handoff.py --preset llama3-8b --prefill-tokens 8192 \
        --model DIR --load-format dummy --output bench/results/tp-handoff-2xh200.json

1. Prefill latency: two processes (NCCL on two GPUs, gloo on CPU) build the same random-weight
   model of `--preset`; rank 0 times one `--prefill-tokens` prompt unsharded (TP 1), then both
   time it on their shards (TP 2). Same run, same weights; the ratio TP2 / TP1 is reported.
2. Serving (`--model`, skipped without): `pd-serve launch --prefill-tp 2 --decode-tp 1` on the
   GPUs at hand (prefill ranks on GPU 0 and 1, decode on GPU 0 beside prefill rank 0, so the
   `ipc` backend), `--requests` prompts of `--serve-tokens` random token ids one after another;
   per request the prefill worker's transfer timing (its slowest part: each prefill rank sends
   its KV heads) and bytes (all parts) give the hand-off's rate. That timing starts when the
   forward queues the send, so it also holds the rest of the forward's GPU time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench._common import device_name, git_commit, write_json  # noqa: E402
from bench.one_batch import PRESETS  # noqa: E402
from pd_serve.cache.pool import KVLayout, KVPool  # noqa: E402
from pd_serve.engine.attention import create_backend, resolve_backend_name  # noqa: E402
from pd_serve.engine.attention.base import AttentionMetadata  # noqa: E402
from pd_serve.launch import free_port  # noqa: E402
from pd_serve.model.config import ModelConfig  # noqa: E402
from pd_serve.model.loader import dummy_model  # noqa: E402
from pd_serve.model.parallel import TPGroup, shard_model  # noqa: E402

PAGE_SIZE = 16
SERVE_MAX_TOKENS = 8  # tokens each served request generates


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="auto", help="auto (cuda with two GPUs), cuda, cpu")
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default=None, help="checkpoint folder to serve (part 2); none: skip it")
    p.add_argument("--load-format", default="auto", help="passed to the workers (dummy: random weights)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--serve-tokens", type=int, default=2048)
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def _prefill_seconds(model, device: torch.device, dtype: torch.dtype, tokens: int, repeats: int,
                     barrier=None) -> list[float]:
    """Seconds of one `tokens`-long prefill (forward + last-token logits), `repeats` times after
    a warm-up; `barrier` (TP) lines the ranks up before each."""
    cfg = model.config
    layout = KVLayout(cfg.num_layers, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim,
                      str(dtype).removeprefix("torch."))
    pages = -(-tokens // PAGE_SIZE)
    pool = KVPool(layout, pages, device)
    backend = resolve_backend_name("auto", device, dtype, cfg.head_dim)
    attn = create_backend(backend, pool, cfg.num_heads, cfg.head_dim, cfg.head_dim ** -0.5, dtype)
    ids = torch.randint(cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(tokens, device=device)
    meta = AttentionMetadata(query_lens=[tokens], seq_lens=[tokens], page_tables=[list(range(pages))],
                             slot_mapping=positions.clone())
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            if barrier:
                barrier()
            _sync(device)
            start = time.perf_counter()
            attn.plan(meta)
            hidden = model(ids, positions, attn)
            model.compute_logits(hidden[-1:])
            _sync(device)
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - start)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, port: int, args: argparse.Namespace, out) -> None:
    on_cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    full = dummy_model(ModelConfig.from_dict(PRESETS[args.preset]), dtype, device, seed=0)
    record = {}
    if rank == 0:
        record["tp1_seconds"] = _prefill_seconds(full, device, dtype, args.prefill_tokens, args.repeats)
    dist.barrier()
    shard = shard_model(full, TPGroup(rank, 2))
    del full
    if on_cuda:
        torch.cuda.empty_cache()
    record["tp2_seconds"] = _prefill_seconds(shard, device, dtype, args.prefill_tokens, args.repeats,
                                             barrier=dist.barrier)
    if rank == 0:
        out.put(record)
    dist.barrier()
    dist.destroy_process_group()


def prefill_latency(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    record = out.get(timeout=1800)
    for p in procs:
        p.join(timeout=120)
    tp1, tp2 = statistics.median(record["tp1_seconds"]), statistics.median(record["tp2_seconds"])
    print(f"prefill of {args.prefill_tokens} tokens ({args.preset}): TP 1 {tp1 * 1e3:.1f} ms, "
          f"TP 2 {tp2 * 1e3:.1f} ms (median of {args.repeats}): TP2 / TP1 = {tp2 / tp1:.3f}")
    return dict(record, tokens=args.prefill_tokens, tp1_median_s=tp1, tp2_median_s=tp2,
                latency_ratio_tp2_to_tp1=tp2 / tp1)


def serving(args: argparse.Namespace) -> dict:
    import openai

    from pd_serve.launch import LocalCluster

    on_cuda = args.device == "cuda"
    engine_args = ["--model", args.model, "--load-format", args.load_format,
                   "--device", "cuda" if on_cuda else "cpu"]
    if on_cuda:  # decode shares GPU 0 with prefill rank 0: ipc, and room for both
        engine_args += ["--transfer-backend", "ipc", "--mem-fraction-static", "0.4"]
    port = free_port()
    cluster = LocalCluster(port=port, engine_args=engine_args, gateway_args=["--model", args.model],
                           log_level="warning", gpu_ids=["0", "1"] if on_cuda else None,
                           role_tp={"prefill": 2, "decode": 1})
    rows = []
    try:
        cluster.wait_ready(timeout_s=900)
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0,
                               timeout=300)
        model = client.models.list().data[0].id
        gen = torch.Generator().manual_seed(1)
        for i in range(args.requests):
            prompt = torch.randint(1000, 30000, (args.serve_tokens,), generator=gen).tolist()
            reply = client.completions.create(model=model, prompt=prompt, temperature=0,
                                              max_tokens=SERVE_MAX_TOKENS,
                                              extra_body={"ignore_eos": True})
            t = (reply.model_extra or {}).get("timings", {})
            rows.append(dict(transfer_s=t.get("transfer"), transfer_bytes=t.get("transfer_bytes"),
                             completion_tokens=reply.usage.completion_tokens))
            print(f"[{i + 1}/{args.requests}] transfer {rows[-1]['transfer_s'] * 1e3:.2f} ms, "
                  f"{rows[-1]['transfer_bytes'] / 2**20:.1f} MiB", flush=True)
    finally:
        cluster.stop()
    rates = [r["transfer_bytes"] / r["transfer_s"] / 1e9 for r in rows if r["transfer_s"]]
    summary = dict(requests=rows, prompt_tokens=args.serve_tokens,
                   completed=sum(r["completion_tokens"] == SERVE_MAX_TOKENS for r in rows),
                   transfer_gbps_median=statistics.median(rates) if rates else None)
    print(f"1P(TP2)-1D(TP1): {summary['completed']} of {args.requests} requests completed; "
          f"hand-off {summary['transfer_gbps_median']} GB/s (median)")
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs two GPUs (TP 2)")
    record = dict(benchmark="tp_handoff", preset=args.preset, device=args.device,
                  device_name=device_name(torch.device(args.device)), git_commit=git_commit(),
                  torch_version=torch.__version__, flags=vars(args))
    record["prefill"] = prefill_latency(args)
    if args.model:
        record["serving"] = serving(args)
    if args.output:
        write_json(args.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
