"""Structured outputs on a GPU, where the engine runs the overlap schedule and CUDA graphs: a
grammar step's sampling is queued only when the next step launches (sampler.DeferredSample),
reading the graph's logits buffer before the next replay rewrites it. Seeded answers equal the
synchronous schedule's and are inside their grammars (skipped without CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from pd_serve import Engine, SamplingParams
from pd_serve.engine.sampling_params import Grammar

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["word", "n"], "additionalProperties": False}


def test_overlap_and_graphs_give_the_synchronous_answers(tiny_checkpoints):
    model = tiny_checkpoints["llama3"]
    overlap = Engine(model, device="cuda", max_total_tokens=4096)
    assert overlap.overlap and overlap.runner.graphs
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                             grammar=Grammar("json_schema", json.dumps(SCHEMA))) for i in range(6)]
    params += [SamplingParams(temperature=0.0, max_tokens=40,
                              grammar=Grammar("json_schema", json.dumps(SCHEMA))),
               SamplingParams(temperature=1.0, seed=20, max_tokens=12, ignore_eos=True)]
    prompts = [[1, 5 + i, 9, 200 + 3 * i] for i in range(len(params))]
    got = overlap.generate(prompts, params)
    del overlap
    sync = Engine(model, device="cuda", max_total_tokens=4096, disable_overlap_schedule=True)
    want = sync.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for out in got[:7]:  # the object closes well inside max_tokens, then only a stop token fits
        assert out.finish_reason == "stop", out
        value = json.loads(out.text)
        assert set(value) == {"word", "n"} and len(value["word"]) <= 5


def test_min_tokens_under_graphs_and_overlap_equals_the_synchronous_schedule(tiny_checkpoints):
    """min_tokens counts a row's outputs from its position, so the graph decode path with the
    token before still in flight masks the stop ids exactly as the synchronous eager one; rows
    with and without it share the batch."""
    model = tiny_checkpoints["llama3"]
    prompts = [[1, 7 + i, 11, 300 + 5 * i] for i in range(8)]
    sync = Engine(model, device="cuda", max_total_tokens=4096, disable_overlap_schedule=True,
                  disable_cuda_graph=True)
    greedy = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=g.token_ids[1:3],
                             min_tokens=6 if i % 2 else 0) for i, g in enumerate(greedy)]
    params[0] = SamplingParams(temperature=1.0, seed=3, max_tokens=12, min_tokens=5,
                               stop_token_ids=greedy[0].token_ids[:4])
    want = sync.generate(prompts, params)
    del sync
    overlap = Engine(model, device="cuda", max_total_tokens=4096)
    assert overlap.overlap and overlap.runner.graphs
    got = overlap.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for out, p in zip(want, params):
        assert not set(out.token_ids[:p.min_tokens]) & set(p.stop_token_ids)
        # without min_tokens its own greedy tokens 2 and 3 stop it; with it, nothing before
        assert len(out.token_ids) <= 3 if p.min_tokens == 0 else len(out.token_ids) >= p.min_tokens
