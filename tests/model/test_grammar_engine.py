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


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlap"])
def test_a_slow_grammar_compiles_while_other_requests_run(engines, overlap):
    """A grammar whose compile takes a while (hundreds of EBNF rules) compiles on its own
    thread: the first step runs the plain request without it, the grammar's request joins once
    compiled, and its answer is what it is when the grammar was compiled beforehand."""
    sync = engines[int(overlap)]
    rules = ["root ::= a0"] + [f'a{i} ::= [a-z]{{0,2}} "{i % 10}" a{i + 1}' for i in range(300)]
    grammar = Grammar("ebnf", "\n".join(rules + ['a300 ::= "."']))
    slow = SamplingParams(temperature=0.0, max_tokens=8, grammar=grammar)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sync.add_request([1, 5, 9], slow, request_id="slow")
    sync.add_request([1, 6, 9], plain, request_id="plain")
    first = sync.step()
    assert [o.request_id for o in first] in ([], ["plain"])  # (overlap: its token comes next)
    assert [r.request_id for r in sync.scheduler.running] == ["plain"]
    outputs = {}
    while sync.has_unfinished():
        for out in sync.step():
            outputs[out.request_id] = out
    again = sync.generate([[1, 5, 9]], slow)[0]  # compiled now: admitted at once
    assert outputs["slow"].token_ids == again.token_ids and len(again.token_ids) == 8
    assert outputs["plain"].finished
    assert_pages_settled(sync)
