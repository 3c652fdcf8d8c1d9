"""vLLM's /tokenize and /detokenize (request and reply shapes, round trip, 400s), completions'
echo (with logprobs too) and the chat template's fields (add_generation_prompt,
continue_final_message, chat_template_kwargs), over the HTTP layer with a scripted token source
(no processes)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_http_hardening import (MODEL, ScriptedSource, TimedTokenizer, assert_error, call,  # noqa: F401
                                 done, post)
from test_http_hardening import token, tokenizer  # noqa: F401 (fixtures)

from pd_serve.gateway.app import build_app
from pd_serve.gateway.source import TokenEvent
from pd_serve.model.tokenizer import Tokenizer


def test_tokenize_detokenize_round_trip(tokenizer):
    text = "Hello world, 1234 héllo!"
    status, _, out = post(tokenizer, [], {"model": MODEL, "prompt": text}, "/tokenize")
    assert status == 200, out
    assert out == {"count": len(tokenizer.encode(text)), "max_model_len": 1024,
                   "tokens": tokenizer.encode(text), "token_strs": None}
    status, _, back = post(tokenizer, [], {"model": MODEL, "tokens": out["tokens"]}, "/detokenize")
    assert status == 200 and back == {"prompt": tokenizer.decode(out["tokens"], skip_special_tokens=False)}
    plain = post(tokenizer, [], {"prompt": text, "add_special_tokens": False}, "/tokenize")[2]
    back = post(tokenizer, [], {"tokens": plain["tokens"]}, "/detokenize")[2]
    assert back["prompt"] == text
    strs = post(tokenizer, [], {"prompt": text, "return_token_strs": True}, "/tokenize")[2]["token_strs"]
    assert "".join(strs[-len(plain["tokens"]):]) == text


def test_tokenize_chat_messages_as_the_chat_route_renders_them(tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    status, _, out = post(tokenizer, [], {"model": MODEL, "messages": messages}, "/tokenize")
    assert status == 200, out
    want = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert out["tokens"] == want and out["count"] == len(want)


# Qwen3's switch, as its template reads it
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "Name a colour."}]
STARTED = QUESTION + [{"role": "assistant", "content": "The colour is "}]


@pytest.fixture(scope="module")
def thinking(default_model_dir, tmp_path_factory):
    """A tokenizer whose chat template reads enable_thinking, and transformers' on its folder."""
    folder = tmp_path_factory.mktemp("thinking")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(folder)
    return Tokenizer.from_dir(folder), hf


def chat_prompt(tokenizer, body: dict) -> list[int]:
    """The prompt ids the chat route hands the token source for `body`."""
    source = ScriptedSource(done(tokenizer.encode(" hi", add_special_tokens=False)[0]))

    async def go():
        async with TestClient(TestServer(build_app(source, tokenizer))) as client:
            resp = await client.post("/v1/chat/completions", json={"model": MODEL} | body)
            assert resp.status == 200, await resp.text()
    asyncio.run(go())
    return source.specs[0].prompt_token_ids


