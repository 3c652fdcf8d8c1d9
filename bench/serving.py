"""Online serving benchmark: an OpenAI-API load generator that measures TTFT, TPOT, ITL, E2E
latency, throughput and goodput as vLLM's and SGLang's serving benchmarks define them.

    python bench/serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8
    python bench/serving.py --dataset sharegpt --request-rate inf --max-concurrency 32 --output r.json
    python bench/serving.py --dataset shared-prefix --num-prefixes 4 --prefix-len 512 --suffix-len 64
    python bench/serving.py --slo ttft=500,tpot=50 --output r.json      # goodput under SLOs
    python bench/serving.py --dataset multi-turn --num-conversations 32 --num-turns 8 \
        --system-prompt-len 1024 --turn-len 256 --output-len 128 --think-time 1 --request-rate 2

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

multi-turn (bench/multi_turn.py) runs conversations instead of prompts: they start at
--request-rate (all at once for inf), at most --max-concurrency of them in flight, and each
sends its turns as chat messages one after another, turn t + 1 when turn t has finished and
--think-time has passed; its result adds TTFT per turn (first against later turns). Every run
reports `cache`: prompt and cached tokens (usage.prompt_tokens_details.cached_tokens, where the
server sends it), and `server`: how pd-serve's counters on the gateway's /metrics moved over the
run (prefill tokens computed, prefix cache hit and query tokens, KV bytes sent), when it has them.
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

from bench import multi_turn  # noqa: E402
from bench._common import git_commit, write_json  # noqa: E402
from pd_serve.planner.metrics import RequestRecord, compute_metrics, parse_slo  # noqa: E402
from pd_serve.planner.workload import (DATASETS, FIRST_REGULAR_ID, Prompt,  # noqa: E402
                                       add_workload_args, arrival_offsets, make_prompts)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MULTI_TURN = "multi-turn"
# What `server` reports: key -> (sample on the gateway's /metrics, labels a sample must have).
# Each is summed over the workers (the KV bytes over the senders, so a transfer counts once).
SERVER_COUNTERS = {
    "prefill_tokens_computed": ("pd_serve:prompt_tokens_total", {}),
    "prefix_cache_hit_tokens": ("pd_serve:prefix_cache_hit_tokens_total", {}),
    "prefix_cache_query_tokens": ("pd_serve:prefix_cache_query_tokens_total", {}),
    "prefix_cache_evicted_pages": ("pd_serve:prefix_cache_evicted_pages_total", {}),
    "kv_transfer_bytes": ("pd_serve:kv_transfer_bytes_total", {"role": "send"}),
    "kv_transfers": ("pd_serve:kv_transfers_total", {"role": "send"}),
}
METRICS_SETTLE_S = 2.5  # workers report their counters with each heartbeat (once a second)


# ---- the client -----------------------------------------------------------------------------
def _chunk_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _chunk_has_content(choice: dict) -> bool:
    return bool(_chunk_text(choice)) or choice.get("finish_reason") is not None


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict,
                       record: RequestRecord, t0: float, texts: list[str] | None = None) -> None:
    """Streams one request, filling `record` (and `texts` with the streamed text, when given);
    failures end up in `record.error`, never raised."""
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
                    if texts is not None:
                        texts.append(_chunk_text(event["choices"][0]))
                if isinstance(event.get("timings"), dict):  # pd-serve's gateway: where the time went
                    record.server_timings = event["timings"]
                if usage := event.get("usage"):
                    record.num_output_tokens = usage.get("completion_tokens", 0)
                    record.num_prompt_tokens = usage.get("prompt_tokens")
                    record.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
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
    if args.endpoint == "chat":
        return chat_payload(args, model, [{"role": "user", "content": tokenizer.decode(prompt.token_ids)}],
                            prompt.output_len)
    return _payload_head(args, model, prompt.output_len) | {"prompt": prompt.token_ids}


def chat_payload(args: argparse.Namespace, model: str, messages: list[dict], output_len: int) -> dict:
    return _payload_head(args, model, output_len) | {"messages": messages}


def _payload_head(args: argparse.Namespace, model: str, output_len: int) -> dict:
    return {"model": model, "max_tokens": output_len, "temperature": args.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def _run_at_offsets(args: argparse.Namespace, count: int, num_steps: int,
                          offsets: np.ndarray, work) -> float:
    """Runs `await work(session, t0, i, progress)` for i in range(count), each from t0 +
    offsets[i] and at most --max-concurrency at once, over one client session; a progress bar
    of num_steps steps. Returns the wall time."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = ProgressBar(num_steps, enabled=not args.no_progress)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with limit or contextlib.nullcontext():
                await work(session, t0, i, progress)

        await asyncio.gather(*(one(i) for i in range(count)))
        duration = time.perf_counter() - t0
    progress.close()
    return duration


