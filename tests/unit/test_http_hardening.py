"""The HTTP layer under hostile or unlucky traffic: OpenAI error bodies with the right status,
never a 500 for a client's mistake or a cluster's state, and the API key.

No processes: aiohttp's test server over build_app, with a source that plays scripted events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pd_serve.gateway.app import build_app, start_server
from pd_serve.gateway.source import GenerateSpec, TokenEvent, TokenSource
from pd_serve.model.tokenizer import Tokenizer
from pd_serve.protocol import Logprob

MODEL = "m"
KEY = "sk-test-key"


class ScriptedSource(TokenSource):
    """Plays `script` (a list of TokenEvents) to every request; `specs` records what came in."""

    def __init__(self, script: list[TokenEvent], max_choices: int | None = None,
                 max_model_len: int = 1024, priority: bool = True):
        self.script = script
        self.specs: list[GenerateSpec] = []
        self._max_choices = max_choices
        self._max_model_len = max_model_len
        self._priority = priority

    def max_choices(self) -> int | None:
        return self._max_choices

    def priority_scheduling(self) -> bool:
        return self._priority

    def model_name(self) -> str:
        return MODEL

    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate(self, spec: GenerateSpec):
        self.specs.append(spec)
        for event in self.script:
            await asyncio.sleep(0)
            yield event


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def token(tokenizer) -> int:
    return tokenizer.encode(" hello", add_special_tokens=False)[0]


def done(token: int) -> list[TokenEvent]:
    return [TokenEvent([token], finished=True, finish_reason="length")]


@contextlib.asynccontextmanager
async def serving(tokenizer, script: list[TokenEvent], max_choices: int | None = None,
                  max_model_len: int = 1024, priority: bool = True, **kwargs):
    app = build_app(ScriptedSource(script, max_choices, max_model_len, priority), tokenizer, **kwargs)
    async with TestClient(TestServer(app)) as client:
        yield client


def call(tokenizer, script, method: str, path: str, body=None, headers=None, **kwargs):
    """(status, headers, parsed JSON body or the raw text) of one request."""
    async def go():
        async with serving(tokenizer, script, **kwargs) as client:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body)
            resp = await client.request(method, path, data=data, headers=headers)
            text = await resp.text()
            try:
                return resp.status, resp.headers, json.loads(text)
            except ValueError:
                return resp.status, resp.headers, text
    return asyncio.run(go())


def post(tokenizer, script, body, path="/v1/completions", **kwargs):
    return call(tokenizer, script, "POST", path, body, **kwargs)


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4} | fields


def assert_error(status, body, want_status, param=None, message="", type=None):
    assert status == want_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["param"] == param
    assert error["type"] == (type or "invalid_request_error")


# ---- choices past what the gateway takes at once -----------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", completion(n=9)),
    ("/v1/completions", completion(prompt=["a", "b", "c"], n=3)),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "n": 9}),
])
def test_more_choices_than_the_gateway_takes_is_a_400(tokenizer, token, path, body):
    """n x prompts past the source's max_choices (a cluster's queue) can never all be taken:
    a 400 at once, not a 429 that a client would retry forever."""
    status, _, out = post(tokenizer, done(token), body, path, max_choices=8)
    assert_error(status, out, 400, "n", "9 choices")
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    ok = body | {"n": 8 // prompts}  # 8 or 6 choices: taken
    status, _, out = post(tokenizer, done(token), ok, path, max_choices=8)
    assert status == 200 and len(out["choices"]) == 8 // prompts * prompts, out


# ---- the API key ---------------------------------------------------------------------------
def test_api_key_is_required_on_v1_routes_only(tokenizer, token):
    async def go():
        async with serving(tokenizer, done(token), api_key=KEY) as client:
            out = {}
            for name, headers in [("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                                  ("scheme", {"Authorization": KEY}),
                                  ("basic", {"Authorization": f"Basic {KEY}"}),
                                  ("spaces", {"Authorization": f"Bearer  {KEY}"}),
                                  ("lower", {"Authorization": f"bearer {KEY}"}),
                                  ("right", {"Authorization": f"Bearer {KEY}"})]:
                resp = await client.post("/v1/completions", json=completion(), headers=headers)
                out[name] = resp.status, await resp.json()
            models = await client.get("/v1/models")
            health = await client.get("/health")
            return out, models.status, health.status
    out, models, health = asyncio.run(go())
    for name in ("none", "wrong", "scheme", "basic", "spaces"):
        status, body = out[name]
        assert_error(status, body, 401, message="API key")
        assert body["error"]["code"] == "invalid_api_key"
    for name in ("lower", "right"):  # the scheme is case-insensitive (RFC 7235)
        assert out[name][0] == 200 and out[name][1]["choices"][0]["text"] == " hello"
    assert models == 401 and health == 200


class TimedTokenizer:
    """The tokenizer, recording (start, end, characters) of every encode."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer, self.encodes = tokenizer, []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text: str, **kwargs) -> list[int]:
        start = time.monotonic()
        ids = self._tokenizer.encode(text, **kwargs)
        self.encodes.append((start, time.monotonic(), len(text)))
        return ids


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_a_long_prompt_is_tokenized_off_the_event_loop(tokenizer, token, path):
    """A prompt of a few MiB takes seconds to tokenize; the event loop (every stream, /health)
    keeps running meanwhile: the parse runs in a thread and the tokenizer releases the GIL. A
    ticker on the loop must keep ticking while the long encode runs (it cannot when the loop
    thread does the encode, or waits for the GIL the encode holds)."""
    timed = TimedTokenizer(tokenizer)

    async def go():
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        # a context of 65,536 tokens could hold the 4.4 M characters below (tokens of up to
        # tokenizer.max_token_chars characters), so they are tokenized; /tokenize counts them
        # (900 k tokens) within 4 contexts of 262,144
        context = 262_144 if path == "/tokenize" else 65_536
        async with serving(timed, done(token), max_model_len=context) as client:
            body = {"model": MODEL, "prompt": "hello world, " * 300_000}
            if path == "/v1/completions":
                # a prompt past the context: 400 once tokenized. Spaces first, so its head (8
                # characters per token of the context) stays under the context and the whole
                # text is tokenized (openai_protocol._encode)
                body["prompt"] = " " * 8 * 65_536 + body["prompt"]
                body["max_tokens"] = 4
            tick = asyncio.create_task(ticker())
            resp = await client.post(path, json=body)
            await resp.read()
            tick.cancel()
            return resp.status, ticks

    status, ticks = asyncio.run(go())
    assert status == (200 if path == "/tokenize" else 400)
    start, end, _ = next(e for e in timed.encodes if e[2] >= 3_000_000)
    inside = sum(start < t < end for t in ticks)  # a blocked loop gets one or two at the edges
    assert inside >= 10, f"{inside} ticks in the {end - start:.2f} s encode"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_longer_than_the_context_can_hold_is_400_untokenized(tokenizer, path):
    """4 M characters cannot fit a 1,024-token context, whatever their head looks like: a run
    of spaces (64 to a token) first no longer gets the rest tokenized (tens of seconds of a
    gateway thread and hundreds of MiB per request). The text is never encoded in full."""
    timed = TimedTokenizer(tokenizer)
    text = " " * 8 * 1024 + "hello world, " * 300_000
    body = ({"model": MODEL, "prompt": text, "max_tokens": 4} if path == "/v1/completions" else
            {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4})
    status, _, resp = post(timed, done(0), body, path)
    assert_error(status, resp, 400, "prompt" if path == "/v1/completions" else "messages",
                 "maximum context length is 1024 tokens")
    assert not [e for e in timed.encodes if e[2] >= len(text)], timed.encodes


