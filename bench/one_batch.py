"""One batch at a time (SGLang's bench_one_batch in spirit): prefill and decode steps of the
engine on random (dummy) weights of a preset shape, each set against a floor from ceilings
measured in the same run, and against Hugging Face transformers on the same weights.

    python -m bench.one_batch --preset llama3-8b --output bench/results/one-batch-h200-llama3-8b.json
    python -m bench.one_batch --preset tiny --device cpu --no-hf      # a CPU smoke run

Ceilings (same run, same device): the copy rate of one large device-to-device copy, counted as
bytes read + bytes written over time (as DESIGN.md's 4,172 GB/s), and the rate of an n^3 matmul
in the run's dtype (8192^3 on GPU); both the median of timed repeats after warm-up.

Prefill: for each (batch, length) of --prefill-grid, `batch` requests of `length` random token
ids; one EngineCore.step() prefills them all (warm-up once per shape, then --prefill-repeats
timed steps, median). FLOPs: "linear" = 2 x (decoder linear-layer weights x tokens + LM head x
one row per sequence); "all params" = 2 x every parameter x tokens (DESIGN.md's "2 x params x
tokens"); attention = 4 x layers x heads x head_dim x the causal (query, key) pairs, reported
apart. floor_s = linear FLOPs / matmul rate; ratio_to_floor = measured / floor (>= 1).

Decode: for each batch size x context, `batch` requests of `context` random ids are prefilled
by ordinary (chunked) engine steps (or, --decode-fill direct, admitted with their pages as a
decode worker admits transferred KV), then --decode-warmup steps, then --decode-steps timed
steps; each a whole EngineCore.step() (scheduling, the runner, sampling: the honest cost).
floor = (weight bytes + KV bytes read by the step) / copy rate, where weight bytes = every
parameter (DESIGN.md's bs1 floor: 16.1 GB / 4.17 TB/s = 3.85 ms for Llama-3-8B) and KV bytes =
the batch's mean context during the timed steps x bytes per token. Cases whose KV does not fit
the memory budget are skipped (the JSON says why).

The grids default to the GPU sizes named in the flags' help, or to small ones on CPU. One KV
pool serves every case: the largest need that fits the budget (free GPU memory less weights
and activations, or --kv-budget-gb); the engine and its pool are freed before transformers
loads. A failing case is recorded (`error`) and the others still run; the exit status is then 1.
--output is rewritten after every case ("complete": false until the end), so a run cut short
keeps what it measured.

Transformers (--hf, on by default on GPU): LlamaForCausalLM of the preset config, same dtype
and device, loaded with to_hf_state_dict(our model); decode steps (a forward of one token per
row with past_key_values, then argmax) at --hf-batch-sizes x --hf-context after a prefill that
fills the cache, and the --hf-prefill forward (logits of the last token only). ours_over_hf =
our tokens/s / transformers' tokens/s on the same case (> 1: we are faster).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import inspect
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere
if __package__ in (None, ""):  # `python bench/one_batch.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import device_name, git_commit, sync, write_json  # noqa: E402
from pd_serve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pd_serve.engine.core import EngineCore  # noqa: E402
from pd_serve.engine.request import FinishReason, Request  # noqa: E402
from pd_serve.engine.sampling_params import SamplingParams  # noqa: E402
from pd_serve.model.config import ModelConfig, resolve_dtype  # noqa: E402
from pd_serve.model.hf_export import to_hf_model  # noqa: E402
from pd_serve.model.llama import CausalLM  # noqa: E402

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
              rms_norm_eps=1e-5, attention_bias=False, bos_token_id=128000, eos_token_id=128001)
PRESETS = {  # Hugging Face config.json contents
    "llama3-8b": dict(_LLAMA, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                      vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8192),
                      tie_word_embeddings=False),
    "llama3-1b": dict(_LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                      vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8192),
                      tie_word_embeddings=True),
    "tiny": dict(_LLAMA, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=2048,
                 max_position_embeddings=8192, rope_theta=500000.0,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=1024),
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
GiB = 1 << 30
# (copy bytes, matmul n, timed repeats) per device type
CEILING_SIZES = {"cuda": (GiB, 8192, 20), "cpu": (64 << 20, 512, 5)}
DEFAULT_GRIDS = {  # on GPU (True) and on CPU (False)
    True: dict(batch_sizes=[1, 8, 32, 64, 128, 256], contexts=[1024, 4096],
               prefill_grid=[(1, 512), (1, 2048), (4, 2048), (1, 8192)]),
    False: dict(batch_sizes=[1, 8, 32], contexts=[256, 1024],
                prefill_grid=[(1, 128), (1, 512), (4, 512)]),
}
GREEDY = dict(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)  # requests run until ended
KV_BUDGET_FRACTION = 0.92  # of free GPU memory, for weights + KV + activations
FIXED_RESERVE = 4 * GiB  # CUDA graphs, workspaces, allocator slack


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), "
                   "bfloat16, float16, float32")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flashinfer", "triton", "torch"])
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="decode steps wait for their tokens before the next is planned")
    p.add_argument("--batch-sizes", type=_ints, help="decode batch sizes (comma list); default "
                   "1,8,32,64,128,256 on GPU, 1,8,32 on CPU")
    p.add_argument("--contexts", type=_ints, help="decode contexts; default 1024,4096 on GPU, "
                   "256,1024 on CPU")
    p.add_argument("--prefill-grid", type=_pairs, help="prefill cases, BATCHxLENGTH comma list; "
                   "default 1x512,1x2048,4x2048,1x8192 on GPU, 1x128,1x512,4x512 on CPU")
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per case")
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument("--decode-fill", default="prefill", choices=["prefill", "direct"],
                   help="how decode cases reach their context: prefill steps, or direct (pages "
                   "allocated and the prompt counted as computed, as a decode worker admits "
                   "transferred KV; the step's work is the same, the fill takes no time)")
    p.add_argument("--profile", action="store_true",
                   help="per decode case, also keep the host functions that cost the most per "
                   "step (cProfile: host_profile) and the graph's kernels by GPU time "
                   "(torch.profiler: kernel_profile)")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None,
                   help="compare with transformers (default: on GPU only)")
    p.add_argument("--hf-batch-sizes", type=_ints, default=[1, 64])
    p.add_argument("--hf-context", type=int, default=None, help="default: the first --contexts")
    p.add_argument("--hf-prefill", type=_pairs, default=[(4, 2048)], help="BATCHxLENGTH")
    p.add_argument("--kv-budget-gb", type=float, default=None,
                   help="KV pool limit; default: what free GPU memory leaves, 4 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    for name in ("prefill_repeats", "decode_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.decode_warmup < 0:
        p.error("--decode-warmup must be >= 0")
    return args


def fill_defaults(args: argparse.Namespace, device: torch.device) -> None:
    """The grids not given on the command line: the GPU ones, or smaller ones on CPU."""
    for name, value in DEFAULT_GRIDS[device.type == "cuda"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.hf_context = args.hf_context or args.contexts[0]


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _pairs(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(v) for v in x.lower().split("x")) for x in text.split(",") if x.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BATCHxLENGTH[,BATCHxLENGTH...]")
    return pairs


class Progress:
    """One stderr line per finished case: `[####------] 3/20  what: result  (elapsed)`."""

    def __init__(self, total: int, width: int = 20):
        self.total, self.width, self.done, self.start = total, width, 0, time.perf_counter()

    def case(self, what: str, result: str) -> None:
        self.done += 1
        filled = self.width * self.done // max(1, self.total)
        print(f"[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total}  {what}: "
              f"{result}  ({time.perf_counter() - self.start:.0f} s)", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- ceilings

def time_each(fn, device: torch.device, repeats: int, warmup: int = 3) -> list[float]:
    """Seconds of each of `repeats` calls of fn, after `warmup` calls (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        return seconds
    with torch.cuda.device(device):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> dict:
    num_bytes, n, repeats = CEILING_SIZES[device.type]
    copy = _copy_seconds(device, num_bytes, repeats)
    matmul = _matmul_seconds(device, dtype, n, repeats)
    _free_memory(device)
    return {
        "copy": {"num_bytes": num_bytes, "bytes_counted": 2 * num_bytes, "repeats": repeats,
                 "median_gbps": 2 * num_bytes / statistics.median(copy) / 1e9,
                 "best_gbps": 2 * num_bytes / min(copy) / 1e9,
                 "what": "dst.copy_(src) within the device; GB/s = (bytes read + bytes written) / s"},
        "matmul": {"n": n, "dtype": str(dtype).removeprefix("torch."), "flops": 2 * n ** 3,
                   "repeats": repeats,
                   "median_tflops": 2 * n ** 3 / statistics.median(matmul) / 1e12,
                   "best_tflops": 2 * n ** 3 / min(matmul) / 1e12},
    }


def _copy_seconds(device: torch.device, num_bytes: int, repeats: int) -> list[float]:
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return time_each(lambda: dst.copy_(src), device, repeats)


def _matmul_seconds(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> list[float]:
    a = torch.randn(n, n, device=device, dtype=dtype)  # [n, n]
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return time_each(lambda: torch.matmul(a, b, out=out), device, repeats)


# ----------------------------------------------------------------------------- accounting

def param_counts(model: torch.nn.Module) -> dict:
    """Parameters by role: every one (tied ones once), decoder linear layers, the LM head."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    linear = sum(p.numel() for name, p in model.named_parameters()
                 if name.startswith("model.layers.") and name.endswith("_proj.weight"))
    return {"all": total, "decoder_linear": linear, "lm_head": cfg.vocab_size * cfg.hidden_size,
            "embedding": cfg.vocab_size * cfg.hidden_size, "tied": cfg.tie_word_embeddings}


def attention_flops(cfg: ModelConfig, lengths: list[int]) -> int:
    """Causal self-attention of whole sequences: QK^T and PV, 2 FLOPs per multiply-add each."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs


def kv_tokens_needed(batch: int, length: int, extra: int, page_size: int) -> int:
    """Pool tokens `batch` sequences of length + extra occupy, in whole pages."""
    return batch * -(-(length + extra) // page_size) * page_size


# ----------------------------------------------------------------------------- engine cases

def random_ids(gen: torch.Generator, vocab: int, num: int, length: int) -> list[list[int]]:
    return torch.randint(vocab, (num, length), generator=gen).tolist()  # [num, length]


def add_requests(core: EngineCore, prompts: list[list[int]]) -> list[Request]:
    requests = [Request(p, SamplingParams(**GREEDY)) for p in prompts]
    for r in requests:
        core.scheduler.add(r)
    return requests


def clear(core: EngineCore) -> None:
    """End every request, so the next case starts with an empty batch and every page free."""
    for r in list(core.scheduler.running) + list(core.scheduler.waiting):
        core.scheduler.finish(r, FinishReason.ABORT)
    core.drain()  # a step still in flight (overlap schedule) holds its pages until done
    if core.allocator.num_free_pages != core.allocator.num_pages:
        raise RuntimeError(f"{core.allocator.num_used_pages} KV pages still in use after a case")


def run_prefill(core: EngineCore, gen: torch.Generator, batch: int, length: int,
                repeats: int) -> list[float]:
    """Seconds of `repeats` timed steps that each prefill `batch` fresh prompts (one warm-up).
    A lone step has nothing to overlap with: the overlap schedule is off here."""
    overlap, core.overlap = core.overlap, False
    try:
        return _prefill_seconds(core, gen, batch, length, repeats)
    finally:
        core.overlap = overlap


def _prefill_seconds(core: EngineCore, gen: torch.Generator, batch: int, length: int,
                     repeats: int) -> list[float]:
    seconds = []
    for i in range(repeats + 1):
        add_requests(core, random_ids(gen, core.model_config.vocab_size, batch, length))
        sync(core.device)
        start = time.perf_counter()
        plan, _ = core.step()
        sync(core.device)
        if i > 0:
            seconds.append(time.perf_counter() - start)
        clear(core)
        if plan.num_tokens != batch * length:
            raise RuntimeError(f"one step prefilled {plan.num_tokens} of {batch * length} tokens")
    return seconds


def run_decode(core: EngineCore, gen: torch.Generator, batch: int, context: int, warmup: int,
               steps: int, fill: str = "prefill", profile: bool = False) -> dict:
    """Bring `batch` prompts of `context` ids to decoding (see --decode-fill), then time
    `steps` whole decode steps."""
    prompts = random_ids(gen, core.model_config.vocab_size, batch, context)
    fill_steps = 0
    if fill == "direct":
        requests = [fill_direct(core, p) for p in prompts]
    else:
        requests = add_requests(core, prompts)
        while any(not r.output_token_ids for r in requests):
            plan, _ = core.step()
            fill_steps += 1
            if plan.preempted or plan.finished:
                raise RuntimeError("the KV pool ran out while prefilling (preemption)")
    for _ in range(warmup):
        core.step()
    before = [r.num_tokens for r in requests]  # a token still pending (overlap) counts
    first_seq_lens = sum(before)  # KV read per row by the first timed step
    sync(core.device)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync(core.device)
    seconds = time.perf_counter() - start
    core.drain()
    if any(r.num_tokens != n + steps for r, n in zip(requests, before)):
        raise RuntimeError(f"the timed steps did not add {steps} tokens to each of {batch} rows")
    # The GPU's share: replay the last step's CUDA graph alone (it rewrites the same KV slots),
    # so step time - replay time is the host's (scheduling, planning, sampling, syncs).
    buckets = [bs for bs in core.runner.graphs if bs >= batch]
    replay_s = None
    if buckets:
        graph = core.runner.graphs[min(buckets)]
        replay_s = statistics.median(time_each(graph.replay, core.device, repeats=steps))
    host = profile_steps(core, steps) if profile else None
    kernels = profile_kernels(graph.replay, steps) if profile and buckets else None
    clear(core)
    return {"seconds": seconds, "fill_steps": fill_steps, "graph_replay_s": replay_s,
            "mean_context": first_seq_lens / batch + (steps - 1) / 2, "host_profile": host,
            "kernel_profile": kernels}


def profile_steps(core: EngineCore, steps: int, top: int = 15) -> list[dict]:
    """The functions with the most own time over `steps` decode steps under cProfile, per step
    (cProfile slows Python code down, so read these as shares, not as absolute times)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        core.step()
    sync(core.device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, _)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": n / steps,
             "own_ms_per_step": tt / steps * 1e3, "cum_ms_per_step": ct / steps * 1e3}
            for (f, line, name), (_, n, tt, ct, _) in rows]


def profile_kernels(replay, steps: int, top: int = 20) -> list[dict]:
    """GPU time per step of each kernel in the decode graph (torch.profiler over `steps`
    replays), the costliest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:160], "calls_per_step": e.count / steps,
             "us_per_step": e.device_time_total / steps} for e in kernels[:top]]


