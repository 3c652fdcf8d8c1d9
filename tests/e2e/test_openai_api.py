"""The OpenAI HTTP API end to end: a real aiohttp server over the colocated engine, the official
`openai` client for good requests, raw HTTP for bad ones and for clients that hang up.

Two servers share one engine: `plain` is aiohttp's default (handlers run on after a disconnect,
so a stream's failed write or the non-stream client check must abort), `cancel` comes from
`start_server` (handlers are cancelled on disconnect). A third, `scripted` (aiohttp's default
too), serves a fake source that never ends on its own and fails on cue: it shows the HTTP layer closes the source
itself and reports source errors.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from helpers import TEST_DEVICE, pages_settled
from pd_serve import AsyncEngine, Engine, SamplingParams
from pd_serve.gateway.app import build_app, start_server
from pd_serve.gateway.openai_protocol import ModelInfo, parse_chat
from pd_serve.gateway.source import EngineSource, GenerateSpec, TokenEvent, TokenSource

openai = pytest.importorskip("openai")

MODEL = "default"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


class ScriptedSource(TokenSource):
    """Endless tokens, one per event; the prompt FAIL_PROMPT gets an error event after two tokens.

    It keeps every generator it hands out, so nothing but an explicit close ends one (no
    garbage-collector finalization); `closed` lists the request ids whose generator was closed.
    """

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self.specs: list[GenerateSpec] = []
        self.generators = []
        self.closed: list[str] = []

    def model_name(self) -> str:
        return MODEL

    def max_model_len(self) -> int:
        return 1024

    def priority_scheduling(self) -> bool:
        return True

    def generate(self, spec: GenerateSpec):
        self.specs.append(spec)
        gen = self._events(spec)
        self.generators.append(gen)
        return gen

    async def _events(self, spec: GenerateSpec):
        try:
            for i in itertools.count():
                if spec.prompt_token_ids == FAIL_PROMPT and i == 2:
                    yield TokenEvent([], finished=True, error="decode worker 3 died")
                    return
                yield TokenEvent([self.token_ids[i % len(self.token_ids)]])
                await asyncio.sleep(0.005)
        finally:
            self.closed.append(spec.request_id)


FAIL_PROMPT = [5, 6, 7]
SCRIPT = " one two three STOP four five"


class ServerThread:
    """An asyncio loop in a daemon thread serving the engine (and a scripted source) on localhost."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.scripted = ScriptedSource(engine.tokenizer.encode(SCRIPT))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ports = self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    async def _start(self) -> dict[str, int]:
        source = EngineSource(AsyncEngine(self.engine), name=MODEL)
        plain = web.AppRunner(build_app(source, self.engine.tokenizer))
        await plain.setup()
        await web.TCPSite(plain, "127.0.0.1", 0).start()
        cancel = await start_server(build_app(source, self.engine.tokenizer), "127.0.0.1", 0)
        scripted = web.AppRunner(build_app(self.scripted, self.engine.tokenizer))  # no cancellation
        await scripted.setup()
        await web.TCPSite(scripted, "127.0.0.1", 0).start()
        self.runners = [plain, cancel, scripted]
        return {name: r.addresses[0][1] for name, r in zip(("plain", "cancel", "scripted"), self.runners)}

    def stop(self) -> None:
        for runner in self.runners:
            self._call(runner.cleanup())
        self._call(self._cancel_tasks())  # the AsyncEngine's loop task
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
def engines(default_model_dir):
    """(served engine, reference engine): the reference runs beside the server, never inside it."""
    served = Engine(default_model_dir, device=TEST_DEVICE, max_total_tokens=4096)
    reference = Engine(default_model_dir, device=TEST_DEVICE, max_total_tokens=4096)
    return served, reference


@pytest.fixture(scope="module")
def server(engines):
    server = ServerThread(engines[0])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.ports['plain']}/v1", api_key="x",
                         max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(engines):
    """Greedy reference outputs of the engine itself, cached per (prompt, max_tokens, logprobs)."""
    engine, cache = engines[1], {}

    def run(prompt, max_tokens, logprobs=None):
        key = (str(prompt), max_tokens, logprobs)
        if key not in cache:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
            cache[key] = engine.generate(prompt, params)[0]
        return cache[key]
    return run


def chat_ids(engine: Engine, messages) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                      add_special_tokens=False)