def test_a_batch_past_the_context_stops_at_its_first_such_prompt(tokenizer):
    """A /v1/completions batch whose prompts each pass the length checks but not the context
    is refused once the first of them is tokenized; the others are never tokenized (24 such
    prompts of 650 k characters, eight requests at once, held every parse thread for ~20 s)."""
    timed = TimedTokenizer(tokenizer)
    one = " " * 8 * 1024 + "hello world " * 6000  # 80 k characters, ~12 k tokens
    assert len(one) <= 1024 * tokenizer.max_token_chars
    status, _, resp = post(timed, done(0), completion(prompt=[one] * 4))
    assert_error(status, resp, 400, "prompt", "maximum context length is 1024 tokens")
    assert len([e for e in timed.encodes if e[2] == len(one)]) == 1, timed.encodes


def test_a_prompt_long_in_characters_that_may_fit_is_still_tokenized(tokenizer, token):
    """The character bound refuses only what cannot fit: 60,000 spaces (938 tokens, past the
    head check's 8 characters per token) are served in a 1,024-token context."""
    text = " " * 60_000
    assert len(text) <= 1024 * tokenizer.max_token_chars
    status, _, resp = post(tokenizer, done(token), completion(prompt=text))
    assert status == 200, resp
    assert resp["usage"]["prompt_tokens"] == len(tokenizer.encode(text))


