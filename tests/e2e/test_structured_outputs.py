"""Structured outputs end to end with the official openai client, on a tiny random model: a
colocated worker and a 1P1D cluster (its decode worker under the overlap schedule, forced on
with PD_SERVE_OVERLAP_CPU=1). At temperature 1.0 every json_schema answer parses and validates,
every regex answer matches, streamed or not; a seeded request gives the same answer colocated
and disaggregated (decode replays token 1 into its matcher); bad grammars are 400s."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from cluster_helpers import start_cluster, wait_idle

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                          "strict": True}}
REGEX = r"(yes|no), [0-9]{1,3} [a-z]{2,6}\."
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
NUM_REQUESTS = 50
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir, tiny_checkpoint_writer):
    return tiny_checkpoint_writer("llama3", tmp_path_factory.mktemp("tiny") / "llama3",
                                 default_model_dir, seed=5)


@pytest.fixture(scope="module", params=["colocated", "1p1d"])
def cluster(request, model_dir):
    with pytest.MonkeyPatch.context() as mp:  # the workers inherit it
        if request.param == "1p1d":
            mp.setenv("PD_SERVE_OVERLAP_CPU", "1")
            cluster = start_cluster(1, 1, model=model_dir)
        else:
            cluster = start_cluster(0, 0, num_colocated=1, model=model_dir)
    yield cluster
    cluster.stop()


def client_for(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def chat_json(client, model, i: int) -> tuple[str, str]:
    if i % 3 == 2:  # streamed: the deltas assemble to the answer
        stream = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0,
            response_format=RESPONSE_FORMAT, stream=True)
        chunks = [c for c in stream if c.choices]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    if i % 3 == 1:  # vLLM's field on /v1/completions
        out = client.completions.create(model=model, prompt="A person: ", max_tokens=MAX_TOKENS,
                                        temperature=1.0, extra_body={"guided_json": SCHEMA})
        return out.choices[0].text, out.choices[0].finish_reason
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                         temperature=1.0, response_format=RESPONSE_FORMAT)
    return out.choices[0].message.content, out.choices[0].finish_reason


def test_json_schema_answers_validate(cluster):
    client = client_for(cluster)
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: chat_json(client, model, i), range(NUM_REQUESTS)))
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    # the model is random: unconstrained, it does not write JSON at all
    free = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30,
                                          temperature=1.0, seed=1).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)
    assert all(used == 0 for used, _ in wait_idle(cluster).values())


def test_regex_ebnf_and_json_object_answers_match(cluster):
    client = client_for(cluster)
    model = client.models.list().data[0].id

    def one(i: int) -> tuple[str, str]:
        extra = [{"regex": REGEX}, {"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}]
        stream = i % 4 >= 2
        out = client.completions.create(model=model, prompt="Answer: ", max_tokens=40,
                                        temperature=1.0, stream=stream, extra_body=extra[i % 3])
        if stream:
            return "".join(c.choices[0].text for c in out if c.choices)
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(16)))
    for text in texts:
        assert re.fullmatch(REGEX, text), text
    ebnf = 'root ::= "<" item ("," item)* ">"\nitem ::= [a-c] | [0-9]+'
    for field in ("ebnf", "guided_grammar"):
        out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40,
                                             temperature=1.0, extra_body={field: ebnf})
        text = out.choices[0].message.content
        if out.choices[0].finish_reason == "stop":
            assert re.fullmatch(r"<([a-c]|[0-9]+)(,([a-c]|[0-9]+))*>", text), text
        else:  # max_tokens: a prefix of the grammar, or all of it if its last token was the 40th
            assert re.fullmatch(r"<([a-c]|[0-9]+)(,([a-c]|[0-9]+))*(,|>)?", text), text
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=60,
                                         temperature=0.0, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_seeded_answers_equal_across_clusters(cluster):
    """Colocated and 1P1D (decode continues prefill's matcher by replaying token 1) sample the
    same seeded answers: the module's two clusters fill and compare one dict."""
    client = client_for(cluster)
    model = client.models.list().data[0].id
    answers = [client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i,
        response_format=RESPONSE_FORMAT).choices[0].message.content for i in range(6)]
    for text in answers:
        jsonschema.validate(json.loads(text), SCHEMA)
    _SEEDED.setdefault("answers", answers)
    assert answers == _SEEDED["answers"]


_SEEDED: dict = {}


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"guided_choice": ["a", 3]}}, "guided_choice"),
    ({"extra_body": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf"),
])
def test_bad_or_unsupported_grammars_are_400(cluster, fields, param):
    client = client_for(cluster)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **fields)
    assert e.value.body["param"] == param, e.value.body