def wait_idle(engine: Engine, timeout: float = 5.0) -> None:
    """Every KV page free (or held by the prefix cache alone) and no request left, within
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pages_settled(engine) and not engine.has_unfinished():
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout}s: {engine.allocator.num_free_pages}/"
                         f"{engine.allocator.num_pages} pages free, unfinished={engine.has_unfinished()}")


def post(port: int, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- good requests -------------------------------------------------------------------------
def test_completion_greedy_equals_engine(client, ref, engines):
    expected = ref(PROMPT, 24)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = resp.choices[0]
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.model == MODEL
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    num_prompt = len(engines[0].tokenizer.encode(PROMPT))
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == \
        (num_prompt, len(expected.token_ids), num_prompt + len(expected.token_ids))
    # The same prompt as token ids, and as a one-string list, gives the same answer.
    ids = engines[0].tokenizer.encode(PROMPT)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=24,
                                     temperature=0).choices[0].text == expected.text
    assert client.completions.create(model=MODEL, prompt=[PROMPT], max_tokens=24,
                                     temperature=0).choices[0].text == expected.text


def test_completion_stream_concatenates_to_engine_text(client, ref, engines):
    expected = ref(PROMPT, 24)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(text_chunks) > 3  # it really streamed
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected.token_ids)
    assert usage_chunk.usage.prompt_tokens == len(engines[0].tokenizer.encode(PROMPT))
    assert len({c.id for c in chunks}) == 1


def test_chat_greedy_equals_engine_on_template(client, ref, engines):
    ids = chat_ids(engines[0], MESSAGES)
    expected = ref(ids, 32)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0)
    msg = resp.choices[0].message
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert msg.role == "assistant" and msg.content == expected.text and expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    # Content as a list of text parts renders the same prompt.
    parts = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    resp2 = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=32,
                                           temperature=0)
    assert resp2.choices[0].message.content == expected.text


def test_chat_continues_the_final_message_through_the_openai_client(client, ref, engines):
    """vLLM's continue_final_message (extra_body): the prompt ends inside the assistant's turn,
    at its text, and the reply goes on from there as the engine does on that prompt."""
    started = MESSAGES + [{"role": "assistant", "content": "Sure, here"}]
    tok = engines[0].tokenizer
    text = tok.apply_chat_template(started, add_generation_prompt=False)
    ids = tok.encode(text[:text.rindex("Sure, here") + len("Sure, here")], add_special_tokens=False)
    expected = ref(ids, 16)
    resp = client.chat.completions.create(
        model=MODEL, messages=started, max_tokens=16, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert resp.choices[0].message.content == expected.text and expected.text
    assert resp.usage.prompt_tokens == len(ids)


def test_chat_stream_equals_engine(client, ref, engines):
    ids = chat_ids(engines[0], MESSAGES)
    expected = ref(ids, 32)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    body = chunks[1:-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == expected.text
    assert body[-1].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_default_max_tokens_fills_the_context(engines):
    engine = engines[0]
    info = ModelInfo(MODEL, engine.tokenizer, engine.max_model_len)
    parsed = parse_chat({"model": MODEL, "messages": MESSAGES}, info)
    assert parsed.params.max_tokens == engine.max_model_len - len(chat_ids(engine, MESSAGES))


def test_completion_logprobs(client, ref):
    expected = ref(PROMPT, 8, logprobs=3)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    n = resp.usage.completion_tokens
    assert n == 8 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob)  # greedy: the chosen token is the best one
        assert logprob == pytest.approx(max(top.values()))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == resp.choices[0].text
    # Streamed logprobs cover every token once.
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                            logprobs=3, stream=True))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_completion_echo_with_logprobs_scores_the_prompt(client, engines):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 1) through the in-process
    engine: the prompt's tokens lead with the engine's prompt logprobs, the first null."""
    engine = engines[1]
    ids = engine.tokenizer.encode(PROMPT)
    want = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                 prompt_logprobs=1))[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                     logprobs=1, echo=True)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text == PROMPT + want.text
    assert lp.tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids + want.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in want.prompt_logprobs + want.logprobs],
                                                  abs=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_vllm_prompt_logprobs_through_the_openai_client(client, engines):
    """vLLM's prompt_logprobs (extra_body) on completions' choices and on a chat response: the
    engine's logprobs and ranks of the prompt's tokens, with the top alternatives asked for."""
    engine = engines[1]
    ids = engine.tokenizer.encode(PROMPT)
    want = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    got = resp.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for entry, lp in zip(got[1:], want.prompt_logprobs):
        own = entry[str(lp.token_id)]
        assert own["logprob"] == pytest.approx(lp.logprob, abs=1e-4) and own["rank"] == lp.rank >= 1
        assert own["decoded_token"] == engine.tokenizer.decode([lp.token_id], skip_special_tokens=False)
        tops = sorted((v["rank"], k) for k, v in entry.items() if k != str(lp.token_id) or lp.rank <= 2)
        assert [r for r, _ in tops] == [1, 2] and [int(k) for _, k in tops] == [t for t, _ in lp.top]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    ranks = [e and next(iter(e.values()))["rank"] for e in chat.model_extra["prompt_logprobs"]]
    want = engine.generate([chat_ids(engine, MESSAGES)],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert ranks == [None] + [lp.rank for lp in want.prompt_logprobs]


def test_chat_logprobs(client, ref, engines):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    expected = ref(chat_ids(engines[0], MESSAGES), 8, logprobs=2)
    assert len(content) == resp.usage.completion_tokens == len(expected.token_ids)
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    for entry in content:
        if "\ufffd" not in entry.token:  # (a piece of a character: its own bytes)
            assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    # Without logprobs=true there are none.
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_stop_string_cuts_text_and_aborts(client, ref, engines):
    full = ref(PROMPT, 24).text
    k = next(i for i in range(8, len(full) - 3) if full.find(full[i:i + 3]) == i and full[i] != " ")
    stop = full[k:k + 3]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     stop=["never-seen-xyz", stop])
    assert resp.choices[0].text == full[:k] and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 24
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(engines[0])


