"""tools, tool_choice and --tool-call-parser / --reasoning-parser through the HTTP layer, with
no processes: aiohttp's test server over build_app, a source that plays the tokens of a scripted
output text. What reaches the source (template, grammar, skip_special_tokens), the answers'
shapes, streamed or not, and the 400s."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pd_serve.gateway.app import build_app
from pd_serve.gateway.source import GenerateSpec, TokenEvent, TokenSource
from pd_serve.model.tokenizer import Tokenizer

MODEL = "m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
# A template that shows the tools and an assistant's earlier calls, as tool-aware ones do.
TEMPLATE = ("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
            "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
            "CALL {{ c.function.name }} {{ c.function.arguments.a }}{% endfor %}\n{% endfor %}"
            "assistant:")


class TextSource(TokenSource):
    """Answers every request with the tokens of `text`, a few per event; records the specs."""

    def __init__(self, tokenizer: Tokenizer, text: str, eos: bool = False):
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.ids += [min(tokenizer.eos_token_ids)] if eos else []
        self.specs: list[GenerateSpec] = []

    def model_name(self) -> str:
        return MODEL

    def max_model_len(self) -> int:
        return 4096

    async def generate(self, spec: GenerateSpec):
        self.specs.append(spec)
        for i in range(0, len(self.ids), 3):
            await asyncio.sleep(0)
            last = i + 3 >= len(self.ids)
            yield TokenEvent(self.ids[i:i + 3], finished=last, finish_reason="stop" if last else None)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir, tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return Tokenizer.from_dir(folder)


def chat(tokenizer, text: str, body: dict, eos: bool = False, **server) -> tuple[int, object, TextSource]:
    """(status, JSON body or the list of SSE payloads, the source) of one chat request; eos:
    the output ends with an EOS token."""
    source = TextSource(tokenizer, text, eos)

    async def go():
        app = build_app(source, tokenizer, **server)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
                "max_tokens": 64} | body)
            raw = await resp.text()
            if body.get("stream") and resp.status == 200:
                return resp.status, [json.loads(line[6:]) for line in raw.split("\n\n")
                                     if line.startswith("data: {")]
            return resp.status, json.loads(raw)
    status, out = asyncio.run(go())
    return status, out, source


def assembled(chunks: list[dict]) -> tuple[dict, str]:
    """The message a client builds from stream chunks, and the finish_reason."""
    message = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        finish = choice["finish_reason"] or finish
        for key in ("content", "reasoning_content"):
            message[key] += delta.get(key) or ""
        for entry in delta.get("tool_calls", []):
            if entry.get("id"):
                message["tool_calls"].append({"id": entry["id"], "type": entry["type"],
                                              "function": dict(entry["function"])})
            else:
                message["tool_calls"][entry["index"]]["function"]["arguments"] += \
                    entry["function"]["arguments"]
    return message, finish


@pytest.mark.parametrize("stream", [False, True])
def test_auto_hermes_calls(tokenizer, stream):
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    status, out, source = chat(tokenizer, text, {"tools": [WEATHER, ADD], "stream": stream},
                               tool_call_parser="hermes")
    assert status == 200, out
    spec = source.specs[0]
    prompt = tokenizer.decode(spec.prompt_token_ids)
    assert prompt.startswith("TOOLS:") and "get_weather" in prompt  # the template saw the tools
    assert spec.params.grammar is None and not spec.params.skip_special_tokens
    message, finish = assembled(out) if stream else (out["choices"][0]["message"],
                                                     out["choices"][0]["finish_reason"])
    assert finish == "tool_calls"
    assert not message["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris"}),
                                                ("add", {"a": 1, "b": 2})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])
    status, out, _ = chat(tokenizer, text, {"tools": [WEATHER, ADD], "stream": stream,
                                            "parallel_tool_calls": False},
                          tool_call_parser="hermes")
    message, finish = assembled(out) if stream else (out["choices"][0]["message"],
                                                     out["choices"][0]["finish_reason"])
    assert finish == "tool_calls" and not message["content"]  # the first call only, as vLLM
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_auto_plain_answer_and_none(tokenizer):
    # hermes keeps special tokens (its markers may be ones): the ending EOS still adds no text
    status, out, _ = chat(tokenizer, "It is sunny.", {"tools": [WEATHER]}, eos=True,
                          tool_call_parser="hermes")
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"
    # none: the text is not read for calls; the tools still reach the template
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    status, out, source = chat(tokenizer, text, {"tools": [ADD], "tool_choice": "none"})
    assert out["choices"][0]["message"]["content"] == text and status == 200
    assert tokenizer.decode(source.specs[0].prompt_token_ids).startswith("TOOLS:")


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_set_the_grammar(tokenizer, stream):
    text = '[{"name":"add","parameters":{"a":1,"b":2}}]'
    status, out, source = chat(tokenizer, text, {"tools": [WEATHER, ADD], "tool_choice": "required",
                                                 "parallel_tool_calls": False, "stream": stream})
    assert status == 200, out
    schema = json.loads(source.specs[0].params.grammar.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [i["properties"]["name"] for i in schema["items"]["anyOf"]] == \
        [{"enum": ["get_weather"]}, {"enum": ["add"]}]
    message, finish = assembled(out) if stream else (out["choices"][0]["message"],
                                                     out["choices"][0]["finish_reason"])
    assert finish == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("add", '{"a":1,"b":2}')]
    named = {"type": "function", "function": {"name": "get_weather"}}
    status, out, source = chat(tokenizer, '{"city":"Oslo"}', {"tools": [WEATHER, ADD],
                                                              "tool_choice": named, "stream": stream})
    assert json.loads(source.specs[0].params.grammar.spec) == WEATHER["function"]["parameters"]
    message, finish = assembled(out) if stream else (out["choices"][0]["message"],
                                                     out["choices"][0]["finish_reason"])
    assert finish == "stop"  # a forced call ends as OpenAI ends it, not with "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", '{"city":"Oslo"}')]


def _tool_with_defs(name: str, defs_key: str, unit: list[str]) -> dict:
    """A tool whose parameters refer to their own root definitions, as pydantic writes them."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"unit": {"$ref": f"#/{defs_key}/Unit"}},
        "required": ["unit"], defs_key: {"Unit": {"enum": unit}}}}}