@pytest.mark.parametrize("fields,messages,hf_kwargs", [
    ({}, QUESTION, {"add_generation_prompt": True}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, QUESTION,
     {"add_generation_prompt": True, "enable_thinking": False}),
    ({"add_generation_prompt": False}, QUESTION, {"add_generation_prompt": False}),
    ({"continue_final_message": True}, STARTED, {"continue_final_message": True}),
    ({"continue_final_message": True, "add_generation_prompt": False}, STARTED,
     {"continue_final_message": True}),
], ids=["default", "enable_thinking", "no_generation_prompt", "continue", "continue_explicit"])
def test_chat_template_fields_render_as_transformers_does(thinking, fields, messages, hf_kwargs):
    """vLLM's fields, on the chat route and /tokenize alike, equal to transformers' rendering."""
    tokenizer, hf = thinking
    want = tokenizer.encode(hf.apply_chat_template(messages, tokenize=False, **hf_kwargs),
                            add_special_tokens=False)
    status, _, out = post(tokenizer, [], {"messages": messages} | fields, "/tokenize")
    assert status == 200 and out["tokens"] == want, out
    assert chat_prompt(tokenizer, {"messages": messages} | fields) == want
    if "enable_thinking" in hf_kwargs:
        assert tokenizer.decode(want, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    if "continue_final_message" in hf_kwargs:
        assert tokenizer.decode(want, skip_special_tokens=False).endswith("The colour is ")


# gpt-oss's template reads reasoning_effort and names the developer role; this one likewise
EFFORT_TEMPLATE = (
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'developer' %}# Instructions\n{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEVELOPER = [{"role": "developer", "content": "Be terse."}] + QUESTION


def test_reasoning_effort_reaches_the_template_and_developer_is_system_unless_named(
        thinking, default_model_dir, tmp_path):
    """OpenAI's reasoning_effort reaches the template (transformers' rendering with it); the
    developer role is the system role where the template does not name it (a template that
    does not know it may drop the message or add its default system prompt beside it)."""
    folder = tmp_path / "effort"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(EFFORT_TEMPLATE)
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(folder)
    effort = Tokenizer.from_dir(folder)
    for tokenizer, hf_tokenizer, effort_level, roles in [
            (effort, hf, "high", DEVELOPER), (thinking[0], thinking[1], None, None)]:
        fields = {"reasoning_effort": effort_level} if effort_level else {}
        as_system = [{"role": "system", "content": "Be terse."}] + QUESTION
        want = tokenizer.encode(hf_tokenizer.apply_chat_template(
            roles or as_system, tokenize=False, add_generation_prompt=True, **fields),
            add_special_tokens=False)
        status, _, out = post(tokenizer, [], {"messages": DEVELOPER} | fields, "/tokenize")
        assert status == 200 and out["tokens"] == want, out
        assert chat_prompt(tokenizer, {"messages": DEVELOPER} | fields) == want
        text = tokenizer.decode(want, skip_special_tokens=False)
        assert text.startswith("Reasoning: high\n# Instructions\n<|im_start|>developer\n"
                               if effort_level else "<|im_start|>system\nBe terse."), text


@pytest.mark.parametrize("fields,messages,param,message", [
    ({"reasoning_effort": "max"}, QUESTION, "reasoning_effort", "must be one of none, minimal"),
    ({"reasoning_effort": 1}, QUESTION, "reasoning_effort", "a string"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, QUESTION,
     "chat_template_kwargs", "'reasoning_effort'"),
    ({"continue_final_message": True, "add_generation_prompt": True}, STARTED,
     "continue_final_message", "cannot both be true"),
    ({"continue_final_message": True}, QUESTION + [{"role": "assistant", "content": " "}],
     "continue_final_message", "no text to continue"),
    ({"chat_template_kwargs": {"messages": []}}, QUESTION, "chat_template_kwargs", "'messages'"),
    ({"chat_template_kwargs": {"eos_token": "x"}}, QUESTION, "chat_template_kwargs", "'eos_token'"),
    ({"chat_template_kwargs": ["enable_thinking"]}, QUESTION, "chat_template_kwargs", "an object"),
    ({"add_generation_prompt": "yes"}, QUESTION, "add_generation_prompt", "a boolean"),
])
def test_bad_chat_template_fields_are_400(tokenizer, fields, messages, param, message):
    for path in ("/v1/chat/completions", "/tokenize"):
        status, _, out = post(tokenizer, [], {"model": MODEL, "messages": messages} | fields, path)
        assert_error(status, out, 400, param, message)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_tokenize_bodies_are_400(tokenizer, path, body, param):
    status, _, out = post(tokenizer, [], body, path)
    assert status == 400 and out["error"]["param"] == param, out


def test_detokenize_takes_at_most_the_context(tokenizer, token):
    """/detokenize of a 32 MiB body (5.6M ids of an 81-character token) held the GIL in the
    tokenizer's decode for 10 s, stalling /health and every stream, and grew the gateway by
    2.4 GB: more ids than the context (1,024 here) are a 400, undecoded."""
    status, _, out = post(tokenizer, [], {"tokens": [token] * 1024}, "/detokenize")
    assert status == 200 and out["prompt"] == tokenizer.decode([token]) * 1024, out
    status, _, out = post(tokenizer, [], {"tokens": [token] * 1025}, "/detokenize")
    assert status == 400 and out["error"]["param"] == "tokens", out
    assert "1025 tokens" in out["error"]["message"]


def test_tokenize_counts_at_most_four_contexts_judged_by_the_head_first(tokenizer):
    """Past 4 x the context's tokens (4,096 here) /tokenize answers a 400; a text whose first
    4,096 characters already pass it (rare characters, several tokens each) is refused from
    those alone, the rest untokenized."""
    rare = "\U00013000\U00013050\U00013080\U0001f701"
    timed = TimedTokenizer(tokenizer)
    status, _, out = call(timed, [], "POST", "/tokenize", {"prompt": rare * 4000, "return_token_strs": True})
    assert status == 400 and out["error"]["param"] == "prompt", out
    assert "the first 4096 characters" in out["error"]["message"] and "at most 4096" in out["error"]["message"]
    assert [chars for _, _, chars in timed.encodes] == [4096]
    status, _, out = call(tokenizer, [], "POST", "/tokenize", {"prompt": "hello " * 5000})
    assert status == 400 and "at most 4096" in out["error"]["message"], out
    status, _, out = call(tokenizer, [], "POST", "/tokenize", {"prompt": "hello " * 4000})
    assert status == 200 and 1024 < out["count"] <= 4096, out


def test_tokenize_counts_past_the_context_but_not_past_what_it_could_hold(tokenizer):
    """/tokenize counts a text longer than the context (1,024 tokens here), but refuses one of
    more characters than 1,024 tokens could stand for, untokenized: 16 MiB bodies of it, eight
    at once, held every parse thread of the gateway for ~50 s and grew it by GiBs."""
    limit = 1024 * tokenizer.max_token_chars
    status, _, out = call(tokenizer, [], "POST", "/tokenize", {"prompt": "hello " * 2000})
    assert status == 200 and out["count"] == len(tokenizer.encode("hello " * 2000)) > 1024
    for body in ({"prompt": " " * (limit + 1)},
                 {"messages": [{"role": "user", "content": " " * limit}]}):
        timed = TimedTokenizer(tokenizer)
        status, _, out = call(timed, [], "POST", "/tokenize", body)
        assert status == 400, out
        assert "more than 1024 tokens" in out["error"]["message"]
        assert out["error"]["param"] == ("prompt" if "prompt" in body else "messages")
        assert timed.encodes == []


def test_tokenize_names_a_wrong_model(tokenizer):
    status, _, out = post(tokenizer, [], {"model": "other", "prompt": "a"}, "/tokenize")
    assert status == 404 and out["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_in_front(tokenizer, token, stream):
    script = [TokenEvent([token]), TokenEvent([token], finished=True, finish_reason="length")]
    word = tokenizer.decode([token])
    body = {"model": MODEL, "prompt": ["Say hi:", tokenizer.encode("Ids here")], "max_tokens": 2,
            "echo": True, "n": 2, "stream": stream}
    status, _, out = post(tokenizer, script, body)
    assert status == 200, out
    if stream:
        texts = ["", "", "", ""]
        for line in out.split("\n"):
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    else:
        texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert texts == ["Say hi:" + word * 2] * 2 + ["Ids here" + word * 2] * 2


def test_echo_of_token_ids_keeps_their_special_tokens(tokenizer, token):
    """A prompt given as ids echoes as all their text, as its text form does: "<|im_start|>hello"
    and its ids [1, 28120] are one prompt and echo the same."""
    text = "<|im_start|>hello"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) != text  # (a decode that skips special tokens loses one)
    echoes = []
    for prompt in (text, ids):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "echo": True}
        status, _, out = post(tokenizer, done(token), body)
        assert status == 200, out
        echoes.append(out["choices"][0]["text"])
    assert echoes == [text + tokenizer.decode([token])] * 2


