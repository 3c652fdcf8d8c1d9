"""JSON-schema keywords the grammar engine does not enforce: each one's grammar admits an instance
the schema refuses (shown here against xgrammar itself, so a version that starts enforcing one
fails this test), `unenforced_keyword` names it, and a schema the output must follow (strict
response_format, guided_json, a strict tool) that uses one is a 400 naming it."""

from __future__ import annotations

import json

import pytest

from pd_serve.engine.grammar import _byte_compiler, _compile_with, unenforced_keyword
from pd_serve.engine.sampling_params import Grammar
from pd_serve.gateway.openai_protocol import ApiError, ModelInfo, parse_chat, parse_completion
from pd_serve.model.tokenizer import Tokenizer

AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
# keyword -> (schema, an instance it refuses that its grammar admits)
UNENFORCED = {
    "not": ({"type": "integer", "not": {"const": 3}}, 3),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 3),
    "if": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 10}, "else": {"maximum": 2}}, 4),
    "dependentRequired": ({"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": ({"type": "object", "properties": AB,
                          "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "dependencies": ({"type": "object", "properties": AB, "dependencies": {"a": ["b"]}}, {"a": 1}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1]),
    "$ref": ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 3}, 1),
    "anyOf": ({"type": "integer", "minimum": 0, "anyOf": [{"maximum": 10}, {"minimum": 20}]}, -1),
    "required": ({"type": "object", "required": ["a"]}, {}),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": {"type": "integer"}},
                               "additionalProperties": True, "unevaluatedProperties": False},
                              {"a": 1, "z": 2}),
}
# schemas whose every keyword is enforced (keyword names as property names and as data too)
ENFORCED = [
    {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": [{"not": 1}]}}},
    {"$defs": {"P": {"type": "object", "properties": {"a": {"type": "integer"}}}},
     "type": "object", "properties": {"p": {"allOf": [{"$ref": "#/$defs/P"}], "description": "x"}}},
    {"anyOf": [{"type": "integer"}, {"type": "array", "prefixItems": [{"const": "contains"}]}]},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "default": {"not": 1}},
    {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "integer"}}, "title": "t"},
    {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "optional"},
]


def test_a_ref_to_another_document_is_named():
    assert unenforced_keyword({"$ref": "http://example.com/s.json"}) == \
        "'$ref' at $ (to another document)"


def admits(schema: dict, value) -> bool:
    """Whether the schema's grammar takes json.dumps(value) (xgrammar's separators) and the end."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(_compile_with(_byte_compiler(), Grammar("json_schema", json.dumps(schema))))
    return all(matcher.accept_token(b) for b in json.dumps(value).encode()) and matcher.accept_token(256)


@pytest.mark.parametrize("keyword", UNENFORCED)
def test_the_grammar_admits_what_the_keyword_refuses_and_it_is_named(keyword):
    schema, refused = UNENFORCED[keyword]
    assert admits(schema, refused), f"xgrammar now enforces {keyword!r}: take it off the list"
    assert unenforced_keyword(schema).startswith(repr(keyword))
    nested = {"type": "object", "properties": {"x": {"type": "array", "items": schema}}}
    assert unenforced_keyword(nested).startswith(f"{keyword!r} at $.properties.x.items")


@pytest.mark.parametrize("schema", ENFORCED)
def test_enforced_schemas_pass(schema):
    assert unenforced_keyword(schema) is None


@pytest.fixture(scope="module")
def model(default_model_dir) -> ModelInfo:
    return ModelInfo("m", Tokenizer.from_dir(default_model_dir), 1024)


def chat_body(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8} | fields


def test_a_schema_the_output_must_follow_with_such_a_keyword_is_a_400(model):
    schema = UNENFORCED["not"][0]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    with pytest.raises(ApiError, match="'not' at \\$ is not enforced") as e:
        parse_chat(chat_body(response_format=fmt), model)
    assert e.value.status == 400 and e.value.param == "response_format.json_schema.schema"
    with pytest.raises(ApiError, match="'not' at \\$") as e:
        parse_completion({"model": "m", "prompt": "hi", "guided_json": schema}, model)
    assert e.value.param == "guided_json"
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"n": schema}}}}
    with pytest.raises(ApiError, match="'not' at \\$.properties.n") as e:
        parse_chat(chat_body(tools=[tool], tool_choice="required"), model)
    assert e.value.status == 400 and e.value.param == "tools[0].function.parameters"
    for strict in (1, "true"):  # strict is a boolean or absent
        fmt["json_schema"]["strict"], tool["function"]["strict"] = strict, strict
        with pytest.raises(ApiError, match="strict must be a boolean") as e:
            parse_chat(chat_body(response_format=fmt), model)
        assert e.value.param == "response_format.json_schema.strict"
        with pytest.raises(ApiError, match="strict must be a boolean") as e:
            parse_chat(chat_body(tools=[tool], tool_choice="required"), model)
        assert e.value.param == "tools[0].function.strict"
    # not strict: the output follows the schema where the grammar can
    fmt["json_schema"]["strict"] = False
    assert parse_chat(chat_body(response_format=fmt), model).params.grammar.kind == "json_schema"
    tool["function"]["strict"] = False
    parse_chat(chat_body(tools=[tool], tool_choice="required"), model)
