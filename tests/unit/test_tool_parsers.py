"""Tool-call parsers and the reasoning splitter on constructed outputs: the whole answer, and
the same text streamed in pieces of every size, which must assemble to the same message."""

from __future__ import annotations

import json

import pytest

from pd_serve.gateway.openai_message import ChatOutput
from pd_serve.gateway.reasoning import prompt_opens_reasoning, split_reasoning
from pd_serve.gateway.tool_parsers import NamedParser, RequiredParser, make_parser

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
ADD = ("add", {"a": 1, "b": "x\"}<tool_call>[TOOL_CALLS]"})  # markers inside a string


def _calls(*calls) -> list[tuple[str, dict]]:
    return list(calls)


# (parser, output text, content, calls)
CASES = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "add", '
               '"arguments": ' + json.dumps(ADD[1]) + '}\n</tool_call>', "Let me check.",
     _calls(WEATHER, ADD)),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris", "days": 3}, "name": "get_weather"}'
               '</tool_call>', None, _calls(WEATHER)),  # name after the arguments
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"days": 3}}; {"name": "add", "parameters": ' + json.dumps(ADD[1]) + '}',
     None, _calls(WEATHER, ADD)),
    ("llama3_json", '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', None,
     _calls(WEATHER)),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    # escapes that make no text: a bad one, a lone surrogate (name or arguments): content
    ("llama3_json", '{"name": "\\q", "parameters": {}}', '{"name": "\\q", "parameters": {}}', []),
    ("llama3_json", '{"name": "\\ud800", "parameters": {}}', '{"name": "\\ud800", "parameters": {}}',
     []),
    ("hermes", '<tool_call>{"arguments": {"x": "\\udc00"}, "name": "f"}</tool_call>',
     '<tool_call>{"arguments": {"x": "\\udc00"}, "name": "f"}</tool_call>', []),
    ("llama3_json", "The weather is {\"name\": fine}", "The weather is {\"name\": fine}", []),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3}}, {"name": "add", "arguments": ' + json.dumps(ADD[1]) + '}]',
     "Sure", _calls(WEATHER, ADD)),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]add[ARGS]'
                + json.dumps(ADD[1]), None, _calls(WEATHER, ADD)),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ("mistral", "a [TOOL_CALL", "a [TOOL_CALL", []),
]


def whole(parser, text: str, reasoning: str | None = None) -> dict:
    return ChatOutput(reasoning, False, parser).message(text)


def streamed(parser, text: str, step: int, reasoning: str | None = None) -> dict:
    """The message a client assembles from the stream deltas of `text` in `step`-char pieces."""
    output = ChatOutput(reasoning, False, parser)
    deltas = []
    for i in range(0, len(text), step):
        deltas += output.deltas(text[i:i + step], False)
    deltas += output.deltas("", True)
    message: dict = {"content": "".join(d.get("content", "") for d in deltas) or None}
    if reasoning:
        message["reasoning_content"] = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        for entry in d.get("tool_calls", []):
            if "id" in entry:  # a call's first delta: index, id, type, name; arguments ""
                assert entry["index"] == len(calls) and entry["type"] == "function"
                assert entry["function"]["arguments"] == ""
                calls.append({"name": entry["function"]["name"], "arguments": ""})
            else:
                assert set(entry) == {"index", "function"}
                calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    message["calls"] = calls
    return message


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parsers_read_whole_and_streamed_alike(name, text, content, calls):
    message = whole(make_parser(name), text)
    assert message["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in message.get("tool_calls", [])]
    assert got == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function"
               for c in message.get("tool_calls", []))
    for step in (1, 2, 5, 13, len(text)):
        s = streamed(make_parser(name), text, step)
        assert s["content"] == content, step
        assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"]] == calls, step
        assert [c["arguments"] for c in s["calls"]] == \
            [c["function"]["arguments"] for c in message.get("tool_calls", [])]


def test_stream_holds_back_a_marker_until_it_resolves():
    output = ChatOutput(None, False, make_parser("hermes"))
    assert output.deltas("Hi <tool_", False) == [{"content": "Hi"}]
    assert output.deltas("tip> is no tag", False) == [{"content": " <tool_tip> is no tag"}]
    output = ChatOutput(None, False, make_parser("llama3_json"))
    assert output.deltas("<|python", False) == []
    assert output.deltas('_tag|>{"name": "f", "parameters": {"x"', False) == []
    assert output.num_calls == 0  # an auto parser's calls go out with its final reading
    last = output.deltas(": 1}}", True)
    assert last == [{"tool_calls": [{"index": 0, "id": last[0]["tool_calls"][0]["id"],
                                     "type": "function", "function": {"name": "f", "arguments": ""}}]},
                    {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]}]
    assert output.num_calls == 1