def test_priority_needs_an_engine_that_schedules_by_it(client):
    """The served engine runs --schedule-policy fcfs: a non-zero priority is a 400 naming the
    field (the client would otherwise believe it moved ahead); 0 is served."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": -1})
    assert e.value.body["param"] == "priority" and "--schedule-policy priority" in e.value.body["message"]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": 0})
    assert resp.usage.completion_tokens == 2


def test_n_seeded_choices_are_the_engine_s_with_seed_plus_i(client, engines):
    """n=3 with a seed: choice i samples with seed + i (vLLM's rule), so choice 0 is what n=1
    gives; the choices run side by side and their tokens add up in the usage."""
    params = dict(temperature=1.0, max_tokens=12, seed=5, extra_body={"ignore_eos": True})
    resp = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **params)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    reference = engines[1]
    want = [reference.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=12, seed=5 + i,
                                                      ignore_eos=True))[0].text for i in range(3)]
    assert [c.text for c in resp.choices] == want and len(set(want)) == 3
    assert resp.usage.prompt_tokens == len(engines[0].tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == 36
    wait_idle(engines[0])


def test_chat_stream_n_2_interleaves_both_choices(client, ref, engines):
    ids = chat_ids(engines[0], MESSAGES)
    expected = ref(ids, 16)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                                 temperature=0, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[2:-1] if c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == expected.text
        assert mine[-1].finish_reason == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == 2 * len(expected.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_vllm_min_tokens_include_stop_str_and_guided_choice(client, ref, engines):
    """vLLM's fields through the OpenAI client's extra_body: a stop token id ends the output
    without its text; min_tokens holds it (and stop strings) off for that many tokens;
    include_stop_str_in_output keeps the stop string or token's text; guided_choice answers one
    of its strings."""
    tok = engines[0].tokenizer
    expected = ref(PROMPT, 12)
    first = expected.token_ids[0]

    def create(**extra):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body=extra).choices[0]
    stopped = create(stop_token_ids=[first])  # the stop token adds no text (vLLM's rule) ...
    assert stopped.text == "" and stopped.finish_reason == "stop"
    kept = create(stop_token_ids=[first], include_stop_str_in_output=True)  # ... unless asked
    assert kept.text == tok.decode([first]) and kept.finish_reason == "stop"
    held = create(stop_token_ids=[first], min_tokens=3)
    reference = engines[1].generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[first], min_tokens=3))[0]
    ids = tok.encode(held.text, add_special_tokens=False)
    assert held.text == reference.text and len(reference.token_ids) >= 3
    assert first not in reference.token_ids[:3] and ids[:1] != [first]
    full = expected.text
    k = next(i for i in range(4, len(full) - 3) if full.find(full[i:i + 3]) == i and full[i] != " ")
    assert create(stop=[full[k:k + 3]], include_stop_str_in_output=True).text == full[:k + 3]
    assert create(stop=[full[k:k + 3]]).text == full[:k]
    choices = ["Paris", "London", "a \"quoted\" city"]
    answer = create(guided_choice=choices)
    assert answer.text in choices and answer.finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16,
                                          extra_body={"guided_choice": ["yes", "no"]})
    assert chat.choices[0].message.content in ("yes", "no")
    wait_idle(engines[0])


def test_logit_bias_forces_a_token(client, engines):
    token = engines[0].tokenizer.encode(" Paris")[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == engines[0].tokenizer.decode([token] * 4)
    wait_idle(engines[0])


def test_a_prompt_long_in_characters_but_not_in_tokens_is_served(server, engines):
    """70,000 spaces: past the characters the context's head check reads (8 x 4096), but only
    1,095 tokens, so it is tokenized in full and served."""
    prompt = " " * 70_000
    code, resp = post(server.ports["plain"], "/v1/completions",
                      {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert code == 200, resp
    assert resp["usage"]["prompt_tokens"] == len(engines[0].tokenizer.encode(prompt)) > 1000


def test_batched_prompts_give_n_choices_each_in_order(client, ref, engines):
    prompts = [PROMPT, "Once upon a time"]
    resp = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=10,
                                     temperature=0)
    want = [ref(p, 10).text for p in prompts]
    assert [(c.index, c.text) for c in resp.choices] == [
        (0, want[0]), (1, want[0]), (2, want[1]), (3, want[1])]
    tok = engines[0].tokenizer
    assert resp.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert resp.usage.completion_tokens == sum(2 * len(ref(p, 10).token_ids) for p in prompts)
    wait_idle(engines[0])


# ---- bad requests --------------------------------------------------------------------------
LONG = [28] * 8192  # token ids: the model's whole context, twice the 4,096-token KV cache
HUGE = "hello " * 700_000  # 4.2 MB, 700,001 tokens

BAD_REQUESTS = {
    "malformed_json": ("/v1/completions", b'{"model": "default", "prompt": ', 400, None, "not valid JSON"),
    "not_an_object": ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    "missing_prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt", "'prompt' is a required"),
    "prompt_is_a_dict": ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt",
                         "must be a string"),
    "too_many_prompts": ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 129}, 400, "prompt",
                         "129 prompts; at most 128 per request"),
    "too_many_choices": ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 65}, 400,
                         "n", "2 prompts x n=65 is 130 choices; at most 128"),
    "empty_prompt_in_a_batch": ("/v1/completions", {"model": MODEL, "prompt": ["a", []]}, 400,
                                "prompt", "prompt[1] is empty"),
    "missing_model": ("/v1/completions", {"prompt": "hi"}, 400, "model", "'model' is a required"),
    "max_tokens_0": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400,
                     "max_tokens", "max_tokens=0 must be >= 1"),
    "max_tokens_negative": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1},
                            400, "max_tokens", "max_tokens=-1 must be >= 1"),
    "max_tokens_string": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "8"},
                          400, "max_tokens", "must be an integer"),
    "temperature_negative": ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1},
                             400, "temperature", "temperature=-1.0 must be >= 0"),
    "top_p_zero": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "top_p": 0},
                   400, "top_p", "top_p=0.0 must be in (0, 1]"),
    "prompt_beyond_context": ("/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 16},
                              400, "prompt", "maximum context length is 4096 tokens. However, you "
                              "requested 8208 tokens (8192 in the prompt, 16 in the completion)"),
    # MiBs past the context: refused from the tokens of the first 8 x 4096 characters alone
    "prompt_far_beyond_context": ("/v1/completions", {"model": MODEL, "prompt": HUGE}, 400,
                                  "prompt", "the first 32768 characters of your prompt (4200000 "
                                  "in all) alone resulted in 5462 tokens"),
    "batch_prompt_far_beyond_context": ("/v1/completions", {"model": MODEL, "prompt": ["hi", HUGE]},
                                        400, "prompt", "characters of your prompt[1] (4200000"),
    "chat_far_beyond_context": ("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": HUGE}]}, 400, "messages",
        "characters of your messages ("),
    "chat_beyond_context": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                     "max_completion_tokens": 8192}, 400, "messages",
                            "maximum context length is 4096 tokens"),
    "unknown_model": ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model",
                      "The model `gpt-4` does not exist"),
    "n_0": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": 0}, 400, "n",
            "n=0 must be in [1, 128]"),
    "missing_messages": ("/v1/chat/completions", {"model": MODEL}, 400, "messages",
                         "'messages' is a required"),
    "bad_role": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]},
                 400, "messages[0].role", "must be one of"),
    "image_part": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]",
        "only {\"type\": \"text\""),
    "top_logprobs_without_logprobs": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                               "top_logprobs": 2}, 400, "top_logprobs",
                                      "requires logprobs=true"),
    "logit_bias_key": ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}},
                       400, "logit_bias", "logit_bias key 'x' is not a token id"),
    "logit_bias_unicode_digit": ("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                     "logit_bias": {"\u00b2": 1}}, 400,
                                 "logit_bias", "is not a token id"),
    "logit_bias_outside_vocab": ("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                     "logit_bias": {"49152": 1}}, 400,
                                 "logit_bias", "not a token id in [0, 49152)"),
    "logit_bias_value": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                  "logit_bias": {"5": 101}}, 400, "logit_bias",
                         "must be a number in [-100, 100]"),
    "too_many_stops": ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["x"] * 65},
                       400, "stop", "65 stop strings; at most 64"),
    "long_stop": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                           "stop": ["ab", "x" * 1025]}, 400, "stop",
                  "a stop string of 1025 characters; at most 1024"),
    "too_many_stop_token_ids": ("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                    "stop_token_ids": [1] * 1025}, 400,
                                "stop_token_ids", "1025 stop_token_ids; at most 1024"),
    "token_id_outside_vocab": ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt",
                               "outside the vocabulary"),
    "min_tokens_above_max_tokens": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                        "min_tokens": 5}, 400, "min_tokens",
                                    "min_tokens=5 must be in [0, max_tokens]"),
    "min_tokens_above_max_completion_tokens": ("/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 2, "min_tokens": 3}, 400,
        "min_tokens", "min_tokens=3 must be in [0, max_completion_tokens]"),
    "min_tokens_with_a_grammar": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                           "min_tokens": 2, "guided_regex": "a+"},
                                  400, "min_tokens", "cannot be combined with a structured output"),
    "guided_choice_not_a_list": ("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                     "guided_choice": "yes"}, 400, "guided_choice",
                                 "must be a non-empty list of non-empty strings"),
    "guided_choice_empty_string": ("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                       "guided_choice": ["yes", ""]}, 400,
                                   "guided_choice", "non-empty strings"),
    "guided_choice_nul": ("/v1/completions", {"model": MODEL, "prompt": "hi",
                                              "guided_choice": ["a\u0000b"]}, 400,
                          "guided_choice", "may not hold a NUL"),
    "guided_choice_too_many": ("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                   "guided_choice": ["x"] * 1025}, 400,
                               "guided_choice", "at most 1024 strings"),
    "guided_choice_and_regex": ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "a",
                                                    "guided_choice": ["a"]}, 400, "guided_choice",
                                "guided_regex and guided_choice each constrain the output"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request(server, engines, case):
    path, body, status, param, message = BAD_REQUESTS[case]
    code, resp = post(server.ports["plain"], path, body)
    assert code == status, resp
    error = resp["error"]
    assert message in error["message"] and error["param"] == param
    if status == 404:
        assert (error["type"], error["code"]) == ("NotFoundError", "model_not_found")
    else:
        assert (error["type"], error["code"]) == ("invalid_request_error", None)
    assert not engines[0].has_unfinished()


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.BadRequestError, match=r"n=500 must be in \[1, 128\]"):
        client.completions.create(model=MODEL, prompt="hi", n=500)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


def test_models_and_health(server):
    """max_model_len: the engine's KV cache (4,096 tokens), which limits requests below the
    model's context (8,192)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports['plain']}/v1/models") as resp:
        models = json.loads(resp.read())
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 4096
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports['plain']}/health") as resp:
        assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}