async def run_requests(args: argparse.Namespace, base_url: str, payloads: list[dict],
                       records: list[RequestRecord], offsets: np.ndarray) -> float:
    """Sends every payload at its offset (bounded by --max-concurrency); returns the wall time."""
    url = base_url + ENDPOINTS[args.endpoint]

    async def work(session, t0: float, i: int, progress: ProgressBar) -> None:
        await send_request(session, url, payloads[i], records[i], t0)
        progress.update(failed=not records[i].success)

    return await _run_at_offsets(args, len(payloads), len(payloads), offsets, work)


async def run_conversations(args: argparse.Namespace, base_url: str, model: str,
                            conversations: list[multi_turn.Conversation], turns: list[list[RequestRecord]],
                            offsets: np.ndarray) -> float:
    """Runs each conversation from its offset (at most --max-concurrency at once), its turns one
    after another with --think-time between them, filling `turns[c]`; returns the wall time. A
    failed turn ends its conversation: its later turns fail unsent."""
    url = base_url + ENDPOINTS["chat"]

    async def work(session, t0: float, c: int, progress: ProgressBar) -> None:
        answers: list[str] = []
        for t, record in enumerate(turns[c]):
            if answers and args.think_time > 0:
                await asyncio.sleep(args.think_time)
            messages = multi_turn.turn_messages(conversations[c], answers)
            texts: list[str] = []
            payload = chat_payload(args, model, messages, conversations[c].output_len)
            await send_request(session, url, payload, record, t0, texts)
            progress.update(failed=not record.success)
            if not record.success:
                for later in turns[c][t + 1:]:
                    later.error = f"turn {t + 1} of this conversation failed"
                    progress.update(failed=True)
                return
            answers.append("".join(texts))

    return await _run_at_offsets(args, len(conversations), sum(map(len, turns)), offsets, work)


def make_conversations(args: argparse.Namespace, rng: np.random.Generator, max_model_len: int | None
                       ) -> tuple[list[multi_turn.Conversation], list[list[RequestRecord]]]:
    """The multi-turn dataset, and a record per turn (its prompt_len: the template-free tokens)."""
    need = multi_turn.max_conversation_len(args.num_turns, args.system_prompt_len, args.turn_len,
                                           args.output_len)
    if max_model_len and need > max_model_len:
        raise ValueError(f"a conversation grows to about {need} tokens, past max_model_len "
                         f"{max_model_len}: fewer --num-turns or shorter turns")
    words = multi_turn.word_tokens(load_tokenizer(args.tokenizer))
    conversations = multi_turn.multi_turn_dataset(
        rng, words, args.num_conversations, args.num_turns, args.system_prompt_len, args.turn_len,
        args.output_len)
    turn_tokens = args.turn_len + args.output_len
    turns = [[RequestRecord(args.system_prompt_len + t * turn_tokens + args.turn_len, args.output_len)
              for t in range(args.num_turns)] for _ in conversations]
    return conversations, turns


def cache_summary(records: list[RequestRecord]) -> dict:
    """Prompt tokens of the completed requests and how many of them the server said it had
    cached (None when it never said)."""
    done = [r for r in records if r.success]
    prompt = sum(r.input_tokens for r in done)
    reported = [r.num_cached_tokens for r in done if r.num_cached_tokens is not None]
    cached = sum(reported) if reported else None
    return {"prompt_tokens": prompt, "cached_tokens": cached,
            "cached_fraction": cached / prompt if cached is not None and prompt else None}