def test_auto_output_cut_inside_a_call():
    """A whole answer cut inside a call is content (vLLM's rule), and so is the streamed one:
    the stream never began the call."""
    text = '{"name": "get_weather", "parameters": {"city": "Par'
    assert whole(make_parser("llama3_json"), text) == {"role": "assistant", "content": text}
    s = streamed(make_parser("llama3_json"), text, 4)
    assert s == {"content": text, "calls": []}


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>'),
    ("hermes", 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    ("hermes", "Let me check.\n" + HERMES_CALL + '\n<tool_call>\n{"name": "get_weather", "argu'),
    ("hermes", HERMES_CALL + "\n<tool_call>\nnot a call</tool_call>"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}\nI will now check.'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}] and more'),
])
def test_output_that_is_no_call_in_the_end_streams_as_content(name, text):
    """Output whose beginning reads as a call but whose whole does not (a bad block, one cut
    by max_tokens, text after a JSON call) is all content, whole and streamed: the stream
    sent no call to take back (a red-team pass saw a call with arguments '{city: Paris}}
    </tool_call>', then the raw text as content, finish_reason tool_calls)."""
    assert whole(make_parser(name), text) == {"role": "assistant", "content": text}
    for step in (1, 3, 11, len(text)):
        assert streamed(make_parser(name), text, step) == {"content": text, "calls": []}, step


@pytest.mark.parametrize("parser", [lambda: make_parser("hermes"), RequiredParser])
def test_one_call_with_parallel_tool_calls_false(parser):
    """max_calls 1 (parallel_tool_calls false): the first call only, whole and streamed, as
    vLLM keeps it; the auto parser's later calls are dropped, not turned into content."""
    hermes = parser().__class__ is not RequiredParser
    text = (f"{HERMES_CALL}\n{HERMES_CALL.replace('Paris', 'Lyon')}" if hermes else
            '[{"name":"get_weather","parameters":{"city":"Paris"}},'
            '{"name":"get_weather","parameters":{"city":"Lyon"}}]')
    paris = '{"city": "Paris"}' if hermes else '{"city":"Paris"}'
    message = ChatOutput(None, False, parser(), max_calls=1).message(text)
    assert message["content"] is None
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [paris]
    for step in (1, 7, len(text)):
        output, deltas = ChatOutput(None, False, parser(), max_calls=1), []
        for i in range(0, len(text), step):
            deltas += output.deltas(text[i:i + step], False)
        deltas += output.deltas("", True)
        assert output.num_calls == 1 and not any(d.get("content") for d in deltas)
        assert "".join(c["function"]["arguments"] for d in deltas
                       for c in d.get("tool_calls", [])) == paris


def test_required_and_named_outputs():
    text = '[{"name":"get_weather","parameters":{"city":"Paris","days":3}},{"name":"add","parameters":{}}]'
    message = whole(RequiredParser(), text)
    assert message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", '{"city":"Paris","days":3}'), ("add", "{}")]
    for step in (1, 4, len(text)):
        assert streamed(RequiredParser(), text, step)["calls"] == \
            [{"name": "get_weather", "arguments": '{"city":"Paris","days":3}'}, {"name": "add", "arguments": "{}"}]
    cut = '[{"name":"get_weather","parameters":{"city":"Pa'  # max_tokens: the call begun, cut
    assert whole(RequiredParser(), cut)["tool_calls"][0]["function"]["arguments"] == '{"city":"Pa'
    assert whole(RequiredParser(), '[{"na') == {"role": "assistant", "content": '[{"na'}
    assert streamed(RequiredParser(), '[{"na', 2) == {"content": '[{"na', "calls": []}
    named = whole(NamedParser("add"), '{"a":1}')
    assert named["content"] is None and named["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a":1}'}
    assert streamed(NamedParser("add"), '{"a":1}', 3)["calls"] == [{"name": "add", "arguments": '{"a":1}'}]