# ---- aiohttp's own errors ------------------------------------------------------------------
class TickedTokenizer:
    """The tokenizer, recording the ticker's count at every one-token decode of a logprob's
    token string (skip_special_tokens=False, as the response shapes decode them)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer, self.ticks, self.at = tokenizer, 0, []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if len(ids) == 1 and not skip_special_tokens:
            self.at.append(self.ticks)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_big_response_is_built_with_the_event_loop_running(tokenizer, token, path):
    """A non-streamed response of many choices with logprobs (n=128, top 20: ~20 MB of JSON,
    over a second of CPU) is built a choice at a time with the loop running between: a ticker
    on the loop must tick while the choices' token strings are decoded (it cannot when the
    whole body is built in one go). The body is whole and in order."""
    n, tokens = 16, 8
    ticked = TickedTokenizer(tokenizer)
    logprobs = [Logprob(token, -0.5, [(token, -0.5), (token + 1, -2.0)]) for _ in range(tokens)]
    script = [TokenEvent([token] * tokens, logprobs, finished=True, finish_reason="length")]
    body = completion(n=n, max_tokens=tokens, logprobs=2) if path == "/v1/completions" else {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": n,
        "max_tokens": tokens, "logprobs": True, "top_logprobs": 2}

    async def go():
        async def ticker():
            while True:
                ticked.ticks += 1
                await asyncio.sleep(0)

        async with serving(ticked, script, max_choices=n) as client:
            tick = asyncio.create_task(ticker())
            resp = await client.post(path, json=body)
            text = await resp.text()
            tick.cancel()
            return resp.status, json.loads(text)

    status, answer = asyncio.run(go())
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == list(range(n))
    assert answer["usage"]["completion_tokens"] == n * tokens
    for c in answer["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"] if path == "/v1/completions" else lp["content"]) == tokens
    assert len(ticked.at) >= n * tokens
    assert len(set(ticked.at)) >= n, f"the loop ran {len(set(ticked.at))} times over {n} choices"


class EndlessSource(ScriptedSource):
    """One token every 20 ms until its consumer closes it; `closed` records what the HTTP
    layer reports of requests it closed early."""

    def __init__(self, token: int):
        super().__init__([])
        self.token, self.closed = token, []

    def closed_early(self, reason: str) -> None:
        self.closed.append(reason)

    async def generate(self, spec: GenerateSpec):
        while True:
            await asyncio.sleep(0.02)
            yield TokenEvent([self.token])


def test_requests_closed_early_are_reported_to_the_source(tokenizer, token):
    """The HTTP layer closes a request's events at a stop string, or when its client goes:
    the source never sees those ends, so it is told (stop, abort) and its finish counts
    (pd_serve:requests_total) miss none. Requests whose source sent the end are not reported."""
    word = tokenizer.decode([token])

    async def go():
        source = EndlessSource(token)
        async with TestClient(TestServer(build_app(source, tokenizer))) as client:
            resp = await client.post("/v1/completions", json=completion(
                max_tokens=100, stop=[(word * 3).strip()]))
            answer = await resp.json()
            assert resp.status == 200 and answer["choices"][0]["finish_reason"] == "stop"
            resp = await client.post("/v1/completions",
                                     json=completion(max_tokens=100, stream=True))
            await resp.content.readline()  # the first event: then the client goes
            resp.close()
            for _ in range(500):  # the next write fails and the request ends
                if len(source.closed) == 2:
                    break
                await asyncio.sleep(0.02)
        ended = ScriptedSource(done(token))
        ended.closed = []
        ended.closed_early = ended.closed.append
        async with TestClient(TestServer(build_app(ended, tokenizer))) as client:
            assert (await client.post("/v1/completions", json=completion())).status == 200
        return source.closed, ended.closed

    early, ended = asyncio.run(go())
    assert early == ["stop", "abort"] and ended == []


def test_wrong_method_and_unknown_path_are_json(tokenizer, token):
    status, headers, body = call(tokenizer, done(token), "GET", "/v1/completions")
    assert_error(status, body, 405, message="Method Not Allowed (GET /v1/completions)")
    assert headers["Allow"] == "POST"
    status, _, body = call(tokenizer, done(token), "POST", "/v1/nope", b"{}")
    assert_error(status, body, 404, message="Not Found (POST /v1/nope)")



def test_a_model_is_retrieved_by_name(tokenizer, token):
    """OpenAI's GET /v1/models/{model} (client.models.retrieve): the card /v1/models lists; any
    other name, "/" in it or not, a 404 naming it."""
    _, _, listed = call(tokenizer, done(token), "GET", "/v1/models")
    status, _, card = call(tokenizer, done(token), "GET", f"/v1/models/{MODEL}")
    assert status == 200 and card == listed["data"][0]
    status, _, body = call(tokenizer, done(token), "GET", "/v1/models/org/other")
    assert_error(status, body, 404, "model", "The model `org/other` does not exist",
                 type="NotFoundError")
    assert body["error"]["code"] == "model_not_found"

def test_stalled_bodies_time_out_with_408(tokenizer, token):
    """Clients that send headers and part of the body, then stall: each gets a 408 once
    body_timeout_s has passed, all at once, and the server still serves others."""
    async def stalled(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        body = await asyncio.wait_for(reader.readexactly(length), 60)
        writer.close()
        return head.split(b"\r\n")[0], json.loads(body)

    async def go():
        async with serving(tokenizer, done(token), body_timeout_s=0.5) as client:
            port = client.server.port
            results = await asyncio.gather(*(stalled(port) for _ in range(10)))
            ok = await client.post("/v1/completions", json=completion())
            return results, ok.status
    results, ok = asyncio.run(go())
    for status_line, body in results:
        assert status_line.startswith(b"HTTP/1.1 408")
        assert_error(408, body, 408, message="did not arrive within 0.5 s")
    assert ok == 200


class SlowSource(ScriptedSource):
    """ScriptedSource with `delay_s` before each event."""

    def __init__(self, script: list[TokenEvent], delay_s: float):
        super().__init__(script)
        self.delay_s = delay_s

    async def generate(self, spec: GenerateSpec):
        async for event in super().generate(spec):
            await asyncio.sleep(self.delay_s)
            yield event


async def until_closed(port: int, sent: bytes) -> bytes:
    """All the server on `port` sends after `sent`, until it closes the connection (EOF)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(sent)
    await writer.drain()
    received = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    return received


def test_idle_and_half_sent_connections_are_closed(tokenizer, token):
    """start_server closes a connection with no request running keep_alive_s after it opened
    or after its last response: one that never sends, one that sends half its headers and
    stalls (slowloris), and a kept-alive one after its answer. A request that runs longer than
    keep_alive_s is answered in full."""
    request = json.dumps(completion()).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(request))

    async def go():
        app = build_app(SlowSource(done(token), delay_s=3.0), tokenizer)
        runner = await start_server(app, "127.0.0.1", 0, keep_alive_s=2.0)
        port = runner.addresses[0][1]
        try:
            return await asyncio.gather(
                until_closed(port, b""), until_closed(port, b"POST /v1/completions HTTP/1.1\r\n"),
                until_closed(port, head + request))
        finally:
            await runner.cleanup()
    idle, half, answered = asyncio.run(go())
    assert idle == b"" and half == b""
    assert answered.startswith(b"HTTP/1.1 200"), answered[:200]
    assert json.loads(answered.split(b"\r\n\r\n", 1)[1])["choices"][0]["finish_reason"] == "length"


class FloodSource(ScriptedSource):
    """To its first request: `count` events of 1,000 tokens each, as fast as they are taken,
    then the end; `left` is set when its consumer closes it before the end (the request
    aborted). Later requests get one token."""

    def __init__(self, token: int, count: int):
        super().__init__(done(token))
        self.token, self.count, self.taken = token, count, 0
        self.left = asyncio.Event()

    async def generate(self, spec: GenerateSpec):
        if self.specs:
            async for event in super().generate(spec):
                yield event
            return
        self.specs.append(spec)
        try:
            for _ in range(self.count):
                await asyncio.sleep(0)
                yield TokenEvent([self.token] * 1000)
                self.taken += 1
            yield TokenEvent([self.token], finished=True, finish_reason="length")
        except GeneratorExit:
            self.left.set()
            raise


@web.middleware
async def small_send_buffer(request, handler):
    """The server's socket buffer for replies made small, so that a client reading nothing
    fills it with little."""
    request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return await handler(request)