# ---- clients that hang up ------------------------------------------------------------------
def _open_request(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("kind", ["plain", "cancel"])
def test_disconnect_mid_stream_aborts(server, engines, kind):
    engine = engines[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    sock = _open_request(server.ports[kind], "/v1/completions", body)
    received = b""
    while received.count(b"data: ") < 3:  # headers, then a few chunks
        received += sock.recv(65536)
    assert b"200 OK" in received and b"text/event-stream" in received
    assert engine.has_unfinished()
    sock.close()
    wait_idle(engine)  # 3000 tokens would take minutes: only an abort frees the pages this soon


@pytest.mark.parametrize("kind", ["plain", "cancel"])
def test_disconnect_while_waiting_for_full_response_aborts(server, engines, kind):
    engine = engines[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}
    sock = _open_request(server.ports[kind], "/v1/completions", body)
    deadline = time.monotonic() + 10
    while not engine.has_unfinished():
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    time.sleep(0.2)  # a few tokens in
    sock.close()
    wait_idle(engine)


# ---- the HTTP layer's own duties, against a scripted source --------------------------------
def _sse_events(port: int, path: str, body: dict) -> list[str]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


def test_stop_string_closes_the_source_and_fields_reach_it(server):
    port, source = server.ports["scripted"], server.scripted
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "stop": "STOP", "temperature": 0.5,
            "top_p": 0.9, "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "seed": 3, "stop_token_ids": [9], "ignore_eos": True,
            "skip_special_tokens": False, "priority": -2}
    code, resp = post(port, "/v1/completions", body)
    assert code == 200 and resp["choices"][0]["text"] == " one two three "
    assert resp["choices"][0]["finish_reason"] == "stop"
    spec = source.specs[-1]
    assert spec.request_id == resp["id"] and spec.request_id in source.closed  # closed, not GC'd
    assert spec.priority == -2
    p = spec.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty,
            p.presence_penalty, p.frequency_penalty, p.seed, p.stop, p.stop_token_ids, p.ignore_eos,
            p.skip_special_tokens, p.logprobs) == (100, 0.5, 0.9, 7, 0.1, 1.1, 0.5, -0.5, 3, ["STOP"],
                                                   [9], True, False, None)
    # Streamed: the stop string never leaks, even partly, and the text is cut the same way.
    events = _sse_events(port, "/v1/chat/completions",
                         {"model": MODEL, "messages": MESSAGES, "stop": ["STOP", "xyz"], "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(deltas) == " one two three " and not any("S" in d for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert source.specs[-1].request_id in source.closed


def test_disconnect_closes_the_source(server):
    source = server.scripted
    sock = _open_request(server.ports["scripted"], "/v1/completions",
                         {"model": MODEL, "prompt": "hi", "max_tokens": 1000, "stream": True})
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    request_id = source.specs[-1].request_id
    assert request_id not in source.closed
    sock.close()
    deadline = time.monotonic() + 5
    while request_id not in source.closed:
        assert time.monotonic() < deadline, "the source was never closed after the client left"
        time.sleep(0.01)


def test_a_stop_string_ends_its_choice_alone_and_an_error_ends_all(server):
    """n=2 over the scripted source: the stop string cuts each choice and closes its source; a
    failing prompt beside a good one in a batch fails the request and closes both sources."""
    port, source = server.ports["scripted"], server.scripted
    code, resp = post(port, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2,
                                                "max_tokens": 100, "stop": "STOP"})
    assert code == 200 and [c["text"] for c in resp["choices"]] == [" one two three "] * 2
    ids = [spec.request_id for spec in source.specs[-2:]]
    assert ids == [resp["id"] + "-0", resp["id"] + "-1"] and all(i in source.closed for i in ids)
    code, resp = post(port, "/v1/completions", {"model": MODEL, "prompt": [[1, 2], FAIL_PROMPT],
                                                "max_tokens": 1000})
    assert code == 500 and "decode worker 3 died" in resp["error"]["message"]
    ids = [spec.request_id for spec in source.specs[-2:]]
    deadline = time.monotonic() + 5
    while not all(i in source.closed for i in ids):
        assert time.monotonic() < deadline, "a choice's source was left open after the error"
        time.sleep(0.01)


def test_source_error_is_500_or_an_sse_error(server):
    port = server.ports["scripted"]
    code, resp = post(port, "/v1/completions", {"model": MODEL, "prompt": FAIL_PROMPT})
    assert code == 500 and resp["error"]["type"] == "server_error"
    assert "decode worker 3 died" in resp["error"]["message"]
    # Streamed: the tokens so far, then an error event, then [DONE].
    events = _sse_events(port, "/v1/completions", {"model": MODEL, "prompt": FAIL_PROMPT, "stream": True})
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "decode worker 3 died" in error["message"] and error["type"] == "server_error"
    assert all("choices" in json.loads(e) for e in events[:-2])
    # The openai client turns that event into an exception.
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="decode worker 3 died"):
        list(client.completions.create(model=MODEL, prompt=FAIL_PROMPT, stream=True))