def fill_direct(core: EngineCore, prompt: list[int]) -> Request:
    """Admit a request as a decode worker admits one whose KV arrived (decode/worker.py): the
    prompt's pages allocated and counted as computed, token 1 given. The pages keep whatever
    the pool holds; attention costs the same whatever the values."""
    page_ids = core.allocator.allocate(-(-len(prompt) // core.kv_pool.layout.page_size))
    if page_ids is None:
        raise RuntimeError("the KV pool ran out (direct fill)")
    request = Request(prompt, SamplingParams(**GREEDY), page_ids=page_ids,
                      num_computed_tokens=len(prompt))
    request.output_token_ids.append(prompt[-1])
    core.scheduler.add_running(request)
    return request


def build_core(args, model_dir: Path, cfg: ModelConfig, device: torch.device,
               dtype: torch.dtype) -> tuple[EngineCore, dict]:
    """The engine, with a KV pool for the largest case that fits; returns it and the
    per-case KV need (tokens) and the pool size chosen."""
    page_size = CacheConfig().page_size
    # One step prefills a whole grid case; a decode batch leaves room for prefill beside it.
    chunk = max([b * n for b, n in args.prefill_grid] + [2 * b for b in args.batch_sizes])
    # Tokens a decode case's rows may grow by: decodes during the fill (at most one per fill
    # step; decodes share the step's token budget with the prefill), warm-up, timed steps.
    extra = {(b, c): -(-b * c // (chunk - b)) + 1 + args.decode_warmup + args.decode_steps + 2
             for b in args.batch_sizes for c in args.contexts}
    need = {("prefill", b, n): kv_tokens_needed(b, n, 0, page_size) for b, n in args.prefill_grid}
    need.update({("decode", b, c): kv_tokens_needed(b, c, extra[b, c], page_size)
                 for b, c in extra})
    with torch.device("meta"):
        weight_bytes = sum(p.numel() for p in CausalLM(cfg).parameters()) * dtype.itemsize
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    if args.kv_budget_gb is not None:
        budget = args.kv_budget_gb * 1e9
    elif device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        activations = 4 * chunk * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * dtype.itemsize
        budget = free * KV_BUDGET_FRACTION - weight_bytes - activations - FIXED_RESERVE
    else:
        budget = 4e9
    fits = int(budget // kv_bytes_per_token)
    pool_tokens = max([page_size] + [t for t in need.values() if t <= fits])
    longest = max([n for _, n in args.prefill_grid] + [c + extra[b, c] for b, c in extra])
    max_batch = max(args.batch_sizes + [b for b, _ in args.prefill_grid])
    config = EngineConfig(
        model=str(model_dir), device=str(device), dtype=str(dtype).removeprefix("torch."),
        load_format="dummy", seed=args.seed, attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph, disable_overlap_schedule=args.disable_overlap_schedule,
        context_length=min(cfg.max_position_embeddings, longest + page_size),
        cache=CacheConfig(max_total_tokens=pool_tokens),
        scheduler=SchedulerConfig(max_running_requests=max_batch, chunked_prefill_size=chunk))
    info = {"pool_tokens": pool_tokens, "budget_bytes": int(budget), "need": need,
            "chunked_prefill_size": chunk, "context_length": config.context_length,
            "kv_bytes_per_token": kv_bytes_per_token}
    return EngineCore(config), info


# ----------------------------------------------------------------------------- transformers

def hf_forward(hf, ids: torch.Tensor, cache=None):
    """One forward (logits of the last position only where supported) -> (argmax [B, 1], cache).

    transformers renamed `past_key_values` to `cache` (argument and output) during 5.x."""
    params = inspect.signature(hf.forward).parameters
    kwargs = {"use_cache": True}
    if cache is not None:
        kwargs["cache" if "cache" in params else "past_key_values"] = cache
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    out = hf(input_ids=ids, **kwargs)
    cache = getattr(out, "cache", None)
    return out.logits[:, -1:].argmax(-1), cache if cache is not None else out.past_key_values


@torch.inference_mode()
def run_hf_decode(hf, gen: torch.Generator, vocab: int, batch: int, context: int, warmup: int,
                  steps: int) -> dict:
    """Prefill `batch` random prompts of `context` ids into a cache, then time `steps` steps of
    one token per row (forward + argmax)."""
    device = hf.device
    ids = torch.randint(vocab, (batch, context), generator=gen).to(device)  # [B, ctx]
    next_ids, cache = hf_forward(hf, ids)
    for _ in range(warmup):
        next_ids, cache = hf_forward(hf, next_ids, cache)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        next_ids, cache = hf_forward(hf, next_ids, cache)
    sync(device)
    seconds = time.perf_counter() - start
    del cache
    return {"seconds": seconds, "mean_context": context + 1 + warmup + (steps - 1) / 2}


@torch.inference_mode()
def run_hf_prefill(hf, gen: torch.Generator, vocab: int, batch: int, length: int,
                   repeats: int) -> list[float]:
    """Seconds of `repeats` timed forwards of `batch` fresh prompts (one warm-up)."""
    device = hf.device
    seconds = []
    for i in range(repeats + 1):
        ids = torch.randint(vocab, (batch, length), generator=gen).to(device)  # [B, L]
        sync(device)
        start = time.perf_counter()
        _, cache = hf_forward(hf, ids)
        sync(device)
        del cache
        if i > 0:
            seconds.append(time.perf_counter() - start)
    return seconds


# ----------------------------------------------------------------------------- figures

DEFINITIONS = {
    "copy_rate": "one large dst.copy_(src) on the device: (bytes read + bytes written) / s, median",
    "matmul_rate": "n^3 matmul in the run's dtype (8192 on GPU): 2 n^3 / s, median",
    "prefill.flops_linear": "2 x (decoder linear weights (q/k/v/o/gate/up/down) x tokens "
                            "+ LM head weights x one row per sequence)",
    "prefill.flops_all_params": "2 x every parameter (tied ones once) x tokens (DESIGN.md's figure)",
    "prefill.flops_attention": "4 x layers x heads x head_dim x causal (query, key) pairs; not in "
                               "the floor",
    "prefill.floor_s": "flops_linear / matmul rate; ratio_to_floor = seconds / floor_s",
    "prefill.fraction_of_matmul_*": "FLOPs of that count / seconds / matmul rate",
    "prefill.seconds": "median wall time of one EngineCore.step() prefilling the whole batch",
    "decode.floor_ms": "(weight_bytes + kv_bytes) / copy rate; weight_bytes = every parameter "
                       "(the embedding table too, as DESIGN.md's 16.1 GB), kv_bytes = batch x "
                       "mean context during the timed steps x KV bytes per token",
    "decode.ms_per_step": "wall time of whole EngineCore.step() calls (schedule, run, sample)",
    "decode.graph_replay_ms": "CUDA-event time of replaying the step's decode graph alone (the "
                              "GPU's share; ms_per_step minus this is host time not overlapped)",
    "ours_over_hf": "our tokens/s / transformers' tokens/s on the same case (> 1: ours faster)",
}


def prefill_figures(cfg: ModelConfig, counts: dict, batch: int, length: int,
                    seconds: list[float], matmul_fps: float) -> dict:
    t = statistics.median(seconds)
    tokens = batch * length
    linear = 2 * (counts["decoder_linear"] * tokens + counts["lm_head"] * batch)
    all_params = 2 * counts["all"] * tokens
    attn = attention_flops(cfg, [length] * batch)
    floor = linear / matmul_fps
    return {"seconds": t, "samples": seconds, "tokens_per_s": tokens / t,
            "flops_linear": linear, "flops_all_params": all_params, "flops_attention": attn,
            "floor_s": floor, "ratio_to_floor": t / floor,
            "fraction_of_matmul_linear": linear / t / matmul_fps,
            "fraction_of_matmul_all_params": all_params / t / matmul_fps,
            "fraction_of_matmul_linear_plus_attention": (linear + attn) / t / matmul_fps}


def decode_figures(r: dict, batch: int, steps: int, weight_bytes: int, kv_per_token: int,
                   copy_bps: float) -> dict:
    step_s, replay_s = r["seconds"] / steps, r.get("graph_replay_s")
    kv_bytes = batch * r["mean_context"] * kv_per_token
    floor = (weight_bytes + kv_bytes) / copy_bps
    return {"steps": steps, "ms_per_step": step_s * 1e3, "tokens_per_s": batch / step_s,
            "mean_context": r["mean_context"], "fill_steps": r.get("fill_steps"),
            "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "floor_ms": floor * 1e3,
            "ratio_to_floor": step_s / floor,
            "graph_replay_ms": None if replay_s is None else replay_s * 1e3,
            "graph_replay_ratio_to_floor": None if replay_s is None else replay_s / floor,
            "host_profile": r.get("host_profile"), "kernel_profile": r.get("kernel_profile")}


@dataclass
class Bench:
    """What every case shares: the settings, the model's accounting, the measured ceilings."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    cfg: ModelConfig
    progress: Progress
    ceilings: dict
    gen: torch.Generator = field(default_factory=torch.Generator)
    counts: dict = field(default_factory=dict)
    kv_bytes_per_token: int = 0
    errors: list[str] = field(default_factory=list)
    record: dict = field(default_factory=dict)  # the JSON result, rewritten after every case
    started: float = field(default_factory=time.perf_counter)

    @property
    def weight_bytes(self) -> int:
        return self.counts["all"] * self.dtype.itemsize

    def prefill_row(self, batch: int, length: int, seconds: list[float]) -> dict:
        return prefill_figures(self.cfg, self.counts, batch, length, seconds,
                               self.ceilings["matmul"]["median_tflops"] * 1e12)

    def decode_row(self, batch: int, result: dict) -> dict:
        return decode_figures(result, batch, self.args.decode_steps, self.weight_bytes,
                              self.kv_bytes_per_token, self.ceilings["copy"]["median_gbps"] * 1e9)

    def case(self, what: str, row: dict, measure, core: EngineCore | None = None) -> dict:
        """Fill row with measure()'s figures unless it is skipped; a failure is recorded in
        the row and in errors (traceback on stderr) and the other cases still run."""
        if "skipped" not in row:
            try:
                row.update(measure())
            except Exception as e:  # noqa: BLE001 -- see the docstring
                row["error"] = self.failed(what, e)
                if core is not None:
                    clear(core)
        _free_memory(self.device)
        self.progress.case(what, _summary(row))
        self.save()
        return row

    def save(self, final: bool = False) -> None:
        """Write the record so far to --output (a run cut short keeps its finished cases)."""
        self.record.update(complete=final, wall_s=time.perf_counter() - self.started)
        if self.args.output and final:
            write_json(self.args.output, self.record)
        elif self.args.output:
            Path(self.args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.output).write_text(json.dumps(self.record, indent=2) + "\n")

    def failed(self, what: str, e: Exception) -> str:
        traceback.print_exc(file=sys.stderr)
        message = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        self.errors.append(f"{what}: {message}")
        return message


def engine_cases(bench: Bench, core: EngineCore, kv: dict) -> None:
    """Every prefill and decode case of the engine, into bench.record."""
    args, gen = bench.args, bench.gen
    prefill, decode = bench.record["prefill"], bench.record["decode"]

    def row(kind: str, b: int, n: int, **keys) -> dict:
        tokens = kv["need"][kind, b, n]
        if tokens > kv["pool_tokens"]:
            per_token = bench.kv_bytes_per_token
            keys["skipped"] = (f"needs {tokens} KV tokens ({tokens * per_token / 1e9:.1f} GB); "
                               f"the budget holds {kv['budget_bytes'] // per_token}")
        return keys

    for b, n in args.prefill_grid:
        measure = lambda b=b, n=n: bench.prefill_row(  # noqa: E731
            b, n, run_prefill(core, gen, b, n, args.prefill_repeats))
        prefill.append(bench.case(f"prefill {b}x{n}",
                                  row("prefill", b, n, batch=b, length=n, tokens=b * n), measure, core))
    for c in args.contexts:
        for b in args.batch_sizes:
            measure = lambda b=b, c=c: bench.decode_row(  # noqa: E731
                b, run_decode(core, gen, b, c, args.decode_warmup, args.decode_steps,
                              args.decode_fill, args.profile))
            decode.append(bench.case(f"decode bs={b} ctx={c}",
                                     row("decode", b, c, batch=b, context=c), measure, core))


def transformers_cases(bench: Bench, model: CausalLM) -> None:
    """transformers on our weights, into bench.record; ours_over_hf goes into its rows and
    our matching ones."""
    import transformers

    args, gen, vocab, ctx = bench.args, bench.gen, bench.cfg.vocab_size, bench.args.hf_context
    start = time.perf_counter()
    hf = to_hf_model(model, PRESETS[args.preset])
    out = bench.record["transformers"] = {
        "version": transformers.__version__, "build_s": time.perf_counter() - start,
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "decode": [], "prefill": []}
    for b in args.hf_batch_sizes:
        measure = lambda b=b: bench.decode_row(  # noqa: E731
            b, run_hf_decode(hf, gen, vocab, b, ctx, args.decode_warmup, args.decode_steps))
        out["decode"].append(bench.case(f"transformers decode bs={b} ctx={ctx}",
                                        {"batch": b, "context": ctx}, measure))
    for b, n in args.hf_prefill:
        measure = lambda b=b, n=n: bench.prefill_row(  # noqa: E731
            b, n, run_hf_prefill(hf, gen, vocab, b, n, args.prefill_repeats))
        out["prefill"].append(bench.case(f"transformers prefill {b}x{n}",
                                         {"batch": b, "length": n, "tokens": b * n}, measure))
    rows = bench.record["decode"] + bench.record["prefill"]
    for theirs in out["decode"] + out["prefill"]:
        keys = ("batch", "context") if "context" in theirs else ("batch", "length")
        ours = next((r for r in rows if all(r.get(k) == theirs[k] for k in keys)), None)
        if ours and "tokens_per_s" in ours and "tokens_per_s" in theirs:
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            theirs["ours_over_hf"] = ours["ours_over_hf"] = ratio


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device if args.device != "auto"
                          else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fill_defaults(args, device)
    dtype = resolve_dtype(args.dtype, device.type)
    run_hf = device.type == "cuda" if args.hf is None else args.hf
    preset = PRESETS[args.preset]
    num_cases = (2 + len(args.prefill_grid) + len(args.batch_sizes) * len(args.contexts)
                 + (len(args.hf_batch_sizes) + len(args.hf_prefill) if run_hf else 0))
    bench = Bench(args, device, dtype, ModelConfig.from_dict(preset, source=f"preset {args.preset}"),
                  Progress(num_cases), {}, gen=torch.Generator().manual_seed(args.seed))
    ceilings = bench.ceilings = measure_ceilings(device, dtype)
    bench.progress.case("copy rate", f"{ceilings['copy']['median_gbps']:,.4g} GB/s (read + write)")
    bench.progress.case(f"matmul {ceilings['matmul']['n']}^3",
                        f"{ceilings['matmul']['median_tflops']:,.4g} TFLOP/s")
    record = bench.record = {
        "bench": "one_batch", "preset": args.preset, "model_config": preset,
        "device": str(device), "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch."), "versions": versions(),
        "git_commit": git_commit(), "flags": vars(args), "torch_threads": torch.get_num_threads(),
        "ceilings": ceilings, "definitions": DEFINITIONS, "errors": bench.errors,
        "prefill": [], "decode": [], "transformers": {"skipped": "--no-hf"},
    }
    bench.save()
    with tempfile.TemporaryDirectory(prefix="one-batch-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(preset, indent=2))
        print(f"building the engine ({args.preset}, {bench.record['dtype']}, attention "
              f"{args.attention_backend}, CUDA graphs {'off' if args.disable_cuda_graph else 'auto'})",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        core, kv = build_core(args, Path(tmp), bench.cfg, device, dtype)
        bench.counts, bench.kv_bytes_per_token = param_counts(core.model), kv["kv_bytes_per_token"]
        record.update(params=bench.counts, weight_bytes=bench.weight_bytes,
                      kv_bytes_per_token=bench.kv_bytes_per_token)
        record["engine"] = {
            "attention_backend": core.attention_backend,
            "cuda_graphs": bool(getattr(core.runner, "graphs", None)),
            "overlap_schedule": core.overlap,
            "build_s": time.perf_counter() - start, "kv_pool_tokens": kv["pool_tokens"],
            "kv_budget_bytes": kv["budget_bytes"], "context_length": kv["context_length"],
            "chunked_prefill_size": kv["chunked_prefill_size"]}
        engine_cases(bench, core, kv)
    model = core.model
    del core  # the KV pool and CUDA graphs go before transformers loads
    _free_memory(device)
    if run_hf:
        try:
            transformers_cases(bench, model)
        except Exception as e:  # noqa: BLE001 -- keep the engine's numbers
            record["transformers"] = {"error": bench.failed("transformers", e)}
    del model
    _free_memory(device)
    print_table(record)
    bench.save(final=True)
    return 1 if bench.errors else 0


def _summary(row: dict) -> str:
    if "ms_per_step" in row:
        replay = row.get("graph_replay_ms")
        return (f"{row['ms_per_step']:.2f} ms/step, {row['tokens_per_s']:,.0f} tok/s, "
                f"{row['ratio_to_floor']:.2f}x floor ({row['floor_ms']:.2f} ms)"
                + (f", graph replay alone {replay:.2f} ms" if replay else ""))
    if "tokens_per_s" in row:
        return (f"{row['tokens_per_s']:,.0f} tok/s, {row['seconds'] * 1e3:.1f} ms, "
                f"{row['ratio_to_floor']:.2f}x floor, {row['fraction_of_matmul_all_params']:.0%} "
                "of matmul (all params)")
    return row.get("skipped") or row.get("error") or "done"


def print_table(record: dict) -> None:
    c, e = record["ceilings"], record["engine"]
    print(f"\n{record['preset']} on {record['device_name']} ({record['dtype']}), attention "
          f"{e['attention_backend']}, CUDA graphs {'on' if e['cuda_graphs'] else 'off'}, overlap schedule "
          f"{'on' if e.get('overlap_schedule') else 'off'}")
    print(f"ceilings: copy {c['copy']['median_gbps']:,.4g} GB/s (read + write), matmul "
          f"{c['matmul']['n']}^3 {c['matmul']['median_tflops']:,.4g} TFLOP/s")
    print(f"\n{'prefill':<10}| {'tok/s':>10} | {'ms':>8} | {'x floor':>7} | "
          f"{'matmul % (linear)':>17} | {'(all params)':>12} | {'ours/HF':>7}")
    for r in record["prefill"]:
        name = f"{r['batch']}x{r['length']}"
        if "tokens_per_s" not in r:
            print(f"{name:<10}| {_summary(r)}")
            continue
        print(f"{name:<10}| {r['tokens_per_s']:>10,.0f} | {r['seconds'] * 1e3:>8.1f} | "
              f"{r['ratio_to_floor']:>7.2f} | {r['fraction_of_matmul_linear']:>17.1%} | "
              f"{r['fraction_of_matmul_all_params']:>12.1%} | {_ratio(r):>7}")
    print(f"\n{'decode':<14}| {'ms/step':>8} | {'tok/s':>9} | {'floor ms':>8} | {'x floor':>7} | "
          f"{'ours/HF':>7}")
    for r in record["decode"]:
        name = f"bs{r['batch']} ctx{r['context']}"
        if "ms_per_step" not in r:
            print(f"{name:<14}| {_summary(r)}")
            continue
        print(f"{name:<14}| {r['ms_per_step']:>8.2f} | {r['tokens_per_s']:>9,.0f} | "
              f"{r['floor_ms']:>8.2f} | {r['ratio_to_floor']:>7.2f} | {_ratio(r):>7}")
    for error in record["errors"]:
        print(f"error: {error}")


def _ratio(row: dict) -> str:
    return f"{row['ours_over_hf']:.2f}" if "ours_over_hf" in row else "-"


def versions() -> dict:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for name in ("triton", "flashinfer", "transformers"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "unknown")
        except Exception:  # noqa: BLE001 -- absent or broken: recorded as None
            out[name] = None
    return out


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