async def scrape_counters(base_url: str, timeout_s: float = 10.0) -> dict[str, dict[str, float]] | None:
    """SERVER_COUNTERS' samples on the gateway's /metrics, {key: {worker: value}} (a key whose
    sample is absent is left out); None when there is no such page (not a pd-serve gateway)."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(base_url + "/metrics") as response:
                response.raise_for_status()
                text = await response.text()
        families = list(text_string_to_metric_families(text))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    out: dict[str, dict[str, float]] = {}
    for key, (name, labels) in SERVER_COUNTERS.items():
        for sample in (s for f in families for s in f.samples if s.name == name):
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                worker = sample.labels.get("worker", "")
                out.setdefault(key, {})[worker] = out.get(key, {}).get(worker, 0.0) + sample.value
    return out


def counter_deltas(before: dict | None, after: dict | None) -> dict | None:
    """{key: {"total": after - before, "by_worker": {...}}} for the keys scraped after the run;
    a worker that was not there before counts from 0."""
    if before is None or after is None:
        return None
    out = {}
    for key, workers in after.items():
        by_worker = {w: v - before.get(key, {}).get(w, 0.0) for w, v in sorted(workers.items())}
        out[key] = {"total": sum(by_worker.values()), "by_worker": by_worker}
    return out


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
                   help="completions sends token ids; chat sends them decoded; multi-turn always sends "
                        "chat messages (default: %(default)s)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests/s; inf sends all at once (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take (default: %(default)s)")
    p.add_argument("--tokenizer", default=None,
                   help="chat, multi-turn: folder with the served model's tokenizer.json, which turns "
                        "ids into text (default: the embedded model's)")
    add_workload_args(p, (*DATASETS, MULTI_TURN))  # --num-prompts, --burstiness, --seed, the dataset group
    m = p.add_argument_group("multi-turn (closed-loop chat conversations; --output-len per turn)")
    m.add_argument("--num-conversations", type=int, default=16, help="(default: %(default)s)")
    m.add_argument("--num-turns", type=int, default=8, help="turns per conversation (default: %(default)s)")
    m.add_argument("--system-prompt-len", type=int, default=1024,
                   help="tokens of the system prompt every conversation shares (default: %(default)s)")
    m.add_argument("--turn-len", type=int, default=256,
                   help="tokens of each turn's new user message (default: %(default)s)")
    m.add_argument("--think-time", type=float, default=0.0,
                   help="seconds between a turn's end and the next turn (default: %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--slo", type=parse_slo, default=None,
                   help="goodput SLOs in ms, e.g. ttft=500,tpot=50[,e2e=10000] (default: none)")
    o.add_argument("--output", default=None, help="write the JSON result here")
    o.add_argument("--save-requests", action="store_true", help="put every request's record in the JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = ["num_prompts", "input_len", "output_len", "num_prefixes", "prefix_len", "vocab_size",
                "num_conversations", "num_turns", "turn_len"]
    for name in positive + ["max_concurrency", "max_model_len"]:
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.suffix_len < 0 or not 0 <= args.range_ratio < 1:
        p.error("--suffix-len must be >= 0 and --range-ratio in [0, 1)")
    if args.system_prompt_len < 0 or args.think_time < 0:
        p.error("--system-prompt-len and --think-time must be >= 0")
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
    if turns := m.get("multi_turn"):
        lines.append(f"{'Multi-turn TTFT':-^52}")
        lines += [row("Median TTFT, first turns (ms):", turns["ttft_ms_first_turn"]["median"]),
                  row("Median TTFT, later turns (ms):", turns["ttft_ms_later_turns"]["median"])]
        lines += [row(f"Median TTFT, turn {t['turn']} (ms):", t["ttft_ms"]["median"])
                  for t in turns["by_turn"]]
    if cache := m.get("cache"):
        lines.append(f"{'Prefix cache':-^52}")
        lines += [row("Prompt tokens:", cache["prompt_tokens"]),
                  row("Cached tokens (usage):", cache["cached_tokens"])]
        server = m.get("server") or {}
        lines += [row(f"{key.replace('_', ' ').capitalize()}:", int(server[key]["total"]))
                  for key in SERVER_COUNTERS if key in server]
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
    before = await scrape_counters(base_url)
    if args.dataset == MULTI_TURN:
        try:
            conversations, turns = make_conversations(args, rng, max_model_len)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        offsets = arrival_offsets(rng, len(conversations), args.request_rate, args.burstiness)
        duration = await run_conversations(args, base_url, model, conversations, turns, offsets)
        records = [r for c in turns for r in c]
    else:
        prompts = make_prompts(args, rng, max_model_len)
        offsets = arrival_offsets(rng, len(prompts), args.request_rate, args.burstiness)
        tokenizer = load_tokenizer(args.tokenizer) if args.endpoint == "chat" else None
        payloads = [build_payload(args, model, p, tokenizer) for p in prompts]
        records = [RequestRecord(len(p.token_ids), p.output_len) for p in prompts]
        duration = await run_requests(args, base_url, payloads, records, offsets)
    if before is not None:
        await asyncio.sleep(METRICS_SETTLE_S)
    metrics = compute_metrics(records, duration, args.slo)
    if args.dataset == MULTI_TURN:
        metrics["multi_turn"] = multi_turn.turn_metrics(turns)
    metrics["cache"] = cache_summary(records)
    metrics["server"] = counter_deltas(before, await scrape_counters(base_url))
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
