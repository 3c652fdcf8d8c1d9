"""bench/one_batch.py's baseline: Hugging Face transformers' model of the preset (its
architecture: LlamaForCausalLM, Qwen3MoeForCausalLM, ...) on our very weight tensors
(shared_hf_model: no second copy), the same dtype and device. Decode steps are a forward of one token per row with
the cache of a prefill, then argmax; prefill is one forward of fresh prompts (logits of the last
token only). ours_over_hf = our tokens/s / transformers' on the same case."""

from __future__ import annotations

import inspect
import time
from itertools import chain

import torch

from bench._common import sync
from bench.one_batch_report import Bench
from pd_serve.model.hf_export import to_hf_state_dict
from pd_serve.model.llama import CausalLM


def transformers_cases(bench: Bench, model: CausalLM, hf_config: dict) -> None:
    """transformers on our weights (hf_config: the preset's config.json contents), into
    bench.record; ours_over_hf goes into its rows and our matching ones."""
    import transformers

    args, gen, vocab, ctx = bench.args, bench.gen, bench.cfg.vocab_size, bench.args.hf_context
    start = time.perf_counter()
    hf = shared_hf_model(model, hf_config)
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



def shared_hf_model(model: CausalLM, hf_config: dict):
    """transformers' model for `hf_config` (the config.json dict our model was built from)
    whose parameters are our model's tensors (to_hf_state_dict's views): built on the meta
    device, the weights assigned, the computed buffers (RoPE frequencies, float32) built again
    on our device. One copy of the weights serves both models."""
    import transformers

    param = next(model.parameters())
    config = transformers.AutoConfig.for_model(**hf_config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(param.dtype)
    try:
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    result = hf.load_state_dict(to_hf_state_dict(model), strict=False, assign=True)
    tied = model.config.tie_word_embeddings
    if result.unexpected_keys or sorted(result.missing_keys) != (["lm_head.weight"] if tied else []):
        raise ValueError(f"transformers' {type(hf).__name__} does not take our weights: missing "
                         f"{result.missing_keys}, unexpected {result.unexpected_keys}")
    if tied:
        hf.lm_head.weight = hf.get_input_embeddings().weight
    for name, module in list(hf.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):  # the rotary embedding
            parent, _, attr = name.rpartition(".")
            with torch.device(param.device):
                setattr(hf.get_submodule(parent), attr, type(module)(hf.config))
    left = [n for n, t in chain(hf.named_parameters(), hf.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"transformers' {type(hf).__name__}: {left} not set from our model")
    return hf.eval()


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