def test_required_calls_of_tools_with_definitions_find_them(tokenizer):
    """Nested in the required choice's array, a tool's "#/$defs/X" (or "#/definitions/X")
    resolves at the array's root: the tools' definitions move there, merged."""
    tools = [_tool_with_defs("temp", "$defs", ["c", "f"]),
             _tool_with_defs("speed", "definitions", ["kmh"]),
             _tool_with_defs("wind", "$defs", ["c", "f"])]  # the same definition again: fine
    text = '[{"name":"speed","parameters":{"unit":"kmh"}}]'
    status, out, source = chat(tokenizer, text, {"tools": tools, "tool_choice": "required"})
    assert status == 200, out
    schema = json.loads(source.specs[0].params.grammar.spec)
    assert schema["$defs"] == {"Unit": {"enum": ["c", "f"]}}
    assert schema["definitions"] == {"Unit": {"enum": ["kmh"]}}
    assert all(set(item["properties"]["parameters"]) == {"type", "properties", "required"}
               for item in schema["items"]["anyOf"])
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"unit":"kmh"}'
    clash = [tools[0], _tool_with_defs("other", "$defs", ["k"])]
    status, out, _ = chat(tokenizer, text, {"tools": clash, "tool_choice": "required"})
    assert status == 400 and out["error"]["param"] == "tools", out
    assert "two tools define $defs/Unit differently" in out["error"]["message"]