def _scored_prompt(tokenizer, text: str):
    """A prompt's ids and made-up logprobs for all but its first token (top 1: token id 7)."""
    from pd_serve.protocol import Logprob

    ids = tokenizer.encode(text)
    return ids, [Logprob(t, -0.5 - i, [(7, -0.25)]) for i, t in enumerate(ids[1:])]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_puts_the_prompts_logprobs_first(tokenizer, token, stream):
    """OpenAI's legacy echo with logprobs (lm-eval's loglikelihood request): the prompt's tokens
    lead the logprobs, the first with null entries; the request asks the source for them."""
    from pd_serve.protocol import Logprob

    ids, scored = _scored_prompt(tokenizer, "Say hi to me:")
    script = [TokenEvent([token], [Logprob(token, -1.0, [(token, -1.0)])], finished=True,
                         finish_reason="length", prompt_logprobs=scored)]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1,
            "stream": stream}
    status, _, out = post(tokenizer, script, body)
    assert status == 200, out
    if stream:
        events = [json.loads(e[6:]) for e in out.split("\n\n") if e.startswith("data: {")]
        (lp,) = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
        text = "".join(e["choices"][0]["text"] for e in events)
    else:
        lp, text = out["choices"][0]["logprobs"], out["choices"][0]["text"]
    words = [tokenizer.decode([t], skip_special_tokens=False) for t in ids + [token]]
    assert text == "".join(words)
    assert lp["tokens"] == words
    assert lp["token_logprobs"] == [None] + [e.logprob for e in scored] + [-1.0]
    seven = tokenizer.decode([7], skip_special_tokens=False)
    assert lp["top_logprobs"] == [None] + [{seven: -0.25, w: e.logprob} for w, e in zip(words[1:], scored)] \
        + [{words[-1]: -1.0}]
    assert lp["text_offset"] == [sum(map(len, words[:i])) for i in range(len(words))]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_is_the_prompt_alone(tokenizer, token, stream):
    """OpenAI's prompt scoring (echo, max_tokens 0; vLLM serves it too): the source computes
    the prompt (one token asked, dropped), the reply is the prompt and its logprobs, no
    completion tokens, finish_reason length. Without echo, max_tokens 0 stays a 400."""
    from pd_serve.protocol import Logprob

    ids, scored = _scored_prompt(tokenizer, "Say hi to me:")
    script = [TokenEvent([token], [Logprob(token, -1.0, [(token, -1.0)])], finished=True,
                         finish_reason="length", prompt_logprobs=scored)]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    source = ScriptedSource(script)

    async def go():
        async with TestClient(TestServer(build_app(source, tokenizer))) as client:
            resp = await client.post("/v1/completions", json=body)
            text = await resp.text()
            return resp.status, json.loads(text) if not stream else text
    status, out = asyncio.run(go())
    assert status == 200, out
    assert source.specs[0].params.max_tokens == 1 and source.specs[0].params.prompt_logprobs == 1
    if stream:
        events = [json.loads(e[6:]) for e in out.split("\n\n") if e.startswith("data: {")]
        (lp,) = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        (finish,) = [e["choices"][0]["finish_reason"] for e in events
                     if e["choices"] and e["choices"][0]["finish_reason"]]
        usage = events[-1]["usage"]
    else:
        (choice,) = out["choices"]
        lp, text, finish, usage = choice["logprobs"], choice["text"], choice["finish_reason"], out["usage"]
    words = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert text == "".join(words) and finish == "length"
    assert lp["tokens"] == words and lp["token_logprobs"] == [None] + [e.logprob for e in scored]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)
    status, _, out = post(tokenizer, script, {"model": MODEL, "prompt": ids, "max_tokens": 0})
    assert_error(status, out, 400, "max_tokens", ">= 1")
    from pd_serve.gateway.openai_protocol import ApiError, ModelInfo, parse_completion
    full = ModelInfo(MODEL, tokenizer, len(ids))  # a prompt as long as the context: scored
    assert parse_completion({"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True}, full).echo_only
    with pytest.raises(ApiError, match="maximum context length"):
        parse_completion({"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True}, full)
    status, _, out = post(tokenizer, script, body | {"min_tokens": 1})
    assert_error(status, out, 400, "min_tokens", "max_tokens 0")


def test_echo_offsets_of_tokens_that_split_a_character_stay_in_the_text(tokenizer, token):
    """A prompt whose tokens end inside a character (an emoji's bytes over several tokens):
    each offset is where its token's text starts in the echoed text, never past it and never
    going back (a red-team pass got [0, 1, 2, 1] for the 1-character prompt "😀")."""
    from pd_serve.protocol import Logprob

    text = "😀 ok 世界"
    ids, scored = _scored_prompt(tokenizer, text)
    assert len(ids) > len(tokenizer.encode("x ok xx"))  # the characters span several tokens
    script = [TokenEvent([token], [Logprob(token, -1.0, [])], finished=True,
                         finish_reason="length", prompt_logprobs=scored)]
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, "echo": True, "logprobs": 0}
    status, _, out = post(tokenizer, script, body)
    assert status == 200, out
    offsets, reply = out["choices"][0]["logprobs"]["text_offset"], out["choices"][0]["text"]
    assert reply == text + tokenizer.decode([token])
    assert offsets == sorted(offsets) and offsets[-1] == len(text) and offsets[0] == 0
    # each token starts after the whole characters of the tokens before it
    assert offsets[:-1] == [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert len(set(offsets)) < len(offsets)  # (tokens inside one character share its offset)


def test_echo_with_logprobs_asks_the_source_for_the_prompts(tokenizer, token):
    ids, scored = _scored_prompt(tokenizer, "Count: one two")
    source = ScriptedSource([TokenEvent([token], finished=True, finish_reason="length",
                                        prompt_logprobs=scored)])

    async def go():
        async with TestClient(TestServer(build_app(source, tokenizer))) as client:
            for echo in (True, False):
                resp = await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": ids, "max_tokens": 1, "logprobs": 3, "echo": echo})
                assert resp.status == 200, await resp.text()
            for stream in (False, True):  # n=2: a whole reply's prompt scored once; a stream's
                resp = await client.post("/v1/completions", json={  # choices each show theirs
                    "model": MODEL, "prompt": ids, "max_tokens": 1, "logprobs": 3, "echo": True,
                    "n": 2, "stream": stream})
                assert resp.status == 200, await resp.text()
                if not stream:
                    a, b = (c["logprobs"] for c in (await resp.json())["choices"])
                    assert a == b and len(a["tokens"]) == len(ids)  # (the prompt's: no output logprobs)
                await resp.read()
    asyncio.run(go())
    assert [s.params.prompt_logprobs for s in source.specs] == [3, None, 3, None, 3, 3]


def _ranked_prompt(tokenizer, text: str):
    """A prompt's ids and worker rows with ranks and two alternatives: token 7 (rank 1) and
    the prompt token itself (rank 2) on even positions, token 9 on odd ones (the token rank 5)."""
    from pd_serve.protocol import Logprob

    ids = tokenizer.encode(text)
    rows = [Logprob(t, -1.5, [(7, -0.25), (t, -1.5)] if i % 2 == 0 else [(7, -0.25), (9, -0.5)],
                    2 if i % 2 == 0 else 5) for i, t in enumerate(ids[1:])]
    return ids, rows


def _vllm_entry(tokenizer, rows, num_top: int) -> list:
    word = lambda t: tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    out = [None]
    for row in rows:
        entry = {str(row.token_id): {"logprob": row.logprob, "rank": row.rank, "decoded_token": word(row.token_id)}}
        for rank, (t, lp) in enumerate(row.top[:num_top], 1):
            entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": word(t)})
        out.append(entry)
    return out


def test_vllm_prompt_logprobs_on_completions_and_chat(tokenizer, token):
    """vLLM's prompt_logprobs N: completions carry them on each choice, chat on the response:
    null first, then {id: {logprob, rank, decoded_token}}, the token first and its top N, each
    once; the legacy logprobs stay the output's (no echo); the source is asked for N."""
    from pd_serve.protocol import Logprob

    messages = [{"role": "user", "content": "hi"}]
    chat_text = tokenizer.apply_chat_template(messages)
    requests = [("/v1/completions", "Count: one two three", {"n": 2, "logprobs": 0}, 2),
                ("/v1/completions", "Count: one two three", {"echo": True, "logprobs": 2}, 1),
                ("/v1/chat/completions", chat_text, {"messages": messages}, 2)]
    outs, specs = [], []

    async def go():
        for path, text, body, num_top in requests:
            ids, rows = _ranked_prompt(tokenizer, text)
            source = ScriptedSource([TokenEvent([token], [Logprob(token, -1.0, [])], finished=True,
                                                finish_reason="length", prompt_logprobs=rows)])
            async with TestClient(TestServer(build_app(source, tokenizer))) as client:
                prompt = {} if "chat" in path else {"prompt": ids}
                resp = await client.post(path, json={"model": MODEL, "max_tokens": 1,
                                                     "prompt_logprobs": num_top} | prompt | body)
                assert resp.status == 200, await resp.text()
                outs.append((await resp.json(), rows))
            specs.extend(source.specs)
    asyncio.run(go())
    (plain, rows), (echoed, _), (chat, chat_rows) = outs
    assert [c["prompt_logprobs"] for c in plain["choices"]] == [_vllm_entry(tokenizer, rows, 2)] * 2
    assert plain["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([token])]  # output only
    assert echoed["choices"][0]["prompt_logprobs"] == _vllm_entry(tokenizer, rows, 1)
    assert len(echoed["choices"][0]["logprobs"]["tokens"]) == len(rows) + 2  # echo: the prompt's too
    assert max(len(t) for t in echoed["choices"][0]["logprobs"]["top_logprobs"][1:]) <= 3
    assert chat["prompt_logprobs"] == _vllm_entry(tokenizer, chat_rows, 2)
    assert "prompt_logprobs" not in chat["choices"][0]
    # a whole reply's prompt is scored once, by its first choice; its n choices all show it
    assert [s.params.prompt_logprobs for s in specs] == [2, None, 2, 2]


@pytest.mark.parametrize("path,body,message", [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "must be in [0, 20]"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "must be in [0, 20]"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "stream=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1,
                              "stream": True}, "stream=true"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, "an integer"),
])
def test_bad_prompt_logprobs_are_400(tokenizer, path, body, message):
    status, _, out = post(tokenizer, [], {"model": MODEL} | body, path)
    assert_error(status, out, 400, "prompt_logprobs", message)


def test_echo_with_logprobs_fails_on_a_source_without_them(tokenizer, token):
    ids, scored = _scored_prompt(tokenizer, "Count: one two")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0}
    for prompt_logprobs in (None, scored[1:], [scored[1]] + scored[1:]):
        script = [TokenEvent([token], finished=True, finish_reason="length", prompt_logprobs=prompt_logprobs)]
        status, _, out = post(tokenizer, script, body)
        assert status == 500 and "prompt logprobs do not match" in out["error"]["message"], out


def test_echo_with_logprobs_past_the_entry_limit_is_400(tokenizer, token):
    from pd_serve.gateway.openai_protocol import MAX_PROMPT_LOGPROB_ENTRIES
    from pd_serve.protocol import Logprob

    ids = [token] * 600
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 20}
    n = MAX_PROMPT_LOGPROB_ENTRIES // (600 * 21)
    script = [TokenEvent([token], finished=True, finish_reason="length",
                         prompt_logprobs=[Logprob(token, -1.0, [])] * 599)]
    status, _, out = post(tokenizer, script, body | {"n": n}, max_model_len=4096)
    assert status == 200, out
    status, _, out = post(tokenizer, script, body | {"n": n + 1}, max_model_len=4096)
    assert status == 400 and out["error"]["param"] == "logprobs", out


def test_chat_logprob_bytes_join_to_the_content(tokenizer):
    """A character spread over tokens: each token's `bytes` are its own (not those of the
    U+FFFD its text shows), so the entries' bytes join to the content, as OpenAI's do."""
    from pd_serve.protocol import Logprob

    text = "héllo 世界 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    logprobs = [Logprob(i, -0.1, [(i, -0.1)]) for i in ids]
    script = [TokenEvent(ids, logprobs, finished=True, finish_reason="length")]
    status, _, out = post(tokenizer, script, {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": len(ids),
        "logprobs": True, "top_logprobs": 1}, "/v1/chat/completions")
    assert status == 200, out
    content = out["choices"][0]["logprobs"]["content"]
    assert out["choices"][0]["message"]["content"] == text
    assert any(e["token"] == "\ufffd" for e in content)  # the case this is about
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode("utf-8")
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_hold_the_sampled_token(tokenizer, stream):
    """OpenAI's legacy logprobs: top_logprobs has the N best tokens and the sampled one, which
    may lie outside them (up to N + 1 entries); with logprobs=0 the sampled one alone."""
    from pd_serve.protocol import Logprob

    a, b, c, d = (tokenizer.encode(w, add_special_tokens=False)[0]
                  for w in (" apple", " banana", " cherry", " date"))
    logprobs = [Logprob(a, -3.0, [(c, -0.5), (d, -1.0)]), Logprob(b, -0.2, [(b, -0.2), (c, -2.0)])]
    script = [TokenEvent([a, b], logprobs, finished=True, finish_reason="length")]

    def tops(num: int) -> list[dict]:
        status, _, out = post(tokenizer, script, {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                  "logprobs": num, "stream": stream})
        assert status == 200, out
        if stream:  # every chunk's entries, in order
            events = [json.loads(e[6:]) for e in out.split("\n\n") if e.startswith("data: {")]
            return [t for event in events if (lp := event["choices"][0]["logprobs"])
                    for t in lp["top_logprobs"]]
        return out["choices"][0]["logprobs"]["top_logprobs"]

    word = {t: tokenizer.decode([t]) for t in (a, b, c, d)}
    assert tops(2) == [{word[c]: -0.5, word[d]: -1.0, word[a]: -3.0},
                       {word[b]: -0.2, word[c]: -2.0}]
    assert tops(0) == [{word[a]: -3.0}, {word[b]: -0.2}]


@pytest.mark.parametrize("path,stream", [("/v1/completions", False), ("/v1/completions", True),
                                         ("/v1/chat/completions", False)])
def test_large_logprobs_are_rendered_off_the_event_loop(tokenizer, token, monkeypatch, path, stream):
    """A whole reply's logprobs (n x max_tokens x top 20: hundreds of MB of JSON, seconds of
    CPU per long chat choice) and a stream's echoed prompt logprobs (up to
    MAX_PROMPT_LOGPROB_ENTRIES) are built in a worker thread: on the event loop they stalled
    every stream and /health for as long. The reply is unchanged."""
    from pd_serve.gateway import openai_api
    from pd_serve.protocol import Logprob

    on_loop = []  # per logprobs build of a whole choice or of a prompt: was it on the loop?

    def watched(build):
        def logprobs(self, entries, offsets, num_top, prompt=None):
            if prompt is not None or not stream:
                try:
                    asyncio.get_running_loop()
                    on_loop.append(True)
                except RuntimeError:
                    on_loop.append(False)
            return build(self, entries, offsets, num_top, prompt)
        return logprobs

    for shape in (openai_api._CompletionShape, openai_api._ChatShape):
        monkeypatch.setattr(shape, "logprobs", watched(shape.logprobs))
    ids, scored = _scored_prompt(tokenizer, "Say hi to me:")
    chat = path == "/v1/chat/completions"
    script = [TokenEvent([token], [Logprob(token, -1.0, [(token, -1.0)])],
                         prompt_logprobs=None if chat else scored),
              TokenEvent([token], [Logprob(token, -1.0, [(token, -1.0)])], finished=True,
                         finish_reason="length")]
    body = ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
            if chat else {"prompt": ids, "echo": True, "logprobs": 1})
    status, headers, out = post(tokenizer, script, body | {"model": MODEL, "max_tokens": 2, "n": 3,
                                                           "stream": stream}, path)
    assert status == 200, out
    assert on_loop and not any(on_loop), on_loop
    if stream:
        return
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    word = tokenizer.decode([token])
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 6
    for c in out["choices"]:
        if chat:
            assert c["message"]["content"] == word * 2 and len(c["logprobs"]["content"]) == 2
        else:
            assert c["text"].endswith(word * 2) and len(c["logprobs"]["tokens"]) == len(ids) + 2
