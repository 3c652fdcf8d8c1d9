"""Structured outputs below the HTTP layer: a Grammar travels in SamplingParams (plan rows and
protocol rows), the gateway turns the OpenAI / vLLM / SGLang fields into one (bad ones are
400s), and the sampler keeps every token inside it, greedy or sampled."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pd_serve import protocol
from pd_serve.engine.grammar import GrammarCompiler, check_grammar
from pd_serve.engine.plan import sampling_from_wire, sampling_to_wire
from pd_serve.engine.sampler import Sampler
from pd_serve.engine.sampling_params import Grammar, SamplingParams
from pd_serve.gateway.openai_protocol import ApiError, ModelInfo, parse_chat, parse_completion
from pd_serve.model.config import ModelConfig
from pd_serve.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
JSON_GRAMMAR = Grammar("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def compiler(default_model_dir, tokenizer) -> GrammarCompiler:
    vocab = ModelConfig.from_dir(default_model_dir).vocab_size
    return GrammarCompiler(default_model_dir, vocab, sorted(tokenizer.eos_token_ids))


def test_grammar_travels_in_plan_rows_and_protocol_rows():
    params = SamplingParams(temperature=0.5, grammar=Grammar("regex", "[a-z]+"))
    assert sampling_from_wire(sampling_to_wire(params)) == params
    assert sampling_from_wire(sampling_to_wire(SamplingParams())).grammar is None
    msg = protocol.Generate("r", [1, 2], params)
    out = protocol.decode(protocol.encode(msg))
    assert out == msg and type(out.sampling.grammar) is Grammar
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar=Grammar("choice", "a"))
    bad = protocol.encode(protocol.Generate("r", [1], SamplingParams(grammar=Grammar("regex", "a"))))
    with pytest.raises(protocol.ProtocolError, match="grammar"):
        protocol.decode(bad.replace(b"regex", b"regey"))


class Row:
    """What the sampler reads of a request (an executor's CachedRequest)."""

    def __init__(self, params: SamplingParams, grammar):
        self.sampling_params, self.grammar, self.generator = params, grammar, None
        self.prompt_token_ids, self.output_token_ids = [1], []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("free_row", [True, False])
def test_sampled_tokens_stay_inside_the_grammar(compiler, tokenizer, temperature, free_row):
    """free_row False: every row has a grammar, so each step uses the masks the background job
    filled after the step before as they are; True: they are gathered beside a free row."""
    grammars = [JSON_GRAMMAR, Grammar("regex", r"[0-9]{2,3}-(yes|no)"),
                Grammar("ebnf", 'root ::= "<" [a-c]+ ">"'), Grammar("json_object", "")]
    rows = [Row(SamplingParams(temperature=temperature, top_p=0.95), compiler.matcher(g))
            for g in grammars]
    if free_row:
        rows.append(Row(SamplingParams(temperature=temperature), None))  # unconstrained beside them
    sampler = Sampler(seed=3)
    gen = torch.Generator().manual_seed(0)
    vocab = compiler.vocab_size
    eos = tokenizer.eos_token_ids
    done = [False] * len(rows)
    for _ in range(80):
        logits = torch.randn(len(rows), vocab, generator=gen) * 4  # [B, V]
        for i, token in enumerate(sampler(logits, rows).token_ids):
            if done[i]:
                continue
            rows[i].output_token_ids.append(token)
            done[i] = token in eos
            if rows[i].grammar is not None:
                rows[i].grammar.accept(rows[i].output_token_ids)
    texts = [tokenizer.decode([t for t in r.output_token_ids if t not in eos]) for r in rows]
    assert done[:3] == [True] * 3, texts
    value = json.loads(texts[0])
    assert set(value) == {"name", "n", "ok"} and len(value["name"]) <= 6 and 0 <= value["n"] <= 99
    assert re.fullmatch(r"[0-9]{2,3}-(yes|no)", texts[1])
    assert re.fullmatch(r"<[a-c]+>", texts[2])
    if done[3]:
        assert isinstance(json.loads(texts[3]), dict)
    else:
        assert texts[3].startswith("{")


def test_matcher_replays_tokens_sampled_elsewhere(compiler, tokenizer):
    """Decode's matcher takes token 1 (sampled by prefill) and continues where prefill was."""
    ids = tokenizer.encode('{"name": "ab", "n": 7, "ok": true}', add_special_tokens=False)
    state = compiler.matcher(JSON_GRAMMAR)
    state.accept(ids[:1])
    state.accept(ids[:1])  # the same tokens again: taken once
    state.accept(ids)
    assert state.num_accepted == len(ids) and state.matcher.is_completed()


@pytest.mark.parametrize("grammar,match", [
    (Grammar("regex", "(ab"), "parenthesis"),
    (Grammar("json_schema", "{"), "JSON"),
    (Grammar("ebnf", "root ::= "), "EBNF"),
    (Grammar("ebnf", 'root ::= root "a"'), "admits no output"),  # no finite string
    (Grammar("regex", "[^\\x00-\\U0010FFFF]"), "admits no output"),  # an empty class
])
def test_check_grammar_names_the_problem(grammar, match):
    with pytest.raises(ValueError, match=match) as e:
        check_grammar(grammar)
    assert "/project/" not in str(e.value)


@pytest.mark.parametrize("grammar", [
    Grammar("regex", ""), Grammar("regex", "é+|日本"), Grammar("ebnf", 'root ::= "a" root'),
    Grammar("json_schema", '{"type": "string", "enum": ["ü"]}'), Grammar("json_object", ""),
], ids=["empty-string", "multibyte", "endless", "schema", "object"])
def test_check_grammar_takes_what_admits_some_output(grammar):
    check_grammar(grammar)  # (the empty string; multi-byte characters; no end, yet a start)


# ---- the gateway's fields ------------------------------------------------------------------
def chat(tokenizer, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8} | fields
    return parse_chat(body, ModelInfo("m", tokenizer, 1024)).params.grammar


def completion(tokenizer, **fields):
    body = {"model": "m", "prompt": "hi", "max_tokens": 8} | fields
    return parse_completion(body, ModelInfo("m", tokenizer, 1024)).params.grammar


def test_gateway_fields_become_one_grammar(tokenizer):
    schema_json = json.dumps(SCHEMA, separators=(",", ":"))
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    assert chat(tokenizer, response_format=fmt) == Grammar("json_schema", schema_json)
    assert chat(tokenizer, response_format={"type": "json_object"}) == Grammar("json_object", "")
    assert chat(tokenizer, response_format={"type": "text"}) is None
    assert completion(tokenizer, guided_json=SCHEMA) == Grammar("json_schema", schema_json)
    assert completion(tokenizer, guided_json=json.dumps(SCHEMA)) == Grammar("json_schema", schema_json)
    assert chat(tokenizer, guided_regex="a+") == Grammar("regex", "a+")
    assert completion(tokenizer, regex="a+") == Grammar("regex", "a+")
    assert completion(tokenizer, guided_grammar='root ::= "x"') == Grammar("ebnf", 'root ::= "x"')
    assert chat(tokenizer, ebnf='root ::= "x"') == Grammar("ebnf", 'root ::= "x"')
    assert completion(tokenizer, response_format={"type": "json_object"}) == Grammar("json_object", "")
    # vLLM's structured_outputs object, as its guided_* fields
    for key, field, value in [("json", "guided_json", SCHEMA), ("regex", "guided_regex", "a+"),
                              ("choice", "guided_choice", ["yes", "no"]),
                              ("grammar", "guided_grammar", 'root ::= "x"')]:
        assert chat(tokenizer, structured_outputs={key: value}) == chat(tokenizer, **{field: value})
        assert completion(tokenizer, structured_outputs={key: value, "structural_tag": None}) == \
            completion(tokenizer, **{field: value})
    assert chat(tokenizer, structured_outputs={"json_object": True}) == Grammar("json_object", "")
    assert chat(tokenizer, structured_outputs={"json_object": False}) is None
    # vLLM's whole object, its options at their defaults (null, false): only the grammar asked
    assert chat(tokenizer, structured_outputs={"regex": "a+", "json_object": None, "json": None,
                                               "disable_fallback": False, "structural_tag": None}) \
        == Grammar("regex", "a+")
    assert chat(tokenizer, structured_outputs={}) is None


def test_a_json_schema_keeps_its_property_order(compiler, tokenizer):
    """Properties come out in the schema's order (OpenAI's rule; a "reasoning then answer"
    schema must not get its answer first), whichever field carried the schema."""
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"},
                                               "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    text = '{"reasoning": "x", "answer": 1}'
    for grammar in (chat(tokenizer, response_format=fmt), completion(tokenizer, guided_json=schema)):
        assert list(json.loads(grammar.spec)["properties"]) == ["reasoning", "answer"]
        state = compiler.matcher(grammar)
        state.accept(tokenizer.encode(text, add_special_tokens=False))
        assert state.matcher.is_completed()


@pytest.mark.parametrize("fields,param,message", [
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "object"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "JSON schema"),
    (dict(response_format={"type": "yaml"}), "response_format", "text, json_object or json_schema"),
    (dict(response_format="json"), "response_format", "json_schema"),
    (dict(guided_regex="(a"), "guided_regex", "parenthesis"),
    (dict(regex=""), "regex", "non-empty string, got an empty string"),
    (dict(guided_regex=7), "guided_regex", "non-empty string, got an integer"),
    (dict(guided_json="{not json"), "guided_json", "not valid JSON"),
    (dict(guided_json=[1]), "guided_json", "schema object"),
    (dict(ebnf="root ::= "), "ebnf", "EBNF"),
    (dict(guided_regex="a", response_format={"type": "json_object"}), "guided_regex", "give one"),
    (dict(structured_outputs=["a"]), "structured_outputs", "must be an object, got an array"),
    (dict(structured_outputs={"structural_tag": "x"}), "structured_outputs.structural_tag",
     "not supported; structured_outputs takes json, regex, choice, grammar, json_object"),
    (dict(structured_outputs={"json": "{bad"}), "structured_outputs.json", "not valid JSON"),
    (dict(structured_outputs={"choice": []}), "structured_outputs.choice", "non-empty list"),
    (dict(structured_outputs={"regex": "(a"}), "structured_outputs.regex", "parenthesis"),
    (dict(structured_outputs={"json_object": 1}), "structured_outputs.json_object", "boolean"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs.choice",
     "give one"),
    (dict(structured_outputs={"regex": "a"}, guided_regex="a"), "structured_outputs.regex",
     "give one"),
])
def test_bad_grammar_fields_are_400_naming_them(tokenizer, fields, param, message):
    with pytest.raises(ApiError, match=message) as e:
        chat(tokenizer, **fields)
    assert e.value.status == 400 and e.value.param == param


