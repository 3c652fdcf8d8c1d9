"""Offline throughput: the same random-token requests through pd-serve's Engine and through
Hugging Face transformers' `generate` on the same model, device and dtype, in one run.

    python bench/offline.py                               # embedded SmolLM2-135M, 16 x (128 in, 64 out)
    python bench/offline.py --num-prompts 64 --hf-batch-size 16 --output result.json
    python bench/offline.py --preset llama3-8b --quantization fp8 --num-prompts 1000 \
        --input-len 1000 --output-len 1000 --skip-hf       # a shape's random weights, on a GPU

Both sides generate exactly --output-len tokens per request (the engine with ignore_eos, HF with
min_new_tokens == max_new_tokens), greedy, after the same warm-up each: one batch of the
measured prompts' shape (up to WARMUP_PROMPTS prompts, other random ids, so the engine's prefix
cache holds none of the measured prompts), 4 tokens out. The first batch of a process pays for
its memory (page faults: on 2 CPU cores 0.7 s of a 2 s prefill), which steady serving does not.
Throughput counts output tokens only; wall time covers the whole generate call (prefill
included).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # `python bench/offline.py` from a checkout without install

import torch  # noqa: E402

from _common import device_name, git_commit, sync, write_json  # noqa: E402
from pd_serve import Engine, SamplingParams  # noqa: E402

NUM_AGREEMENT_TOKENS = 16
WARMUP_PROMPTS = 64
WARMUP_TOKENS = 4
PROGRESS_S = 10.0  # seconds between the engine's progress lines
FIRST_REGULAR_ID = 100  # ids below this are left out of random prompts (special tokens live there)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model folder or llama-architecture .gguf file; "
                   "default: embedded model")
    p.add_argument("--preset", default=None, help="instead of --model: random weights of a "
                   "bench/one_batch.py preset shape (llama3-8b, llama3-1b, tiny); token ids only")
    p.add_argument("--quantization", default=None, choices=["fp8"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch replayed from a CUDA graph (default: the engine's, 256)")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flashinfer", "triton", "torch"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: --num-prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="run the engine only")
    p.add_argument("--output", default=None, help="write a JSON result here")
    args = p.parse_args()
    args.hf_batch_size = args.hf_batch_size or args.num_prompts
    if args.preset and args.model:
        p.error("--preset and --model exclude each other")
    if args.preset or args.quantization:
        args.skip_hf = True  # transformers has neither the random weights nor our FP8 layers
    for name in ("num_prompts", "input_len", "output_len", "hf_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def random_prompts(model_dir: Path, vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` ids drawn from [FIRST_REGULAR_ID, vocab_size), minus added tokens."""
    path = model_dir / "tokenizer.json"
    tokenizer_json = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    added = {t["id"] for t in tokenizer_json.get("added_tokens", [])}
    allowed = torch.tensor([i for i in range(FIRST_REGULAR_ID, vocab_size) if i not in added])
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(allowed), (num, length), generator=gen)  # [N, L]
    return allowed[picks].tolist()


def progress(items, desc: str):
    """tqdm when installed (it is not a dependency), else a line per item on stderr."""
    try:
        from tqdm import tqdm
        return tqdm(items, desc=desc, unit="batch", file=sys.stderr)
    except ImportError:
        def lines():
            for i, item in enumerate(items):
                print(f"{desc}: batch {i + 1}/{len(items)}", file=sys.stderr, flush=True)
                yield item
        return lines()


def run_engine(engine: Engine, prompts: list[list[int]], warmup: list[list[int]],
               output_len: int) -> tuple[list[list[int]], float]:
    """Returns the output ids of each prompt and the seconds taken (a progress line per tenth of
    the requests done, and one every PROGRESS_S with the steps and tokens so far: with hundreds
    of long requests running, the first tenth can take minutes)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.generate(warmup, SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True))
    sync(engine.device)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    step = max(1, len(prompts) // 10)
    steps = tokens = 0
    next_report = start + PROGRESS_S
    while len(done) < len(ids):
        outs = engine.step()
        steps += 1
        for out in outs:
            tokens += len(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out.token_ids
                if len(done) % step == 0 or len(done) == len(ids):
                    print(f"engine: {len(done)}/{len(ids)} requests done, "
                          f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        if (t := time.perf_counter()) >= next_report:
            print(f"engine: {t - start:.0f} s, {steps} steps ({1000 * (t - start) / steps:.1f} ms "
                  f"each), {tokens} tokens out, {len(done)}/{len(ids)} requests done",
                  file=sys.stderr, flush=True)
            next_report = t + PROGRESS_S
    sync(engine.device)
    return [done[i] for i in ids], time.perf_counter() - start


def run_hf(model_dir: Path, device: torch.device, dtype: torch.dtype, prompts: list[list[int]],
           warmup: list[list[int]], output_len: int, batch_size: int) -> tuple[list[list[int]], float]:
    """HF generate in batches of `batch_size`, left-padded; returns output ids and seconds."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(batch: list[list[int]], num_new: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)  # [B, W]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)  # [B, W]
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 min_new_tokens=num_new, max_new_tokens=num_new, pad_token_id=pad_id)
        if tuple(out.shape) != (len(batch), width + num_new):
            raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}, "
                               f"expected {(len(batch), width + num_new)}")
        return out[:, width:].tolist()

    for i in range(0, len(warmup), batch_size):
        generate(warmup[i:i + batch_size], WARMUP_TOKENS)
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    sync(device)
    start = time.perf_counter()
    token_ids = [ids for batch in progress(batches, "transformers") for ids in generate(batch, output_len)]
    sync(device)
    return token_ids, time.perf_counter() - start


