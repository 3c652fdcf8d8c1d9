"""pd-serve command line. Flags are named as SGLang and vLLM name them.

    pd-serve chat "What is the capital of France?"     # colocated engine, embedded default model
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pd_serve.config import SCHEDULE_POLICIES, CacheConfig, EngineConfig, SchedulerConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d_cache, d_sched, d_engine = CacheConfig(), SchedulerConfig(), EngineConfig()
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model folder (config.json, safetensors, tokenizer.json); "
                        "default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--device", default=d_engine.device, help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", default=d_engine.dtype,
                   help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    g.add_argument("--context-length", type=int, default=None,
                   help="max prompt + output tokens (default: the model's max_position_embeddings)")
    g.add_argument("--seed", type=int, default=d_engine.seed)
    g.add_argument("--page-size", type=int, default=d_cache.page_size, help="tokens per KV page")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV cache capacity in tokens (default: from memory)")
    g.add_argument("--mem-fraction-static", type=float, default=d_cache.mem_fraction_static,
                   help="GPU: fraction of memory for weights and KV cache")
    g.add_argument("--cpu-kv-cache-gb", type=float, default=d_cache.cpu_kv_cache_gb,
                   help="CPU: KV cache size when --max-total-tokens is not given")
    g.add_argument("--kv-cache-dtype", default=d_cache.kv_cache_dtype, help="auto (the model dtype)")
    g.add_argument("--max-running-requests", type=int, default=d_sched.max_running_requests)
    g.add_argument("--chunked-prefill-size", type=int, default=d_sched.chunked_prefill_size,
                   help="max prefill tokens per step; -1 disables chunking")
    g.add_argument("--schedule-policy", default=d_sched.schedule_policy, choices=SCHEDULE_POLICIES)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        context_length=args.context_length, seed=args.seed,
        cache=CacheConfig(page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                          mem_fraction_static=args.mem_fraction_static,
                          cpu_kv_cache_gb=args.cpu_kv_cache_gb, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_running_requests=args.max_running_requests,
                                  chunked_prefill_size=args.chunked_prefill_size,
                                  schedule_policy=args.schedule_policy))


def cmd_chat(args: argparse.Namespace) -> None:
    from pd_serve import Engine, SamplingParams

    engine = Engine.from_config(engine_config_from_args(args))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.message}]
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages),
                                     add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    start = time.perf_counter()
    num_tokens = 0
    for out in engine.stream(prompt, params):
        print(out.new_text, end="", flush=True)
        num_tokens = len(out.token_ids)
    elapsed = time.perf_counter() - start
    print()
    logging.getLogger("pd_serve").info("%d tokens in %.2f s (%.1f tok/s), finish: %s", num_tokens,
                                       elapsed, num_tokens / elapsed, out.finish_reason)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="answer one chat message with the colocated engine")
    chat.add_argument("message", help="the user message")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    chat.add_argument("--top-p", type=float, default=1.0)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        # Bad input is one line that names the flag, file or field; no traceback.
        print(f"pd-serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
