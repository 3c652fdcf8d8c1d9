"""Online serving benchmark: an OpenAI-API load generator that measures TTFT, TPOT, ITL, E2E
latency, throughput and goodput as vLLM's and SGLang's serving benchmarks define them.

    python bench/serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8
    python bench/serving.py --dataset sharegpt --request-rate inf --max-concurrency 32 --output r.json
    python bench/serving.py --dataset shared-prefix --num-prefixes 4 --prefix-len 512 --suffix-len 64
    python bench/serving.py --slo ttft=500,tpot=50 --output r.json      # goodput under SLOs

Every request streams (`stream_options.include_usage`), with `ignore_eos` and `max_tokens` set to
its output length. A content chunk is a streamed chunk with text (or a finish reason); times are
taken on the client as each chunk's line arrives. Per request:
  TTFT  first content chunk - send.
  E2E   last content chunk - send (vLLM's E2EL).
  TPOT  (E2E - TTFT) / (n - 1), n = output tokens (usage.completion_tokens, else the number of
        content chunks); requests with n <= 1 have no TPOT.
  ITL   every gap between consecutive content chunks (one chunk may carry several tokens).
Statistics pool completed requests (ITL: all their gaps); throughputs count completed requests
over the benchmark's wall time; goodput is completed requests per second meeting every --slo
(a request with n <= 1 meets a TPOT SLO). A request is sent when it is due and, with
--max-concurrency, has a slot: its clock starts then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/serving.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from bench._common import git_commit, write_json  # noqa: E402
from pd_serve.planner.metrics import RequestRecord, compute_metrics, parse_slo  # noqa: E402
from pd_serve.planner.workload import (FIRST_REGULAR_ID, Prompt, add_workload_args,  # noqa: E402
                                       arrival_offsets, make_prompts)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


# ---- the client -----------------------------------------------------------------------------
def _chunk_has_content(choice: dict) -> bool:
    text = choice.get("text") or (choice.get("delta") or {}).get("content")
    return bool(text) or choice.get("finish_reason") is not None


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict,
                       record: RequestRecord, t0: float) -> None:
    """Streams one request, filling `record`; failures end up in `record.error`, never raised."""
    record.send_time = time.perf_counter() - t0
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return
            async for line in response.content:  # one SSE line at a time
                now = time.perf_counter() - t0
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:  # the server failed mid-stream
                    error = event["error"]
                    record.error = f"stream error: {error.get('message') if isinstance(error, dict) else error}"
                    return
                if event.get("choices") and _chunk_has_content(event["choices"][0]):
                    record.chunk_times.append(now)
                if isinstance(event.get("timings"), dict):  # pd-serve's gateway: where the time went
                    record.server_timings = event["timings"]
                if usage := event.get("usage"):
                    record.num_output_tokens = usage.get("completion_tokens", 0)
                    record.num_prompt_tokens = usage.get("prompt_tokens")
    except Exception as e:  # noqa: BLE001 -- any failure is this request's, not the run's
        record.error = f"{type(e).__name__}: {e}"
        return
    if not record.chunk_times:
        record.error = "the stream ended without a content chunk"
    elif record.num_output_tokens == 0:  # no usage chunk
        record.num_output_tokens = len(record.chunk_times)


class ProgressBar:
    """`[####----] done/total  rate req/s  failed` on one stderr line, redrawn at most 10x a second."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30, stream=None):
        self.total, self.enabled, self.width = total, enabled, width
        self.stream = stream or sys.stderr
        self.done = self.failed = 0
        self.start = time.perf_counter()
        self._last_draw = -1.0

    def update(self, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        now = time.perf_counter()
        if self.done == self.total or now - self._last_draw >= 0.1:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        if not self.enabled:
            return
        filled = self.width * self.done // max(1, self.total)
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        self.stream.write(f"\r[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total}"
                          f"  {rate:.2f} req/s  {elapsed:.1f} s  failed {self.failed}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def build_payload(args: argparse.Namespace, model: str, prompt: Prompt, tokenizer) -> dict:
    payload = {"model": model, "max_tokens": prompt.output_len, "temperature": args.temperature,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": tokenizer.decode(prompt.token_ids)}]
    else:
        payload["prompt"] = prompt.token_ids
    return payload


async def run_requests(args: argparse.Namespace, base_url: str, payloads: list[dict],
                       records: list[RequestRecord], offsets: np.ndarray) -> float:
    """Sends every payload at its offset (bounded by --max-concurrency); returns the wall time."""
    url = base_url + ENDPOINTS[args.endpoint]
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = ProgressBar(len(payloads), enabled=not args.no_progress)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with limit or contextlib.nullcontext():
                await send_request(session, url, payloads[i], records[i], t0)
            progress.update(failed=not records[i].success)

        await asyncio.gather(*(one(i) for i in range(len(payloads))))
        duration = time.perf_counter() - t0
    progress.close()
    return duration


async def fetch_model_card(base_url: str, timeout_s: float) -> dict:
    """The first entry of GET /v1/models."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(base_url + "/v1/models") as response:
            response.raise_for_status()
            cards = (await response.json())["data"]
    if not cards:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return cards[0]


# ---- command line ---------------------------------------------------------------------------
def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The flags; `prog` names the command in usage lines (phase_ratio.py passes its own)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the gateway, or any OpenAI-compatible server (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="completions sends token ids; chat sends them decoded (default: %(default)s)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests/s; inf sends all at once (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take (default: %(default)s)")
    p.add_argument("--tokenizer", default=None,
                   help="chat: folder with tokenizer.json that turns ids into text (default: the "
                        "embedded model's)")
    add_workload_args(p)  # --num-prompts, --burstiness, --seed and the dataset group
    o = p.add_argument_group("output")
    o.add_argument("--slo", type=parse_slo, default=None,
                   help="goodput SLOs in ms, e.g. ttft=500,tpot=50[,e2e=10000] (default: none)")
    o.add_argument("--output", default=None, help="write the JSON result here")
    o.add_argument("--save-requests", action="store_true", help="put every request's record in the JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = ["num_prompts", "input_len", "output_len", "num_prefixes", "prefix_len", "vocab_size"]
    for name in positive + ["max_concurrency", "max_model_len"]:
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.suffix_len < 0 or not 0 <= args.range_ratio < 1:
        p.error("--suffix-len must be >= 0 and --range-ratio in [0, 1)")
    if not args.request_rate > 0 or not args.burstiness > 0:
        p.error("--request-rate and --burstiness must be > 0")
    if args.vocab_size <= FIRST_REGULAR_ID:
        p.error(f"--vocab-size must be > {FIRST_REGULAR_ID}")


def load_tokenizer(path: str | None):
    from pd_serve.model.gguf_default import model_dir_for
    from pd_serve.model.tokenizer import Tokenizer
    return Tokenizer.from_dir(model_dir_for(path))  # a folder, a .gguf file, or the default


def format_summary(metrics: dict, title: str = "Serving Benchmark Result") -> str:
    def row(label: str, value) -> str:
        text = "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
        return f"{label:<40}{text:>12}"

    m = metrics
    lines = [f"{' ' + title + ' ':=^52}", row("Successful requests:", m["completed"]),
             row("Failed requests:", m["failed"]), row("Benchmark duration (s):", m["duration_s"]),
             row("Total input tokens:", m["total_input_tokens"]),
             row("Total generated tokens:", m["total_output_tokens"]),
             row("Request throughput (req/s):", m["request_throughput"]),
             row("Input token throughput (tok/s):", m["input_throughput"]),
             row("Output token throughput (tok/s):", m["output_throughput"]),
             row("Total token throughput (tok/s):", m["total_token_throughput"])]
    if m["slo_ms"]:
        lines += [row("SLOs (ms):", ", ".join(f"{k}={v:g}" for k, v in m["slo_ms"].items())),
                  row("Requests meeting SLOs:", m["num_good"]), row("Goodput (req/s):", m["goodput"])]
    for key, name, long in [("ttft", "TTFT", "Time to First Token"),
                            ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                            ("itl", "ITL", "Inter-token Latency"), ("e2e", "E2E", "End-to-end Latency")]:
        lines.append(f"{long:-^52}")
        stats = m[f"{key}_ms"]
        lines += [row(f"{stat.capitalize()} {name} (ms):", stats[stat]) for stat in stats]
    lines.append("=" * 52)
    return "\n".join(lines)


def _json_config(args: argparse.Namespace, **resolved) -> dict:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    return config | resolved


async def _run(args: argparse.Namespace) -> int:
    base_url = args.base_url.rstrip("/")
    try:
        card = await fetch_model_card(base_url, timeout_s=30)
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, KeyError) as e:
        print(f"error: cannot read {base_url}/v1/models: {e}", file=sys.stderr)
        return 1
    model = args.model or card["id"]
    max_model_len = args.max_model_len or card.get("max_model_len")
    rng = np.random.default_rng(args.seed)
    prompts = make_prompts(args, rng, max_model_len)
    offsets = arrival_offsets(rng, len(prompts), args.request_rate, args.burstiness)
    tokenizer = load_tokenizer(args.tokenizer) if args.endpoint == "chat" else None
    payloads = [build_payload(args, model, p, tokenizer) for p in prompts]
    records = [RequestRecord(len(p.token_ids), p.output_len) for p in prompts]

    duration = await run_requests(args, base_url, payloads, records, offsets)
    metrics = compute_metrics(records, duration, args.slo)
    print(format_summary(metrics))
    errors = sorted({r.error for r in records if r.error})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    if args.output:
        result = {"benchmark": "serving", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "commit": git_commit(),
                  "config": _json_config(args, base_url=base_url, model=model, max_model_len=max_model_len),
                  "metrics": metrics}
        if args.save_requests:
            result["requests"] = [dataclasses.asdict(r) for r in records]
        write_json(args.output, result)
    return 0 if metrics["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; 0 when at least one request completed, 1 when none did."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