def test_bounded_strings_stay_json(compiler):
    """A string's maxLength gives no control characters and no surrogates (xgrammar 0.2.9 lets
    both through; a surrogate's three UTF-8 bytes decode to three U+FFFD, past the bound): the
    executor compiles such strings as a pattern with the same bounds."""
    for text, ok in [('{"name": "ab\x01', False), ('{"name": "ab\\"', False),
                     ('{"name": "abcdefg', False), ('{"name": "abcdef", "n": 1, "ok": true}', True),
                     (b'{"name": "a\xed\xa0\x80', False), (b'{"name": "a\xed\xbf\xbf', False),
                     ('{"name": "\u00e9\ud7ff\ue000\U0001f600\U0010ffffa", "n": 1, "ok": true}'
                      .encode(), True)]:
        state = compiler.matcher(JSON_GRAMMAR)
        assert state.matcher.accept_string(text) == ok, text


def test_bounded_strings_take_what_utf8_decodes_as_one_character(compiler):
    """Every byte, every 2-byte sequence, and every lead / second byte pair of 3- and 4-byte
    ones (where overlong forms, surrogates and values past U+10FFFF live), as a bounded
    string's one character: taken exactly when Python's decoder reads it as one character
    that JSON writes unescaped."""
    sequences = [bytes([c]) for c in range(0x20, 0x100)]
    sequences += [bytes([a, b]) for a in range(0xC0, 0x100) for b in range(0x80, 0xC0)]
    sequences += [bytes([a, b, 0x80]) for a in range(0xE0, 0xF0) for b in range(0x80, 0xC0)]
    sequences += [bytes([a, b, 0x80, 0x80]) for a in range(0xF0, 0xF8) for b in range(0x80, 0xC0)]
    wrong = []
    for seq in sequences:
        try:
            ok = len(seq.decode("utf-8")) == 1 and seq not in (b'"', b"\\")
        except UnicodeDecodeError:
            ok = False
        state = compiler.matcher(JSON_GRAMMAR)
        if state.matcher.accept_string(b'{"name": "' + seq + b'"') != ok:
            wrong.append(seq)
    assert not wrong, f"{len(wrong)} wrong, e.g. {wrong[:8]}"