def transformers_version() -> str | None:
    try:
        import transformers
        return transformers.__version__
    except ImportError:
        return None


def main() -> None:
    args = parse_args()
    options = dict(device=args.device, dtype=args.dtype, seed=args.seed,
                   quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                   attention_backend=args.attention_backend)
    if args.max_running_requests:
        options["max_running_requests"] = args.max_running_requests
    if args.cuda_graph_max_bs:
        options["cuda_graph_max_bs"] = args.cuda_graph_max_bs
    model = args.model
    if args.preset:  # a config.json of the preset's shape; the weights are random
        from bench.one_batch import PRESETS
        model = Path(tempfile.mkdtemp(prefix="offline-"))
        (model / "config.json").write_text(json.dumps(PRESETS[args.preset]))
        options["load_format"] = "dummy"
    print("engine: building (weights, KV cache, CUDA graphs)", file=sys.stderr, flush=True)
    built = time.perf_counter()
    engine = Engine(model=model, **options)
    print(f"engine: ready in {time.perf_counter() - built:.1f} s", file=sys.stderr, flush=True)
    model_dir, device, dtype = engine.model_dir, engine.device, engine.dtype
    prompts = random_prompts(model_dir, engine.model_config.vocab_size, args.num_prompts,
                             args.input_len, args.seed)
    warmup = random_prompts(model_dir, engine.model_config.vocab_size,
                            min(args.num_prompts, WARMUP_PROMPTS), args.input_len, args.seed + 1)
    torch.manual_seed(args.seed)

    engine_ids, engine_s = run_engine(engine, prompts, warmup, args.output_len)
    # Free the engine (and on GPU its KV pool, sized from free memory) before HF loads.
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    results = {"engine": side_result(sum(len(ids) for ids in engine_ids), engine_s)}
    if not args.skip_hf:
        hf_ids, hf_s = run_hf(model_dir, device, dtype, prompts, warmup, args.output_len,
                              args.hf_batch_size)
        results["transformers"] = side_result(args.output_len * args.num_prompts, hf_s)
        results["ratio"] = results["engine"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
        n = min(NUM_AGREEMENT_TOKENS, args.output_len)
        results["greedy_agreement"] = sum(a[:n] == b[:n] for a, b in zip(engine_ids, hf_ids)) / len(prompts)

    print(f"\nmodel {model_dir}  device {device} ({device_name(device)})  dtype {dtype}  "
          f"{args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out)")
    for side in ("engine", "transformers"):
        if side in results:
            r = results[side]
            print(f"{side:<14}: {r['num_output_tokens']} out tokens in {r['seconds']:.1f} s "
                  f"= {r['tokens_per_s']:6.1f} tok/s")
    if "ratio" in results:
        print(f"ratio engine/transformers = {results['ratio']:.2f}x")
        print(f"greedy agreement (first {min(NUM_AGREEMENT_TOKENS, args.output_len)} tokens) = "
              f"{results['greedy_agreement']:.2f} of requests")

    if args.output:
        record = {"device": str(device), "device_name": device_name(device), "dtype": str(dtype),
                  "model_dir": str(model_dir), "torch_version": torch.__version__,
                  "transformers_version": transformers_version(), "git_commit": git_commit(),
                  "torch_threads": torch.get_num_threads(), "flags": vars(args), **results}
        write_json(args.output, record)


def side_result(num_output_tokens: int, seconds: float) -> dict:
    return {"num_output_tokens": num_output_tokens, "seconds": seconds,
            "tokens_per_s": num_output_tokens / seconds}


if __name__ == "__main__":
    main()