def test_a_stream_its_client_does_not_read_is_closed_and_aborted(tokenizer, token):
    """A client that opens a stream and never reads it (its receive buffer full): once the
    server has waited send_timeout_s on a write, the connection is dropped and the request is
    aborted (its source closed, far from the end), and the server serves others meanwhile."""
    request = json.dumps(completion(stream=True, max_tokens=1000)).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(request))
    source = FloodSource(token, count=2000)  # 2k events of ~6 KB: 12 MB

    async def go():
        app = build_app(source, tokenizer, send_timeout_s=0.5)
        app.middlewares.append(small_send_buffer)
        runner = await start_server(app, "127.0.0.1", 0)
        port = runner.addresses[0][1]
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            await asyncio.get_running_loop().sock_sendall(sock, head + request)
            await asyncio.wait_for(source.left.wait(), 120)  # reading nothing meanwhile
            async with aiohttp.ClientSession() as client:
                async with client.post(f"http://127.0.0.1:{port}/v1/completions",
                                       json=completion()) as other:
                    return other.status
        finally:
            sock.close()
            await runner.cleanup()
    assert asyncio.run(go()) == 200
    assert source.taken < source.count


def test_a_whole_reply_its_client_does_not_read_is_dropped(tokenizer, token):
    """A non-streamed reply (a few MB here) to a client that reads none of it: once the server
    has waited send_timeout_s on a write, the handler drops the connection and returns, the
    reply let go (before, the handler returned the whole body for aiohttp to write, however
    long that took)."""
    request = json.dumps(completion(max_tokens=1000)).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(request))
    source = FloodSource(token, count=400)
    dropped = []

    @web.middleware
    async def recording(request, handler):
        response = await small_send_buffer(request, handler)
        dropped.append((response.status, request.transport is None or request.transport.is_closing()))
        return response

    async def go():
        app = build_app(source, tokenizer, send_timeout_s=0.5)
        app.middlewares.append(recording)
        runner = await start_server(app, "127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", runner.addresses[0][1]))
            await loop.sock_sendall(sock, head + request)
            deadline = loop.time() + 120
            while not dropped and loop.time() < deadline:  # reading nothing meanwhile
                await asyncio.sleep(0.05)
        finally:
            sock.close()
            await runner.cleanup()
    asyncio.run(go())
    assert dropped == [(200, True)]


@pytest.mark.parametrize("api_key", ["", "k"])
def test_pipelined_requests_whose_replies_are_never_read_lose_the_connection(tokenizer, token,
                                                                             api_key):
    """A client that pipelines requests on one connection and reads none of the replies (its
    receive buffer full): once the server has waited send_timeout_s to send a reply, the
    connection is dropped, whether the replies are answers or 401s (before, it was held for
    good, with a few MB of socket buffers, by a client with no API key)."""
    requests = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" * 2000  # ~600 KB of replies

    async def go():
        app = build_app(ScriptedSource(done(token)), tokenizer, send_timeout_s=0.5, api_key=api_key)
        app.middlewares.insert(1, small_send_buffer)
        runner = await start_server(app, "127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", runner.addresses[0][1]))
            sending = asyncio.ensure_future(loop.sock_sendall(sock, requests))
            await until_true(lambda: runner.server.connections, 30)
            held = await until_true(lambda: not runner.server.connections, 60)  # reading nothing
            sending.cancel()
            return held
        finally:
            sock.close()
            await runner.cleanup()
    assert asyncio.run(go()), "the connection was still open 60 s on"