def test_guided_choice_literals_admit_exactly_their_strings():
    """guided_choice's EBNF: each string, control characters before hex digits, quotes and
    backslashes included, is admitted as it is, and nothing else is."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from pd_serve.gateway.openai_protocol import _choice_ebnf

    choices = ["Yes\tA", "No\tB", "a\rD", "line\nFeed", "bell\x07C", 'say "hi"', "back\\slash",
               "é ü 世界", "\x1f0"]
    grammar = xgr.Grammar.from_ebnf(_choice_ebnf(choices))
    assert all(accepts(grammar, c) for c in choices)
    assert not any(accepts(grammar, c) for c in ["Yes", "Yes\x9a", "a\xdb", "say hi", "back\\\\slash"])


def test_grammars_past_the_size_bound_are_refused_before_compiling():
    """A grammar's text past MAX_GRAMMAR_CHARS is a clear ValueError (the gateway's 400), on
    the gateway's check and a worker's parse alike, whatever its kind."""
    from pd_serve.engine import grammar as grammar_module

    limit = grammar_module.MAX_GRAMMAR_CHARS
    enum = json.dumps({"enum": [f"v{i:07d}" for i in range(limit // 11 + 1)]})
    for big in (Grammar("json_schema", enum), Grammar("regex", "a" * (limit + 1)),
                Grammar("ebnf", 'root ::= "' + "a" * limit + '"')):
        for check in (check_grammar, grammar_module.parse_grammar):
            with pytest.raises(ValueError, match=f"at most {limit}"):
                check(big)
    check_grammar(Grammar("regex", "a" * limit))  # at the bound: compiled


def test_the_compiled_grammar_cache_is_bounded_by_bytes(tokenizer, default_model_dir, monkeypatch):
    """The compiler keeps the newest grammars within a byte bound as well as a count: each
    past it pushes out the oldest (the newest always stays)."""
    from pd_serve.engine import grammar as grammar_module

    compiler = GrammarCompiler(default_model_dir, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))
    grammars = [Grammar("regex", f"(ab|cd){{{n}}}x") for n in (3, 4, 5)]
    one = compiler._compile(grammars[0]).memory_size_bytes
    monkeypatch.setattr(grammar_module, "MAX_CACHED_GRAMMAR_BYTES", int(2.5 * one))
    for g in grammars:
        compiler.matcher(g)
    assert list(compiler._compiled) == grammars[-2:]
    assert compiler._bytes == sum(c.memory_size_bytes for c in compiler._compiled.values())
