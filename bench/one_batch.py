"""One batch at a time (SGLang's bench_one_batch in spirit): prefill and decode steps of the
engine on random (dummy) weights of a preset shape, each set against a floor from ceilings
measured in the same run, and against Hugging Face transformers on the same weights.

    python -m bench.one_batch --preset llama3-8b --output bench/results/one-batch-h200-llama3-8b.json
    python -m bench.one_batch --preset qwen3-30b-a3b --batch-sizes 1,64 --contexts 1024 \
        --prefill-grid 4x2048 --output bench/results/one-batch-h200-qwen3-30b-a3b.json
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
the batch's mean context during the timed steps x bytes per token. An MoE model's step reads
only the experts its rows are routed to: weight bytes = every parameter but the experts, plus
per MoE layer the expected number of distinct experts a batch reaches with uniform top-k
routing, E (1 - (1 - K/E)^batch) experts (K at batch 1; 126 of 128 for Qwen3-30B-A3B at 64).
Cases whose KV does not fit the memory budget are skipped (the JSON says why).

The grids default to the GPU sizes named in the flags' help, or to small ones on CPU. One KV
pool serves every case: the largest need that fits the budget (free GPU memory less weights
and activations, or --kv-budget-gb); the engine and its pool are freed before transformers
loads. A failing case is recorded (`error`) and the others still run; the exit status is then 1.
--output is rewritten after every case ("complete": false until the end), so a run cut short
keeps what it measured.

Transformers (--hf, on by default on GPU): the preset's architecture (LlamaForCausalLM,
Qwen3MoeForCausalLM, ...) on our model's very tensors (to_hf_state_dict, shared, not copied:
Qwen3-30B-A3B's 61 GB fit an H200 once, not twice); decode steps (a forward of one token per
row with past_key_values, then argmax) at --hf-batch-sizes x --hf-context after a prefill that
fills the cache, and the --hf-prefill forward (logits of the last token only). ours_over_hf =
our tokens/s / transformers' tokens/s on the same case (> 1: we are faster).

This module is the entry point: the CLI, the ceilings and the engine's cases.
bench/one_batch_report.py holds the figures, the run's record (Bench), the profiles and the
table; bench/one_batch_hf.py the transformers baseline.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere
if __package__ in (None, ""):  # `python bench/one_batch.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import device_name, git_commit, sync  # noqa: E402
from bench.one_batch_hf import transformers_cases  # noqa: E402
from kernels._triton import pdl_enabled  # noqa: E402
from bench.one_batch_report import (  # noqa: E402
    DEFINITIONS,
    Bench,
    Progress,
    free_memory,
    param_counts,
    print_table,
    profile_kernels,
    profile_steps,
    stored_bytes,
)
from pd_serve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pd_serve.engine.core import EngineCore  # noqa: E402
from pd_serve.engine.request import FinishReason, Request  # noqa: E402
from pd_serve.engine.sampling_params import SamplingParams  # noqa: E402
from pd_serve.model.config import ModelConfig, resolve_dtype  # noqa: E402
from pd_serve.model.llama import CausalLM  # noqa: E402
from pd_serve.model.moe import Experts  # noqa: E402

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
_QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu",
                  rms_norm_eps=1e-6, attention_bias=False, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0,
                  tie_word_embeddings=False)
PRESETS.update({
    # Qwen3-30B-A3B's config.json (intermediate_size is unused: every layer is sparse)
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
                          bos_token_id=151643, eos_token_id=151645),
    "tiny-moe": dict(_QWEN3_MOE, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, intermediate_size=256,
                     moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                     vocab_size=2048, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
})
_DEEPSEEK_V2 = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                    hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, q_lora_rank=None,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                    topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
                    first_k_dense_replace=1, moe_layer_freq=1, rope_theta=10000.0,
                    tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001)
PRESETS.update({  # DeepSeek-V2-Lite's shape (multi-head latent attention, DeepSeekMoE), and a tiny one
    "deepseek-v2-lite": dict(_DEEPSEEK_V2, hidden_size=2048, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16,
                             intermediate_size=10944, moe_intermediate_size=1408,
                             n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                             routed_scaling_factor=1.0, vocab_size=102400,
                             max_position_embeddings=163840,
                             rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                               beta_fast=32, beta_slow=1, mscale=0.707,
                                               mscale_all_dim=0.707)),
    "deepseek-tiny": dict(_DEEPSEEK_V2, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32,
                          qk_rope_head_dim=16, v_head_dim=32, intermediate_size=256,
                          moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                          n_shared_experts=1, routed_scaling_factor=1.0, vocab_size=2048,
                          max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
})
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
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: the random weights quantized at load (per-channel FP8 weights, "
                   "MoE experts too); "
                   "the floor counts the bytes as stored; no transformers comparison then")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="decode steps wait for their tokens before the next is planned")
    p.add_argument("--enable-batch1-kernels", action="store_true",
                   help="batch-1 decode on Triton GEMVs and Triton attention (the engine flag)")
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
    p.add_argument("--context-length", type=int, default=None,
                   help="the engine's context length (default: the longest case + a page). "
                   "It sizes the CUDA graphs' page tables, so it sets the Triton decode "
                   "attention's key splits (kernels/paged_attention.decode_num_splits); a "
                   "server's default is the model's max_position_embeddings")
    p.add_argument("--profile", action="store_true",
                   help="per decode case, also keep the host functions that cost the most per "
                   "step (cProfile: host_profile) and the graph's kernels by GPU time "
                   "(torch.profiler: kernel_profile). Under programmatic dependent launch "
                   "(kernels/_triton.py) a kernel's wait for the one before counts as its own "
                   "time: PD_SERVE_PDL=0 for a per-kernel breakdown")
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
    free_memory(device)
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


def kv_tokens_needed(batch: int, length: int, extra: int, page_size: int) -> int:
    """Pool tokens `batch` sequences of length + extra occupy, in whole pages."""
    return batch * -(-(length + extra) // page_size) * page_size


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
    kv_itemsize = dtype.itemsize if args.kv_cache_dtype == "auto" else 1  # fp8_*: one byte
    planes = 1 if cfg.is_mla else 2  # MLA: one latent per token and layer (cache/pool.py)
    kv_bytes_per_token = planes * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_itemsize
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
        enable_batch1_kernels=args.enable_batch1_kernels,
        # every decode case replays a graph, as a server started with --cuda-graph-max-bs would
        cuda_graph_max_bs=max(EngineConfig.cuda_graph_max_bs, max_batch),
        context_length=args.context_length or min(cfg.max_position_embeddings, longest + page_size),
        quantization=args.quantization,
        cache=CacheConfig(max_total_tokens=pool_tokens, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_running_requests=max_batch, chunked_prefill_size=chunk))
    info = {"pool_tokens": pool_tokens, "budget_bytes": int(budget), "need": need,
            "chunked_prefill_size": chunk, "context_length": config.context_length,
            "cuda_graph_max_bs": config.cuda_graph_max_bs,
            "kv_bytes_per_token": kv_bytes_per_token}
    return EngineCore(config, prefix_cache=False), info  # repeats compute every token


def engine_cases(bench: Bench, core: EngineCore, kv: dict) -> None:
    """Every prefill and decode case of the engine, into bench.record."""
    args, gen = bench.args, bench.gen
    prefill, decode = bench.record["prefill"], bench.record["decode"]
    reset = functools.partial(clear, core)  # ends a failed case's requests

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
                                  row("prefill", b, n, batch=b, length=n, tokens=b * n), measure, reset))
    for c in args.contexts:
        for b in args.batch_sizes:
            measure = lambda b=b, c=c: bench.decode_row(  # noqa: E731
                b, run_decode(core, gen, b, c, args.decode_warmup, args.decode_steps,
                              args.decode_fill, args.profile))
            decode.append(bench.case(f"decode bs={b} ctx={c}",
                                     row("decode", b, c, batch=b, context=c), measure, reset))


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device if args.device != "auto"
                          else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fill_defaults(args, device)
    if args.profile and device.type == "cuda" and pdl_enabled():
        print("note: --profile under programmatic dependent launch counts each kernel's wait "
              "for the one before as its own time; PD_SERVE_PDL=0 for a per-kernel breakdown",
              file=sys.stderr)
    dtype = resolve_dtype(args.dtype, device.type)
    run_hf = (device.type == "cuda" if args.hf is None else args.hf) and not args.quantization
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
        "env": {k: v for k, v in os.environ.items()  # settings such as the tensor-core override
                if k.startswith("PD_SERVE_") and k != "PD_SERVE_COMMIT"},
        "ceilings": ceilings, "definitions": DEFINITIONS, "errors": bench.errors,
        "prefill": [], "decode": [],
        "transformers": {"skipped": "--quantization (other weights than transformers')"
                         if args.quantization else "--no-hf"},
    }
    bench.save()
    with tempfile.TemporaryDirectory(prefix="one-batch-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(preset, indent=2))
        print(f"building the engine ({args.preset}, {bench.record['dtype']}, attention "
              f"{args.attention_backend}, CUDA graphs {'off' if args.disable_cuda_graph else 'auto'})",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        core, kv = build_core(args, Path(tmp), bench.cfg, device, dtype)
        bench.counts = param_counts(core.model)
        bench.kv_bytes_per_token = core.kv_pool.layout.bytes_per_token  # FP8 pages: half
        bench.stored_bytes = stored_bytes(core.model)
        bench.expert_bytes = stored_bytes(core.model, only=Experts)
        record.update(params=bench.counts, weight_bytes=bench.weight_bytes,
                      expert_bytes=bench.expert_bytes,
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
    free_memory(device)
    if run_hf:
        try:
            transformers_cases(bench, model, preset)
        except Exception as e:  # noqa: BLE001 -- keep the engine's numbers
            record["transformers"] = {"error": bench.failed("transformers", e)}
    del model
    free_memory(device)
    print_table(record)
    bench.save(final=True)
    return 1 if bench.errors else 0


def versions() -> dict:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for name in ("triton", "flashinfer", "transformers"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "unknown")
        except Exception:  # noqa: BLE001 -- absent or broken: recorded as None
            out[name] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