@pytest.mark.parametrize("parser,text,prompt_open,reasoning,content", [
    ("deepseek-r1", "<think>plan it</think>The answer", False, "plan it", "The answer"),
    ("deepseek-r1", "plan it</think>The answer", False, "plan it", "The answer"),  # R1: no <think>
    ("deepseek-r1", "plan it, and never stop", False, "plan it, and never stop", None),
    ("deepseek-r1", "<think>a</think>", False, "a", None),
    ("qwen3", "<think>plan it</think>\n\nThe answer", False, "plan it", "\n\nThe answer"),
    ("qwen3", "The answer", False, None, "The answer"),  # thinking off
    ("qwen3", "a < b </think> c", False, None, "a < b </think> c"),  # nothing opened it
    ("qwen3", "plan it</think>The answer", True, "plan it", "The answer"),  # the prompt opened it
    ("qwen3", "<think>cut by max_tok", False, "cut by max_tok", None),
])
def test_reasoning_split_whole_and_streamed(parser, text, prompt_open, reasoning, content):
    assert split_reasoning(parser, text, prompt_open) == (reasoning, content)
    for step in (1, 3, len(text)):
        output = ChatOutput(parser, prompt_open, None)
        deltas = [d for i in range(0, len(text), step) for d in output.deltas(text[i:i + step], False)]
        deltas += output.deltas("", True)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
        assert "".join(d.get("content", "") for d in deltas) == (content or "")


def test_reasoning_then_tool_calls():
    text = '<think>the user wants weather</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    message = whole(make_parser("hermes"), text, reasoning="qwen3")
    assert message["reasoning_content"] == "the user wants weather"
    assert message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == WEATHER[1]
    s = streamed(make_parser("hermes"), text, 4, reasoning="qwen3")
    assert s["reasoning_content"] == "the user wants weather" and s["content"] is None
    assert s["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}]


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    # an unclosed tag in a finished message does not open the answer's reasoning
    assert not prompt_opens_reasoning("<|im_start|>user\nWhat is the <think> tag?<|im_end|>\n"
                                      "<|im_start|>assistant\n")



_MANY = ' {"name": "f", "parameters": {}}'
MANY_CALLS = [  # (parser, output of 43 calls, odd whitespace and a "," / ";" in strings)
    (RequiredParser, '[ {"name": "f", "parameters": {"x": 1}} ,\n{"name": "g", "parameters": '
                     '{"s": "a, b"}},' + (_MANY + ", ") * 40 + '{"name": "h", "parameters": {"y": [1]}}]'),
    (lambda: make_parser("mistral"), 'ok [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}} ,\n'
                                     + (_MANY + ",") * 41 + '{"name": "h", "arguments": {"s": "a, b"}}]'),
    (lambda: make_parser("llama3_json"), '{"name": "f", "parameters": {"s": "a; b"}} ;\n'
                                         + (_MANY + ";") * 41 + '{"name": "h", "parameters": {}}'),
    (lambda: make_parser("hermes"), 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call>"}}'
                                    '\n</tool_call>\n' + ("<tool_call>" + _MANY + "</tool_call> ") * 41
                                    + '<tool_call>{"name": "h", "arguments": {}}'),
]


@pytest.mark.parametrize("new_parser,text", MANY_CALLS)
def test_a_stream_reads_each_call_once(new_parser, text):
    """A stream reads its output again at every delta: the parsers read every call from the
    start each time, n calls costing n^2 (800 small calls over 8000 deltas: 17-35 s of the
    gateway's event loop per choice; tool_choice required needs no server parser, and
    logit_bias on "," makes a model emit calls until max_tokens). They resume after the calls
    read, their reading of every prefix still a fresh parser's, the stream's deltas adding up
    to the final calls."""
    from pd_serve.gateway import tool_parsers

    want = new_parser().parse(text, True)
    assert len(want.calls) == 43
    for step in (1, 3, 7):
        parser = new_parser()
        for end in range(0, len(text) + step, step):
            assert parser.parse(text[:end], False) == new_parser().parse(text[:end], False)
        assert parser.parse(text, True) == want
        out, sent = ChatOutput(None, False, new_parser()), {}
        for k in range(0, len(text), step):
            for delta in out.deltas(text[k:k + step], k + step >= len(text)):
                for call in delta.get("tool_calls", []):
                    sent.setdefault(call["index"], []).append(call["function"]["arguments"])
        assert ["".join(sent[i]) for i in range(len(sent))] == [c.arguments for c in want.calls]

    calls = []  # object_call runs over the stream: linear in the calls, not quadratic
    real = tool_parsers.object_call
    tool_parsers.object_call = lambda *a: calls.append(1) or real(*a)
    try:
        out = ChatOutput(None, False, new_parser())
        for k in range(len(text)):
            out.deltas(text[k], False)
        out.deltas("", True)
    finally:
        tool_parsers.object_call = real
    assert out.num_calls == 43 and len(calls) < 3 * len(text)
