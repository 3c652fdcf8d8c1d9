"""Structured outputs' cost: decode output tokens/s of a batch under a JSON schema against the
same batch without one, in one colocated engine.

    python -m bench.structured --device cpu                      # the embedded SmolLM2, CPU
    python -m bench.structured --preset llama3-8b --tokenizer DIR --batch 64 \
        --output bench/results/structured-h200-llama3-8b.json     # dummy weights on a GPU

Each case adds `--batch` requests of `--prompt-len` random prompt ids at temperature 1.0 with
ignore_eos, steps until every one has its first token, then times `--steps` steps (the decode
rate: batch x steps / seconds). The schema's array of objects never has to end, so every timed
token is sampled under the grammar (a row whose matcher has ended would sample freely: the
record counts them). A preset runs on dummy weights; --tokenizer names a folder whose
tokenizer.json it serves with (the grammar needs a vocabulary).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._common import device_name, git_commit, sync, write_json
from bench.one_batch import PRESETS
from pd_serve import Engine, SamplingParams
from pd_serve.engine.sampling_params import Grammar

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "count", "tags"]}}}, "required": ["items"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model folder (default: the embedded SmolLM2)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="dummy weights of this shape")
    p.add_argument("--tokenizer", help="with --preset: the folder whose tokenizer.json to use")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (alternating)")
    p.add_argument("--output", help="write the record here (JSON)")
    return p.parse_args(argv)


def run_case(engine: Engine, args, gen: torch.Generator, grammar: Grammar | None) -> dict:
    """One timed batch: its decode tokens/s and how many rows ended their grammar."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=1.0, max_tokens=1 << 20, ignore_eos=True, grammar=grammar)
    ids = [engine.add_request(torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(), params)
           for _ in range(args.batch)]
    while not all(len(r.output_token_ids) >= 1 for r in _running(engine)):
        engine.step()
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync(engine.device)
    seconds = time.perf_counter() - start
    ended = sum(1 for c in engine.executor.requests.values()
                if c.grammar is not None and not c.grammar.active)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    engine.drain()
    return {"tokens_per_s": args.batch * args.steps / seconds, "seconds": seconds,
            "grammars_ended": ended}


def _running(engine: Engine):
    return list(engine.scheduler.running) + list(engine.scheduler.waiting)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="structured-") as tmp:
        model = args.model
        if args.preset:
            model = Path(tmp)
            (model / "config.json").write_text(json.dumps(PRESETS[args.preset]))
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if (Path(args.tokenizer) / name).exists():
                    shutil.copy(Path(args.tokenizer) / name, model / name)
        options = dict(device=args.device, max_running_requests=max(args.batch, 8),
                       context_length=args.prompt_len + args.steps * (args.repeats * 2 + 2) + 64)
        if args.preset:
            options["load_format"] = "dummy"
        engine = Engine(model, **options)
        gen = torch.Generator().manual_seed(0)
        grammar = Grammar("json_schema", json.dumps(SCHEMA))
        run_case(engine, args, gen, grammar)  # compiles the grammar, loads xgrammar
        cases = {"none": [], "json_schema": []}
        for _ in range(args.repeats):
            cases["none"].append(run_case(engine, args, gen, None))
            cases["json_schema"].append(run_case(engine, args, gen, grammar))
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in cases.items()}
    record = {"bench": "structured", "device": str(engine.device),
              "device_name": device_name(engine.device), "git_commit": git_commit(),
              "model": args.preset or str(args.model or "default"), "flags": vars(args),
              "overlap_schedule": engine.overlap, "cuda_graphs": bool(engine.runner.graphs),
              "schema": SCHEMA, "cases": cases, "best_tokens_per_s": best,
              "json_schema_vs_none": best["json_schema"] / best["none"]}
    print(json.dumps({k: record[k] for k in ("device_name", "model", "best_tokens_per_s",
                                             "json_schema_vs_none")}, indent=1), file=sys.stderr)
    if args.output:
        write_json(args.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
