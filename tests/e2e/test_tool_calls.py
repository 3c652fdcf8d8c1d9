"""Tool calls and reasoning end to end with the official openai client, on a tiny random model:
a colocated worker (gateway: --tool-call-parser hermes --reasoning-parser deepseek-r1) and a 1P1D
cluster (llama3_json, qwen3; its decode worker under the overlap schedule). At temperature 1.0
every required and named call's arguments validate against the tool's schema; a seeded stream
assembles to the non-streamed calls; a regex that forces <think>...</think> is split into
reasoning_content and content. The random model never calls a tool by itself: the parsers'
reading of real formats is tests/unit/test_tool_parsers.py."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from cluster_helpers import start_cluster, wait_idle

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {
    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
    "repeat": {"type": "boolean"}},
    "required": ["hour", "repeat"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
TOOLS = [{"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NUM_REQUESTS = 50
MAX_TOKENS = 160
THINK = r"<think>[a-z ]{1,20}</think>[a-z ]{1,20}"
GATEWAY = ("--worker-timeout", "3", "--step-timeout", "30")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir, tiny_checkpoint_writer):
    return tiny_checkpoint_writer("llama3", tmp_path_factory.mktemp("tiny") / "llama3",
                                 default_model_dir, seed=6)


@pytest.fixture(scope="module", params=["colocated", "1p1d"])
def cluster(request, model_dir):
    with pytest.MonkeyPatch.context() as mp:  # the workers inherit it
        if request.param == "1p1d":
            mp.setenv("PD_SERVE_OVERLAP_CPU", "1")
            cluster = start_cluster(1, 1, model=model_dir, gateway_args=GATEWAY + (
                "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3"))
        else:
            cluster = start_cluster(0, 0, num_colocated=1, model=model_dir, gateway_args=GATEWAY + (
                "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek-r1"))
    yield cluster
    cluster.stop()


def client_for(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def ask(client, model, tool_choice, stream: bool, **kwargs) -> tuple[list[tuple[str, str]], str, dict]:
    """([(name, arguments)] of the answer's calls, finish_reason, the message's other fields)."""
    out = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                         tool_choice=tool_choice, max_tokens=MAX_TOKENS,
                                         stream=stream, **kwargs)
    if not stream:
        message = out.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert all(c.id and c.type == "function" for c in message.tool_calls or [])
        return calls, out.choices[0].finish_reason, {"content": message.content}
    calls, content, finish = [], "", None
    for chunk in out:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for entry in choice.delta.tool_calls or []:
            if entry.id:  # the call's first delta: index, id, type, name
                assert entry.index == len(calls) and entry.type == "function"
                calls.append([entry.function.name, entry.function.arguments or ""])
            else:
                calls[entry.index][1] += entry.function.arguments
    return [tuple(c) for c in calls], finish, {"content": content or None}


def assert_valid(calls: list[tuple[str, str]], finish: str, names=tuple(SCHEMAS),
                 ends: str = "tool_calls") -> None:
    """ends: the finish_reason of a whole answer (a named choice's forced call: "stop")."""
    assert finish == ends, (finish, calls)
    assert calls
    assert_arguments_valid(calls, names)


def assert_arguments_valid(calls: list[tuple[str, str]], names=tuple(SCHEMAS)) -> None:
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_calls_validate(cluster):
    """One call per answer (parallel_tool_calls false): a random model at temperature 1.0 would
    otherwise keep adding calls past any max_tokens."""
    client = client_for(cluster)
    model = client.models.list().data[0].id

    def one(i: int):
        return ask(client, model, "required", stream=i % 3 == 2, temperature=1.0,
                   parallel_tool_calls=False)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(NUM_REQUESTS)))
    for calls, finish, rest in answers:
        assert_valid(calls, finish)
        assert rest["content"] is None and len(calls) == 1
    assert all(used == 0 for used, _ in wait_idle(cluster).values())


def test_required_parallel_calls(cluster):
    """Several calls in one answer: each one complete validates; one cut by max_tokens is the
    last, with finish_reason length."""
    client = client_for(cluster)
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: ask(client, model, "required", stream=i % 2 == 1,
                                              temperature=1.0, seed=i), range(8)))
    for calls, finish, _ in answers:
        assert finish in ("tool_calls", "length") and calls
        assert_arguments_valid(calls if finish == "tool_calls" else calls[:-1])
    assert max(len(calls) for calls, _, _ in answers) > 1


def test_named_calls_validate(cluster):
    client = client_for(cluster)
    model = client.models.list().data[0].id
    choice = {"type": "function", "function": {"name": "get_weather"}}

    def one(i: int):
        return ask(client, model, choice, stream=i % 3 == 2, temperature=1.0)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(NUM_REQUESTS)))
    for calls, finish, _ in answers:
        assert_valid(calls, finish, names=("get_weather",), ends="stop")
        assert len(calls) == 1


def test_streamed_calls_equal_the_whole_answer(cluster):
    client = client_for(cluster)
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "set_alarm"}}
    for seed in range(3):
        for choice in ("required", named):
            whole = ask(client, model, choice, stream=False, temperature=1.0, seed=seed)
            streamed = ask(client, model, choice, stream=True, temperature=1.0, seed=seed)
            assert whole == streamed
            calls, finish, _ = whole  # (parallel calls: a last one may be cut by max_tokens)
            assert_arguments_valid(calls if finish != "length" else calls[:-1])


def test_auto_reads_plain_text_as_content(cluster):
    """The random text holds no call: it is the answer (deepseek-r1, with no </think> in it,
    reads all of it as reasoning; qwen3 as content)."""
    client = client_for(cluster)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                         max_tokens=30, temperature=1.0, seed=3)
    message = out.choices[0].message
    assert not message.tool_calls and out.choices[0].finish_reason in ("stop", "length")
    assert (message.content is None) != (message.reasoning_content is None)
    assert message.content or message.reasoning_content


def test_reasoning_is_split_out(cluster):
    client = client_for(cluster)
    model = client.models.list().data[0].id
    for seed in range(3):
        kwargs = dict(model=model, messages=MESSAGES, max_tokens=100, temperature=1.0, seed=seed,
                      extra_body={"guided_regex": THINK})
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning = message.reasoning_content
        assert re.fullmatch(r"[a-z ]{1,20}", reasoning) and re.fullmatch(r"[a-z ]{1,20}", message.content)
        parts = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                delta = chunk.choices[0].delta
                parts["content"] += delta.content or ""
                parts["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
        assert parts == {"reasoning_content": reasoning, "content": message.content}


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
])
def test_bad_tool_requests_are_400(cluster, fields, param):
    client = client_for(cluster)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **fields)
    assert e.value.body["param"] == param, e.value.body