async def until_true(what, timeout_s: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not what():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def test_a_large_body_waits_for_room_while_small_ones_pass(tokenizer, token, monkeypatch):
    """Large bodies (over 1 MiB, or of unknown length) are read and parsed within a shared
    byte budget (3 MiB here): while a stalled upload holds 2 MiB of it, a second 2 MiB body
    waits and is served only after the stalled one's 408, and a small request is served at
    once meanwhile."""
    from pd_serve.gateway import openai_api
    monkeypatch.setattr(openai_api, "LARGE_BODIES_BYTES", 3 * 2**20)
    large = json.dumps(completion(user="x" * (2 * 2**20))).encode()

    async def go():
        app = build_app(ScriptedSource(done(token)), tokenizer, body_timeout_s=2.0)
        runner = await start_server(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        loop = asyncio.get_running_loop()
        stalled = socket.socket()
        stalled.setblocking(False)
        ends = {}
        try:
            await loop.sock_connect(stalled, ("127.0.0.1", runner.addresses[0][1]))
            await loop.sock_sendall(stalled, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                                    b"\r\n" % len(large) + large[:1000])
            await asyncio.sleep(0.3)  # its 2 MiB held from here
            async with aiohttp.ClientSession() as client:
                async def post_large():
                    async with client.post(url, data=large) as r:
                        ends["large"] = loop.time()
                        return r.status
                waiting = asyncio.ensure_future(post_large())
                await asyncio.sleep(0.3)
                async with client.post(url, json=completion()) as r:
                    small = r.status, waiting.done()
                reply = await asyncio.wait_for(loop.sock_recv(stalled, 4096), 60)
                ends["stalled"] = loop.time()
                return small, reply.split(b" ", 2)[1], await asyncio.wait_for(waiting, 60), ends
        finally:
            stalled.close()
            await runner.cleanup()
    small, stalled_status, large_status, ends = asyncio.run(go())
    assert small == (200, False) and stalled_status == b"408" and large_status == 200
    assert ends["large"] >= ends["stalled"], ends


def test_body_budget_refuses_past_its_timeout():
    """BodyBudget on its own: a small body passes while the budget is spent; a large one (or
    one of unknown length, counted at the body limit) waits, and is a 503 with Retry-After
    when no room comes within the timeout; released room lets a waiter in."""
    from types import SimpleNamespace
    from pd_serve.gateway.openai_api import MAX_BODY_BYTES, BodyBudget
    from pd_serve.gateway.openai_protocol import ApiError

    def body(length):
        return SimpleNamespace(content_length=length)

    async def go():
        budget = BodyBudget(MAX_BODY_BYTES + 8 * 2**20)
        async with budget.hold(body(6 * 2**20), 1), budget.hold(body(None), 1):
            assert budget.free == 2 * 2**20  # unknown length: the body limit
            async with budget.hold(body(1000), 1):  # small: passes
                pass
            with pytest.raises(ApiError) as e:
                async with budget.hold(body(3 * 2**20), 0.2):
                    pass
            assert e.value.status == 503 and e.value.retry_after == 1
            held = budget.hold(body(3 * 2**20), 10)
            waiter = asyncio.ensure_future(held.__aenter__())
            await asyncio.sleep(0.1)
            assert not waiter.done()
        await asyncio.wait_for(waiter, 10)
        assert budget.free == budget.total - 3 * 2**20
        await held.__aexit__(None, None, None)
        assert budget.free == budget.total
    asyncio.run(go())


def test_accept_failures_are_logged_once_per_interval():
    """Out of file descriptors, asyncio logs "socket.accept() out of system resource" at every
    turn of its loop: one such record per 10 s gets through, naming how many were held back;
    other records pass."""
    from pd_serve.gateway.app import _FewAcceptFailures
    quiet = _FewAcceptFailures(every_s=10.0)

    def record(msg, at):
        r = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)
        r.created = at
        return r
    accept = "socket.accept() out of system resource\nsocket: %s"
    passed = [quiet.filter(r) for r in [record(accept, 100.0 + i / 100) for i in range(1000)]]
    assert passed.count(True) == 1 and passed[0]
    later = record(accept, 110.5)
    assert quiet.filter(later) and "(999 more such records held back)" in later.msg
    assert not quiet.filter(record(accept, 111.0))
    assert quiet.filter(record("Task was destroyed but it is pending!", 111.0))


def test_the_gateway_raises_its_open_files_limit():
    """A child process with a soft limit of 1024: raise_open_files_limit lifts it towards the
    hard limit (up to 65536); it cannot pass the hard limit."""
    import resource
    import subprocess
    import sys
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    start = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)
    code = ("import resource; from pd_serve.gateway.app import raise_open_files_limit; "
            "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (start, hard)))
    now, seen = map(int, out.stdout.split())
    want = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    assert now == seen == want, out


def test_too_many_messages_is_400_before_the_template(tokenizer, token):
    from pd_serve.gateway.openai_protocol import MAX_MESSAGES
    chat = {"model": MODEL, "max_tokens": 4}
    many = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    status, _, resp = post(tokenizer, done(token), chat | {"messages": many}, "/v1/chat/completions")
    assert_error(status, resp, 400, "messages", f"at most {MAX_MESSAGES}")
    status, _, resp = post(tokenizer, done(token), chat | {"messages": many[:MAX_MESSAGES]},
                           "/v1/chat/completions", max_model_len=2**20)
    assert status == 200, resp


# ---- hostile JSON --------------------------------------------------------------------------
def test_deep_nesting_is_400(tokenizer, token):
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, _, body = post(tokenizer, done(token), deep)
    assert_error(status, body, 400, message="nests deeper than")
    # Deep enough to pass json.loads but not the gateway, in a field otherwise ignored.
    status, _, body = post(tokenizer, done(token), completion(user=json.loads("[" * 200 + "]" * 200)))
    assert_error(status, body, 400, "user", "nests deeper than 64 levels")


@pytest.mark.parametrize("body", [
    b'{"model": "m", "prompt": "a\\ud800b"}',
    b'{"model": "m", "prompt": "\\udc00"}',
    b'{"model": "m", "prompt": "ok", "stop": ["x\\ud83d"]}',
], ids=["high", "low", "in_stop"])
def test_lone_surrogate_is_400(tokenizer, token, body):
    status, _, resp = post(tokenizer, done(token), body)
    assert_error(status, resp, 400, "stop" if b"stop" in body else "prompt", "not valid Unicode")


def test_body_must_be_utf8(tokenizer, token):
    cesu = b'{"model": "m", "prompt": "a\xed\xa0\x80"}'  # a surrogate as raw bytes
    status, _, resp = post(tokenizer, done(token), cesu)
    assert_error(status, resp, 400, None, "not valid UTF-8")


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_a_body_its_content_encoding_does_not_decode_is_400(tokenizer, token, encoding):
    """gzip fails as the handler reads the body (our 400); deflate and br fail in aiohttp's
    parser, which answers 400 itself, in plain text."""
    status, _, body = post(tokenizer, done(token), b"abcd",
                           headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
    assert status == 400, body
    if encoding == "gzip":
        assert "could not be read" in body["error"]["message"], body


@pytest.mark.parametrize("path,key,status", [("/v1/completions", None, 400),
                                             ("/v1/completions", KEY, 401),
                                             ("/v1/nothing", None, 404)])
def test_an_undecodable_body_logs_nothing(tokenizer, token, path, key, status, caplog):
    """A gzip body that does not decode, answered whatever the route or key: aiohttp reads
    the rest after the answer and fails again; that leaves no error in the log (one traceback
    per request would let any client flood it)."""
    with caplog.at_level(logging.ERROR):
        got, _, body = post(tokenizer, done(token), b"abcd", path=path, api_key=key or "",
                            headers={"Content-Encoding": "gzip"})
    assert got == status, body
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_surrogate_pair_is_fine(tokenizer, token):
    status, _, body = post(tokenizer, done(token), b'{"model": "m", "prompt": "\\ud83d\\ude00"}')
    assert status == 200, body


@pytest.mark.parametrize("field,value", [
    ("top_k", 10**30), ("max_tokens", 2**63), ("n", -10**30), ("priority", 2**63),
    ("logprobs", 10**30), ("seed", 2**64), ("stop_token_ids", [1, 10**30]),
    ("logit_bias", {"1": 10**30}), ("logit_bias", {"1" * 30: 1}), ("temperature", 10**400),
], ids=lambda v: str(v)[:12])
def test_integers_beyond_64_bits_are_400_naming_the_field(tokenizer, token, field, value):
    status, _, body = post(tokenizer, done(token), completion(**{field: value}))
    assert_error(status, body, 400, field)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_priority_without_priority_scheduling_is_400(tokenizer, token, path):
    """A request's priority moves it ahead of others only where the operator runs
    --schedule-policy priority; elsewhere a non-zero one is refused (vLLM's rule), 0 is fine."""
    body = completion() if path == "/v1/completions" else {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for priority in (-1, 5):
        status, _, resp = post(tokenizer, done(token), body | {"priority": priority}, path,
                               priority=False)
        assert_error(status, resp, 400, "priority", "--schedule-policy priority")
    status, _, resp = post(tokenizer, done(token), body | {"priority": 0}, path, priority=False)
    assert status == 200, resp
    status, _, resp = post(tokenizer, done(token), body | {"priority": -1}, path)
    assert status == 200, resp


def test_64_bit_edges_are_accepted(tokenizer, token):
    fields = dict(seed=2**64 - 1, priority=-2**63, top_k=2**63 - 1, stop_token_ids=[2**63 - 1])
    status, _, body = post(tokenizer, done(token), completion(**fields))
    assert status == 200, body


# ---- fields the server does not implement --------------------------------------------------
@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "guided_whitespace_pattern", " "),
    ("/v1/completions", "guided_decoding_backend", "outlines"),
    ("/v1/completions", "suffix", "end"),
    ("/v1/completions", "structural_tag", "x"),
    ("/v1/completions", "truncate_prompt_tokens", 3),
    ("/v1/completions", "messages", []),  # chat's field on the completions route
    ("/v1/chat/completions", "echo", True),
])
def test_unimplemented_fields_are_400_naming_them(tokenizer, token, path, field, value):
    body = completion() if path == "/v1/completions" else {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, _, resp = post(tokenizer, done(token), body | {field: value}, path)
    assert_error(status, resp, 400, field, f"'{field}' is not supported")


def test_harmless_and_off_fields_are_accepted(tokenizer, token):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
            "parallel_tool_calls": False, "user": "u", "metadata": {"a": "b"}, "store": False,
            "service_tier": "auto", "functions": None, "guided_json": None}
    status, _, resp = post(tokenizer, done(token), body, "/v1/chat/completions")
    assert status == 200, resp
    # OpenAI's and vLLM's defaults, which clients that send a whole request object fill in
    defaults = {"echo": False, "best_of": 1, "function_call": "auto", "modalities": ["text"],
                "prompt_cache_retention": "24h", "use_beam_search": False, "length_penalty": 1.0,
                "spaces_between_special_tokens": True, "return_tokens_as_token_ids": False,
                "return_token_ids": False, "bad_words": [], "add_special_tokens": False}
    status, _, resp = post(tokenizer, done(token), body | defaults, "/v1/chat/completions")
    assert status == 200, resp
    status, _, resp = post(tokenizer, done(token), completion(**defaults | {"echo": False}))
    assert status == 200, resp
    for field, value in (("use_beam_search", True), ("bad_words", ["x"]), ("best_of", 2),
                         ("return_token_ids", True), ("length_penalty", 0.5),
                         ("best_of", True), ("echo", 0), ("length_penalty", True)):
        status, _, resp = post(tokenizer, done(token), body | {field: value}, "/v1/chat/completions")
        assert_error(status, resp, 400, field, f"'{field}' is not supported")


