"""Structured outputs in the colocated engine: under the overlap schedule (a grammar row's
input token still in flight when its step is planned; engine/executor.py) seeded answers equal
the synchronous schedule's, and they are inside their grammars."""

from __future__ import annotations

import json
import re

import pytest

from helpers import assert_pages_settled
from pd_serve import Engine, SamplingParams
from pd_serve.engine.sampling_params import Grammar

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["word", "n"], "additionalProperties": False}
REGEX = r"[a-z]{1,4}( [0-9]{1,2}){1,3}"


@pytest.fixture(scope="module")
def engines(tmp_path_factory, default_model_dir, tiny_checkpoint_writer) -> tuple[Engine, Engine]:
    model = tiny_checkpoint_writer("llama3", tmp_path_factory.mktemp("tiny") / "llama3",
                                  default_model_dir, seed=7)
    overlap = Engine(model, device="cpu", max_total_tokens=4096)
    overlap.overlap = True
    return Engine(model, device="cpu", max_total_tokens=4096), overlap


def test_overlap_schedule_gives_the_synchronous_answers(engines):
    sync, overlap = engines
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                             grammar=Grammar("json_schema", json.dumps(SCHEMA))) for i in range(4)]
    params += [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=30,
                              grammar=Grammar("regex", REGEX)) for i in range(3)]
    params += [SamplingParams(temperature=1.0, seed=20, max_tokens=12, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]  # no grammar beside
    prompts = [[1, 5 + i, 9, 200 + 3 * i] for i in range(len(params))]
    want = sync.generate(prompts, params)
    got = overlap.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for out in got[:4]:
        assert out.finish_reason == "stop"
        value = json.loads(out.text)
        assert set(value) == {"word", "n"} and len(value["word"]) <= 5
    for out in got[4:7]:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    while overlap.has_unfinished():  # a step in flight when the last answer ended settles
        overlap.step()
    assert_pages_settled(overlap)