def test_a_stream_sends_name_first_then_argument_fragments(tokenizer):
    named = {"type": "function", "function": {"name": "add"}}
    status, chunks, _ = chat(tokenizer, '{"a":12345,"b":67890}',
                             {"tools": [ADD], "tool_choice": named, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    first = deltas[1]["tool_calls"]
    assert first == [{"index": 0, "id": first[0]["id"], "type": "function",
                      "function": {"name": "add", "arguments": ""}}]
    fragments = [d["tool_calls"][0] for d in deltas[2:] if d]
    assert len(fragments) > 1 and all(set(f) == {"index", "function"} for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"a":12345,"b":67890}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # a forced call's (OpenAI's)


def test_earlier_calls_reach_the_template_with_object_arguments(tokenizer):
    messages = [{"role": "user", "content": "add"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": '{"a": 7, "b": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "8"}]
    status, out, source = chat(tokenizer, "8", {"messages": messages, "tools": [ADD],
                                                "tool_choice": "none"})
    assert status == 200, out
    assert "CALL add 7" in tokenizer.decode(source.specs[0].prompt_token_ids)


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}


@pytest.mark.parametrize("message,param", [
    ({"role": "assistant", "content": None, "tool_calls": "add"}, "messages[1].tool_calls"),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"id": "call_1"}]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [CALL, {**CALL, "function": {"name": "add"}}]},
     "messages[1].tool_calls[1]"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": 5, "arguments": "{}"}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add",
                                                                 "arguments": {"a": 1}}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "retrieval"}]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": 7}]}, "messages[1].tool_calls[0]"),
    ({"role": "tool", "tool_call_id": ["call_1"], "content": "8"}, "messages[1].tool_call_id"),
    ({"role": "user", "name": {"first": "a"}, "content": "x"}, "messages[1].name"),
])
def test_malformed_messages_with_tool_calls_are_400(tokenizer, message, param):
    """Earlier turns' tool calls are checked as OpenAI checks them, not handed to the chat
    template in any shape."""
    status, out, source = chat(tokenizer, "x", {"messages": [{"role": "user", "content": "add"},
                                                             message]})
    assert status == 400, out
    assert out["error"]["param"] == param, out
    assert out["error"]["type"] == "invalid_request_error" and not source.specs


def test_a_tool_call_with_arguments_that_are_not_json_reaches_the_template_as_given(tokenizer):
    messages = [{"role": "user", "content": "add"},
                {"role": "assistant", "tool_calls": [{**CALL, "function": {
                    "name": "add", "arguments": "not json"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "8"}]
    status, out, _ = chat(tokenizer, "8", {"messages": messages})
    assert status == 200, out
    nulls = {"role": "assistant", "content": "hi", "tool_calls": None, "name": None}  # as absent
    status, out, _ = chat(tokenizer, "8", {"messages": [messages[0], nulls]})
    assert status == 200, out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", ["deepseek-r1", "qwen3"])
def test_reasoning_parser(tokenizer, parser, stream):
    status, out, _ = chat(tokenizer, "<think>it is late</think>Good night.", {"stream": stream},
                          reasoning_parser=parser)
    message, finish = assembled(out) if stream else (out["choices"][0]["message"],
                                                     out["choices"][0]["finish_reason"])
    assert (message["reasoning_content"], message["content"], finish) == \
        ("it is late", "Good night.", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_structured_output_is_content_under_a_reasoning_parser(tokenizer, stream):
    """Under a grammar the output is the grammar's from its first token: deepseek-r1's parser
    (which takes text with no </think> as reasoning) takes reasoning only where the output
    opens <think> itself, so a JSON answer is all content."""
    answer = '{"a": 123}'
    status, out, _ = chat(tokenizer, answer, {"stream": stream, "response_format": {
        "type": "json_object"}}, reasoning_parser="deepseek-r1")
    message, _ = assembled(out) if stream else (out["choices"][0]["message"], None)
    assert message["content"] == answer and not message.get("reasoning_content")


@pytest.mark.parametrize("body,param,message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "requires 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [WEATHER]}, "tool_choice", "--tool-call-parser"),  # auto, the default, needs one
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "invalid json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
     "tools[0].function.name", "letters"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name", "two tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]", "must be"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"functions": [{"name": "f"}]}, "functions", "is not supported"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters", "'#/properties/a' points elsewhere"),
    ({"tools": [{"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "'#' points elsewhere"),
])
def test_bad_tool_requests_are_400(tokenizer, body, param, message):
    status, out, source = chat(tokenizer, "x", body)
    assert status == 400, out
    assert out["error"]["param"] == param and message in out["error"]["message"], out
    assert out["error"]["type"] == "invalid_request_error" and not source.specs