@pytest.mark.parametrize("path,default", [("/v1/completions", True),
                                          ("/v1/chat/completions", False)])
def test_add_special_tokens_reaches_the_tokenizer(tokenizer, token, monkeypatch, path, default):
    """vLLM's add_special_tokens: completions default true, chat false (the template writes
    them); either may be set."""
    seen, encode = [], tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, add_special_tokens=True: (
        seen.append(add_special_tokens), encode(text, add_special_tokens=add_special_tokens))[1])
    body = completion() if path == "/v1/completions" else {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for given in (None, True, False):
        status, _, resp = post(tokenizer, done(token), body | {"add_special_tokens": given}, path)
        assert status == 200, resp
        assert seen.pop() == (default if given is None else given) and not seen
    status, _, resp = post(tokenizer, done(token), body | {"add_special_tokens": "no"}, path)
    assert_error(status, resp, 400, "add_special_tokens")


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(tokenizer, token):
    """stream_options.continuous_usage_stats (vLLM's), with include_usage: each chunk carries
    the usage so far; without include_usage, none do. Other stream_options keys are a 400."""
    script = [TokenEvent([token]), TokenEvent([token]),
              TokenEvent([token], finished=True, finish_reason="length")]
    prompt = len(tokenizer.encode("hi"))
    options = {"include_usage": True, "continuous_usage_stats": True}
    status, _, text = post(tokenizer, script, completion(stream=True, stream_options=options))
    assert status == 200, text
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]  # last: usage's own
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
    # per choice, as vLLM counts: its own prompt and tokens so far
    status, _, text = post(tokenizer, script, completion(
        stream=True, stream_options=options, n=2, prompt=["hi", "hello there"]))
    chunks = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n")
              if e and e != "data: [DONE]"]
    seen = {}
    for c in chunks[:-1]:
        i = c["choices"][0]["index"]
        seen[i] = seen.get(i, 0) + 1
        assert c["usage"]["completion_tokens"] == seen[i], c
        assert c["usage"]["prompt_tokens"] == len(tokenizer.encode(["hi", "hello there"][i // 2]))
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and seen == dict.fromkeys(range(4), 3)
    status, _, text = post(tokenizer, script, completion(stream=True, stream_options={
        "continuous_usage_stats": True}))
    assert "usage" not in json.loads(text.split("\n\n")[0].removeprefix("data: "))
    status, _, resp = post(tokenizer, script, completion(stream=True, stream_options={
        "continuous_usage_stats": "yes"}))
    assert_error(status, resp, 400, "stream_options.continuous_usage_stats")
    status, _, resp = post(tokenizer, script, completion(stream=True, stream_options={
        "include_usage": True, "every_chunk": True}))
    assert_error(status, resp, 400, "stream_options.every_chunk", "not supported")


# ---- the source's errors -------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_source_rejection_keeps_its_status_and_retry_after(tokenizer, stream, n):
    full = [TokenEvent([], finished=True, error="the gateway's queue is full", status=429,
                       retry_after=1.2)]
    status, headers, body = post(tokenizer, full, completion(stream=stream, n=n))
    assert_error(status, body, 429, message="queue is full", type="rate_limit_error")
    assert headers["Retry-After"] == "2"
    busy = [TokenEvent([], finished=True, error="no workers", status=503, retry_after=10)]
    status, headers, body = post(tokenizer, busy, completion(stream=stream, n=n))
    assert_error(status, body, 503, message="no workers", type="service_unavailable")
    assert headers["Retry-After"] == "10"
    never = [TokenEvent([], finished=True, error="prompt can never fit", status=400)]
    status, headers, body = post(tokenizer, never, completion(stream=stream, n=n))
    assert_error(status, body, 400, message="prompt can never fit")
    assert "Retry-After" not in headers


def test_source_failure_without_a_status_is_500(tokenizer):
    died = [TokenEvent([], finished=True, error="decode worker 3 died")]
    for stream in (False, True):
        status, headers, body = post(tokenizer, died, completion(stream=stream))
        assert_error(status, body, 500, message="decode worker 3 died", type="server_error")
        assert "Retry-After" not in headers


def test_error_after_the_first_token_is_an_sse_event(tokenizer, token):
    script = [TokenEvent([token]), TokenEvent([token]),
              TokenEvent([], finished=True, error="decode worker 3 died", status=503)]
    status, headers, text = post(tokenizer, script, completion(stream=True))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == " hello hello"
    error = json.loads(events[-2])["error"]
    assert "decode worker 3 died" in error["message"] and error["type"] == "service_unavailable"


# ---- CORS (--allowed-origins) ----------------------------------------------------------------
APP_ORIGIN = "https://app.example.com"
PREFLIGHT = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def test_an_allowed_origins_preflight_is_answered_before_the_key(tokenizer):
    status, headers, _ = call(tokenizer, [], "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT,
                              api_key="k", allowed_origins=(APP_ORIGIN,))
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == APP_ORIGIN and headers["Vary"] == "Origin"
    assert headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    assert "POST" in headers["Access-Control-Allow-Methods"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_allowed_origin_can_read_answers_streams_and_errors(tokenizer, token, stream):
    origin = {"Origin": APP_ORIGIN}
    for key, want in (("k", 200), ("wrong", 401)):
        status, headers, _ = call(tokenizer, done(token), "POST", "/v1/completions",
                                  completion(stream=stream), origin | {"Authorization": f"Bearer {key}"},
                                  api_key="k", allowed_origins=("https://other.example", APP_ORIGIN))
        assert status == want and headers["Access-Control-Allow-Origin"] == APP_ORIGIN
        assert headers["Access-Control-Expose-Headers"] == "Retry-After"


def test_other_origins_get_no_cors_headers_and_star_allows_any(tokenizer, token):
    evil = {"Origin": "https://evil.example"}
    for allowed in ((APP_ORIGIN,), ()):
        status, headers, _ = call(tokenizer, done(token), "POST", "/v1/completions", completion(),
                                  evil, allowed_origins=allowed)
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
        status, headers, _ = call(tokenizer, [], "OPTIONS", "/v1/completions",
                                  headers=PREFLIGHT | evil, allowed_origins=allowed)
        assert status == 405 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = call(tokenizer, done(token), "POST", "/v1/completions", completion(),
                              evil, allowed_origins=("*",))
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*" and "Vary" not in headers


# ---- chat history and tool fields as OpenAI clients send them ---------------------------------
def _chat(messages, **fields) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 1} | fields


def test_an_assistant_refusal_part_in_the_history_is_its_text(tokenizer, token):
    """OpenAI returns a refusal as message.refusal; clients send it back as a content part."""
    from pd_serve.gateway.openai_protocol import ModelInfo, parse_chat

    info = ModelInfo(MODEL, tokenizer, 1024)
    history = [{"role": "user", "content": "Do the bad thing."},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
               {"role": "user", "content": "Then say hi."}]
    prompt = tokenizer.decode(parse_chat(_chat(history), info).prompts[0], skip_special_tokens=False)
    assert "I can't help with that." in prompt
    status, _, out = post(tokenizer, done(token), _chat(history), "/v1/chat/completions")
    assert status == 200, out
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
    status, _, out = post(tokenizer, done(token), _chat(user_refusal), "/v1/chat/completions")
    assert status == 400 and out["error"]["param"] == "messages[0].content[0]", out


@pytest.mark.parametrize("value", ["yes", 1, [True]])
def test_a_non_boolean_parallel_tool_calls_is_400(tokenizer, token, value):
    for path, body in (("/v1/chat/completions", _chat([{"role": "user", "content": "hi"}])),
                       ("/v1/completions", completion())):
        status, _, out = post(tokenizer, done(token), body | {"parallel_tool_calls": value}, path)
        assert status == 400 and out["error"]["param"] == "parallel_tool_calls", out
    status, _, out = post(tokenizer, done(token), completion(parallel_tool_calls=False))
    assert status == 200, out


def test_access_log_leaves_out_the_quiet_paths(tokenizer, token, caplog):
    """--disable-access-log-for-endpoints (vLLM's flag): requests to those paths get no access
    line (launch's start-up polls of /health wrote five a second); others still do."""
    async def go():
        app = build_app(ScriptedSource(done(token)), tokenizer)
        runner = await start_server(app, "127.0.0.1", 0, quiet_paths=("/health",))
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                for path in ("/health", "/v1/models", "/health"):
                    async with session.get(f"http://127.0.0.1:{port}{path}") as r:
                        await r.read()
        finally:
            await runner.cleanup()
    with caplog.at_level("INFO", logger="aiohttp.access"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert len(lines) == 1 and "GET /v1/models" in lines[0], lines


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_names_the_stop_string_or_token_id(tokenizer, token, stream):
    """vLLM's stop_reason on each choice: the stop string found, the stop_token_ids entry that
    ended the output, null for an EOS or length."""
    eos = next(iter(tokenizer.eos_token_ids))
    other = tokenizer.encode(" world", add_special_tokens=False)[0]

    def stop_reason(script, **fields):
        status, _, resp = post(tokenizer, script, completion(stream=stream, **fields))
        assert status == 200, resp
        if not stream:
            return resp["choices"][0]["stop_reason"], resp["choices"][0]["finish_reason"]
        chunks = [json.loads(e.removeprefix("data: ")) for e in resp.split("\n\n")
                  if e and e != "data: [DONE]"]
        last = chunks[-1]["choices"][0]
        return last["stop_reason"], last["finish_reason"]

    by_token = [TokenEvent([token]), TokenEvent([other], finished=True, finish_reason="stop")]
    assert stop_reason(by_token, stop_token_ids=[other]) == (other, "stop")
    by_eos = [TokenEvent([token]), TokenEvent([eos], finished=True, finish_reason="stop")]
    assert stop_reason(by_eos, stop_token_ids=[other]) == (None, "stop")
    assert stop_reason(by_eos, stop_token_ids=[eos]) == (None, "stop")  # an EOS first (vLLM)
    long = [TokenEvent([token]), TokenEvent([other]), TokenEvent([token], finished=True,
                                                                 finish_reason="length")]
    assert stop_reason(long, stop=["wor", "zzz"]) == ("wor", "stop")
    assert stop_reason(long) == (None, "length")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(tokenizer, path):
    """vLLM's return_tokens_as_token_ids: logprobs' tokens and top alternatives are
    "token_id:N", so byte pieces that all decode to U+FFFD stay apart (they collided as
    completions' top_logprobs keys)."""
    pieces = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == "\ufffd"][:3]
    assert len(pieces) == 3
    logprob = Logprob(pieces[0], -0.5, [(pieces[0], -0.5), (pieces[1], -1.0), (pieces[2], -2.0)])
    script = [TokenEvent([pieces[0]], logprobs=[logprob], finished=True, finish_reason="length")]
    names = [f"token_id:{t}" for t in pieces]
    if path == "/v1/completions":
        body = completion(logprobs=3)
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "logprobs": True, "top_logprobs": 3}
    status, _, plain = post(tokenizer, script, body, path)
    status, _, resp = post(tokenizer, script, body | {"return_tokens_as_token_ids": True}, path)
    assert status == 200, resp
    lp = resp["choices"][0]["logprobs"]
    if path == "/v1/completions":
        assert lp["tokens"] == names[:1] and list(lp["top_logprobs"][0]) == names
        assert len(plain["choices"][0]["logprobs"]["top_logprobs"][0]) == 1  # (collided)
    else:
        entry = lp["content"][0]
        assert entry["token"] == names[0] and [t["token"] for t in entry["top_logprobs"]] == names


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",  # a NUL in a header
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 200_000 + b"\r\n\r\n",  # too long
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",  # both lengths (request smuggling)
])
def test_a_malformed_request_is_a_400_and_one_log_line(tokenizer, token, caplog, head):
    """A request that does not parse as HTTP gets a 400 and one warning line, not aiohttp's
    ERROR record with a traceback per request (a red-team pass)."""
    async def go():
        app = build_app(ScriptedSource(done(token)), tokenizer)
        runner = await start_server(app, "127.0.0.1", 0)
        port = runner.addresses[0][1]
        try:
            return await until_closed(port, head)
        finally:
            await runner.cleanup()
    with caplog.at_level("INFO", logger="aiohttp.server"):
        answer = asyncio.run(go())
    assert answer.split(b"\r\n", 1)[0].endswith(b"400 Bad Request"), answer[:200]
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 1 and records[0].levelname == "WARNING", records
    assert records[0].exc_info is None and "malformed HTTP request" in records[0].getMessage()
    assert "\n" not in records[0].getMessage()


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_before_the_final_event_adds_no_text(tokenizer, token, stream):
    """Disaggregated, prefill sends token 1 and decode ends the request on it with an empty
    final event: a stop token there adds no text and is the stop_reason, as when it comes in
    the final event (colocated); not while min_tokens holds stops off (review)."""
    other = tokenizer.encode(" world", add_special_tokens=False)[0]
    script = [TokenEvent([other]), TokenEvent([], finished=True, finish_reason="stop")]

    def answer(**fields):
        status, _, resp = post(tokenizer, script, completion(stream=stream, **fields))
        assert status == 200, resp
        if not stream:
            choice = resp["choices"][0]
            return choice["text"], choice["stop_reason"]
        chunks = [json.loads(e.removeprefix("data: ")) for e in resp.split("\n\n")
                  if e and e != "data: [DONE]"]
        return ("".join(c["choices"][0]["text"] for c in chunks),
                chunks[-1]["choices"][0]["stop_reason"])
    assert answer(stop_token_ids=[other]) == ("", other)
    assert answer(stop_token_ids=[other], include_stop_str_in_output=True) == (" world", other)
    assert answer(stop_token_ids=[other], min_tokens=2)[0] == " world"  # (not a stop yet)
