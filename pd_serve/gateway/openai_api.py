"""OpenAI HTTP handlers: /v1/completions, /v1/chat/completions (stream and not), /v1/models (and
/v1/models/{model}), /health; vLLM's /tokenize and /detokenize (openai_tokenize).

A request is parsed (openai_protocol), handed to a TokenSource as one GenerateSpec per choice
(n choices per prompt; a /v1/completions batch has several prompts), and its TokenEvents become
text (model/output_text: detokenization and stop strings) and OpenAI JSON (chat: reasoning and
tool calls read out of the text by openai_message, with the server's parsers); the choices run
side by side, their chunks interleaved as they come. Every exit path closes the source
iterators, which aborts the requests wherever they run: a stop string (that choice alone), a
client gone mid-stream (a failed write or a cancelled handler), an error (every choice).

Failures carry their HTTP status: a bad request 400, a full queue 429, no capacity 503 (with
Retry-After where the source gives one). A stream starts only once its first token is there,
so a request that fails before that gets its real status; later failures are SSE error events.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from aiohttp import web

from pd_serve.gateway.openai_message import ChatOutput
from pd_serve.gateway.openai_protocol import (ApiError, ModelInfo, ParsedRequest, decode_body,
                                              model_not_found, parse_chat, parse_completion)
from pd_serve.gateway.openai_tokenize import detokenize, tokenize
from pd_serve.gateway.source import GenerateSpec, TokenSource
from pd_serve.gateway.tool_parsers import NamedParser, RequiredParser, ToolParser, make_parser
from pd_serve.model.output_text import OutputText, stop_reason, stop_token_ends
from pd_serve.model.tokenizer import Tokenizer
from pd_serve.protocol import Logprob

logger = logging.getLogger(__name__)

_WRITE_BYTES = 2**20  # a whole reply goes out in writes of at most this
_MIN_LOGPROB = -9999.0  # -inf is not JSON; clamp as vLLM does
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


class SourceError(Exception):
    """The token source reported a failure (TokenEvent.error) or broke its contract."""

    def __init__(self, message: str, status: int = 500, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


@dataclass
class _Delta:
    """What one TokenEvent adds to the response."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None  # the source's, one per token
    text_offsets: list[int]
    finish_reason: str | None
    timings: dict  # phase timings (s) from the cluster, on the final delta
    cached_tokens: int = 0  # with token 1: prompt tokens whose KV a prefix cache held
    restart: bool = False  # the choice's deltas so far are void (a whole request started over)
    # the first delta of an echo with logprobs: the prompt's ids, and the logprobs of all but its first
    prompt: tuple[list[int], list[Logprob]] | None = None
    stop_reason: str | int | None = None  # vLLM's, on the final delta: the stop string or token id


class OpenAIServer:
    """The OpenAI routes over one TokenSource. `new_request_id(prefix)` names each request;
    a request body that takes longer than `body_timeout_s` to arrive is a 408, and a stream
    whose client reads nothing for `send_timeout_s` is closed (its request aborted).
    tool_call_parser / reasoning_parser: --tool-call-parser / --reasoning-parser (None: off)."""

    def __init__(self, source: TokenSource, tokenizer: Tokenizer,
                 new_request_id: Callable[[str], str], body_timeout_s: float = 30.0,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 send_timeout_s: float = 30.0):
        self.source = source
        self.tokenizer = tokenizer
        self.new_request_id = new_request_id
        self.body_timeout_s = body_timeout_s
        self.send_timeout_s = send_timeout_s
        self._large_bodies = BodyBudget(LARGE_BODIES_BYTES)
        self.created = int(time.time())
        if tool_call_parser is not None:
            make_parser(tool_call_parser)  # an unknown name fails here, not per request
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser

    def _model_info(self) -> ModelInfo:
        return ModelInfo(self.source.model_name(), self.tokenizer, self.source.max_model_len(),
                         self.tool_call_parser)

    def _chat_output(self, parsed: ParsedRequest) -> ChatOutput:
        """A reader of one chat choice's text, as the request and the server's parsers ask."""
        choice = parsed.tool_choice
        tools: ToolParser | None = None
        if choice is not None:
            tools = (make_parser(self.tool_call_parser) if choice.mode == "auto" else
                     RequiredParser() if choice.mode == "required" else NamedParser(choice.name))
        # A forced call is JSON from the first token on: no reasoning to split out of it. Any
        # other grammar's output is reasoning only where it opens <think> itself.
        reasoning = self.reasoning_parser if choice is None or choice.mode == "auto" else None
        return ChatOutput(reasoning, parsed.prompt_opens_reasoning, tools,
                          constrained=parsed.params.grammar is not None,
                          max_calls=None if choice is None or choice.parallel else 1)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.model),  # a name may hold "/"
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/health", self.health)]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve (GET /v1/models/{model}): the served model's card, else a 404."""
        name = request.match_info["model"]
        if name != self.source.model_name():
            return error_response(model_not_found(name, self.source.model_name()))
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.source.model_name(), "object": "model", "created": self.created,
                "owned_by": "pd-serve", "max_model_len": self.source.max_model_len()}

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, tokenize)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, detokenize)

    async def _answer(self, request: web.Request, answer) -> web.Response:
        """A reply computed from the body alone (no tokens generated)."""
        try:
            info = self._model_info()
            async with self._large_bodies.hold(request, self.body_timeout_s):
                body = await _read_json(request, self.body_timeout_s)
                # serialized there too: /tokenize's reply with token strings is tens of MB of JSON
                reply = await asyncio.to_thread(lambda: json.dumps(answer(body, info)).encode())
            return web.Response(body=reply, content_type="application/json", charset="utf-8")
        except ApiError as e:
            return error_response(e)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion, _CompletionShape, "cmpl")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat, _ChatShape, "chatcmpl")

    # ---- one request ---------------------------------------------------------------------
    async def _serve(self, request: web.Request, parse, shape_cls, id_prefix: str) -> web.StreamResponse:
        try:
            info = self._model_info()
            async with self._large_bodies.hold(request, self.body_timeout_s):
                body = await _read_json(request, self.body_timeout_s)
                # off the event loop: a long prompt's tokenization (or a grammar's check) takes
                # seconds, and every stream and /health would wait for it
                parsed = await asyncio.to_thread(parse, body, info)
                del body
        except ApiError as e:
            return error_response(e)
        choices = parsed.choices()
        limit = self.source.max_choices()
        if limit is not None and len(choices) > limit:
            return error_response(ApiError(
                f"this request has {len(choices)} choices (n x prompts); the gateway takes at "
                f"most {limit} at once (--max-queued-requests / --max-outstanding-requests)", "n"))
        if parsed.priority and not self.source.priority_scheduling():
            return error_response(ApiError(
                f"priority={parsed.priority} is honoured only by workers started with "
                "--schedule-policy priority; leave it out (or 0) here", "priority"))
        request_id = self.new_request_id(id_prefix)
        shape = shape_cls(request_id, info.name, self.tokenizer, parsed.tokens_as_ids)
        if isinstance(shape, _ChatShape):
            shape.outputs = [self._chat_output(parsed) for _ in choices]
        specs = [GenerateSpec(request_id if len(choices) == 1 else f"{request_id}-{i}", ids,
                              params, parsed.priority, whole=not parsed.stream)
                 for i, (ids, params) in enumerate(choices)]
        echoes = [parsed.echo_texts[i // parsed.n] if parsed.echo_texts else ""
                  for i in range(len(specs))]
        deltas = _merged([self._run(spec, parsed, echo) for spec, echo in zip(specs, echoes)])
        if parsed.stream:
            return await self._stream(request, deltas, shape, parsed, len(specs))
        return await self._complete(request, deltas, shape, parsed, len(specs))

    async def _run(self, spec: GenerateSpec, parsed: ParsedRequest, echo: str = "") -> AsyncIterator[_Delta]:
        """The source's events as text deltas; ends at the first finish (stop string included).
        echo: text put in front of the first delta (completions' echo: the prompt)."""
        def output() -> OutputText:
            params = spec.params
            return OutputText(self.tokenizer, spec.prompt_token_ids, params.stop,
                              params.skip_special_tokens, params.min_tokens,
                              params.include_stop_str_in_output)
        out, first_echo, first = output(), echo, True
        params, eos = spec.params, self.tokenizer.eos_token_ids
        last_id = None  # the last token taken (a stop token may end the output an event later)
        events = self.source.generate(spec)
        ended = False  # the source sent its last event (or an error): it saw how this ended
        try:
            async for event in events:
                ended = event.finished or bool(event.error)
                if event.error:
                    raise SourceError(event.error, event.status, event.retry_after)
                if event.restart:  # the text so far is void: it starts over
                    out, echo, first, last_id = output(), first_echo, True, None
                    yield _Delta("", [], None, [], None, {}, restart=True)
                    continue
                ids = event.new_token_ids
                if parsed.echo_only:  # the prompt, its scores, no token (ParsedRequest)
                    if ids:  # the prompt was computed
                        yield _Delta(echo, [], None, [], "length", event.timings,
                                     event.cached_tokens, prompt=self._prompt_logprobs(spec, event))
                        return
                    if event.finished:  # ended without it (an abort): as it ended
                        yield _Delta(echo, [], None, [], event.finish_reason or "abort",
                                     event.timings, event.cached_tokens)
                        return
                    continue
                # a stop token that ends the output adds no text, also when it comes before the
                # final event (prefill's token 1, which decode then ends the request on)
                hide = (bool(ids) and event.finish_reason in (None, "stop")
                        and not params.include_stop_str_in_output  # (hides_stop_token's rule)
                        and stop_token_ends(params, ids[-1], len(out.token_offsets) + len(ids), eos))
                n = out.add(ids, hide_last=hide)
                last_id = ids[n - 1] if n else last_id
                finish = "stop" if out.stopped else (
                    (event.finish_reason or "stop") if event.finished else None)
                logprobs = event.logprobs[:n] if parsed.logprobs is not None and event.logprobs else None
                prompt = self._prompt_logprobs(spec, event) if first and ids else None
                first = first and not ids
                text, echo = echo + out.take_delta(finish is not None), ""
                why = stop_reason(out.stop_string, params, last_id, eos) if finish == "stop" else None
                yield _Delta(text, event.new_token_ids[:n], logprobs,
                             [len(first_echo) + o for o in out.token_offsets[len(out.token_offsets) - n:]],
                             finish, event.timings, event.cached_tokens, prompt=prompt,
                             stop_reason=why)
                if finish is not None:
                    return
            raise SourceError("the token source ended without a final event")
        finally:  # a stop string, a closed client or an error: the source aborts the request
            if not ended:
                self.source.closed_early("stop" if out.stopped else "abort")
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    @staticmethod
    def _prompt_logprobs(spec: GenerateSpec, event) -> tuple[list[int], list[Logprob]] | None:
        """(prompt ids, their logprobs) from a request's first event, if it asked for them."""
        if spec.params.prompt_logprobs is None:
            return None
        ids, scored = spec.prompt_token_ids, event.prompt_logprobs
        if scored is None or len(scored) != len(ids) - 1 or any(
                lp.token_id != t for lp, t in zip(scored, ids[1:])):
            raise SourceError(f"the worker's prompt logprobs do not match the {len(ids)}-token prompt")
        return ids, scored

    async def _complete(self, request: web.Request, deltas: AsyncIterator[tuple[int, _Delta]],
                        shape, parsed: ParsedRequest, num_choices: int) -> web.StreamResponse:
        received: list[list[_Delta]] = [[] for _ in range(num_choices)]  # each choice's deltas
        try:
            async with aclosing(deltas):
                async for i, d in deltas:
                    if d.restart:
                        received[i].clear()
                    else:
                        received[i].append(d)
                    if _client_gone(request):
                        logger.info("%s: client gone; request aborted", shape.id)
                        return web.Response(status=499)
        except Exception as e:
            return error_response(_api_error(e, shape.id))
        # The body is built and serialized a choice at a time, in a worker thread: n=128 with
        # top-20 logprobs of long outputs is hundreds of MB of JSON (~1.4 s of CPU for one
        # 8k-token chat choice), which on the event loop stalled every stream and /health for
        # as long. A choice's deltas are let go once it is JSON, and the parts go out as they
        # are (Content-Length from their sum), never joined into one copy of the body.
        cached = _cached_tokens([sum(d.cached_tokens for d in ds) for ds in received], parsed.n)
        timings = next((d.timings for d in reversed(received[0]) if d.timings), None)

        # a prompt's scores came with its first choice (ParsedRequest.choices)
        scored = [next((d.prompt for d in received[i - i % parsed.n] if d.prompt), None)
                  for i in range(num_choices)]

        def serialize(i: int, ds: list[_Delta]) -> bytes:
            prompt = scored[i]
            lp = shape.logprobs([e for d in ds for e in d.logprobs or []],
                                [o for d in ds for o in d.text_offsets], parsed.logprobs,
                                prompt if parsed.echo_texts is not None else None) \
                if parsed.logprobs is not None else None
            choice = shape.choice(i, "".join(d.text for d in ds), lp, ds[-1].finish_reason)
            choice["stop_reason"] = ds[-1].stop_reason  # (vLLM's)
            if parsed.prompt_logprobs is not None and shape.prompt_logprobs_per_choice:
                choice["prompt_logprobs"] = shape.prompt_logprobs(prompt, parsed.prompt_logprobs)
            return json.dumps(choice).encode()

        num_tokens = sum(len(d.token_ids) for ds in received for d in ds)
        body = shape.response([], _usage(sum(map(len, parsed.prompts)), num_tokens, cached))
        if timings:  # pd-serve's extension: where the first choice's time went (queue, prefill, ...)
            body["timings"] = timings
        if parsed.prompt_logprobs is not None and not shape.prompt_logprobs_per_choice:
            body["prompt_logprobs"] = await asyncio.to_thread(shape.prompt_logprobs, scored[0],
                                                              parsed.prompt_logprobs)
        head, tail = json.dumps(body).encode().split(b'"choices": []', 1)  # (unescaped in a string)
        parts = [head + b'"choices": [']
        for i, ds in enumerate(received):  # every choice ended with a final delta
            received[i] = []
            parts += [b", "] if i else []
            parts.append(await asyncio.to_thread(serialize, i, ds))
        parts.append(b"]" + tail)
        response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
        response.content_length = sum(map(len, parts))
        try:
            await response.prepare(request)
            for i, part in enumerate(parts):
                parts[i] = b""
                view = memoryview(part)  # in slices: the transport copies what it buffers
                for k in range(0, len(view), _WRITE_BYTES):
                    await _write(response, view[k:k + _WRITE_BYTES], self.send_timeout_s)
            await response.write_eof()
        except ConnectionResetError as e:  # the client left or reads nothing
            logger.info("%s: %s", shape.id, e or "client gone before the reply's end")
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _stream(self, request: web.Request, deltas: AsyncIterator[tuple[int, _Delta]], shape,
                      parsed: ParsedRequest, num_choices: int) -> web.StreamResponse:
        num_prompt = sum(map(len, parsed.prompts))

        def extra(i: int) -> dict:  # choice i's chunks' usage: none, null, or (continuous_usage)
            if not parsed.include_usage:  # its own so far, as vLLM counts it
                return {}
            return {"usage": _usage(len(parsed.prompts[i // parsed.n]), tokens[i], cached[i])
                    if parsed.continuous_usage else None}

        def render(i: int, d: _Delta) -> list[bytes]:  # (no prompt_logprobs: not with stream)
            lp = shape.logprobs(d.logprobs or [], d.text_offsets, parsed.logprobs,
                                d.prompt) if parsed.logprobs is not None else None
            chunks = shape.chunks(i, d.text, lp, d.finish_reason)
            if chunks and d.finish_reason:
                chunks[-1]["choices"][0]["stop_reason"] = d.stop_reason  # (vLLM's)
                if d.timings:  # pd-serve's extension, as in a whole reply
                    chunks[-1]["timings"] = d.timings
            usage = extra(i)
            return [_event(chunk | usage) for chunk in chunks]

        tokens, cached = [0] * num_choices, [0] * num_choices  # per choice
        async with aclosing(deltas):
            try:  # the first delta before the 200: a request failing before it gets its status
                item = await anext(deltas)
            except Exception as e:
                return error_response(_api_error(e, shape.id))
            response = web.StreamResponse(headers=_SSE_HEADERS)
            write = functools.partial(_write, response, timeout_s=self.send_timeout_s)
            try:
                await response.prepare(request)
                try:
                    for i in range(num_choices):
                        for chunk in shape.opening_chunks(i):
                            await write(_event(chunk | extra(i)))
                    while item is not None:
                        i, d = item
                        tokens[i] += len(d.token_ids)
                        cached[i] += d.cached_tokens
                        if d.text or d.logprobs or d.finish_reason:  # else nothing visible yet
                            # echo's prompt logprobs (up to MAX_PROMPT_LOGPROB_ENTRIES entries,
                            # seconds of CPU) are rendered off the event loop
                            events = await asyncio.to_thread(render, i, d) if d.prompt \
                                else render(i, d)
                            for event in events:
                                await write(event)
                        item = await anext(deltas, None)
                    if parsed.include_usage:
                        usage = _usage(num_prompt, sum(tokens), _cached_tokens(cached, parsed.n))
                        await write(_event(shape.usage_chunk(usage)))
                except ConnectionResetError:
                    raise
                except Exception as e:
                    await write(_event(_api_error(e, shape.id).body()))
                await write(b"data: [DONE]\n\n")
            except ConnectionResetError as e:  # the client left or reads nothing: closing
                # `deltas` aborts the request; the connection is dropped with what it buffers
                logger.info("%s: %s; request aborted", shape.id, e or "client gone mid-stream")
                if request.transport is not None:
                    request.transport.abort()
        return response


async def _merged(streams: list[AsyncIterator[_Delta]]) -> AsyncIterator[tuple[int, _Delta]]:
    """(choice index, delta) from every stream as they come, each stream pumped by its own task
    through a bounded queue. The first error is raised here; closing this (or an error) closes
    every stream, which aborts what is still running."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: AsyncIterator[_Delta]) -> None:
        try:
            async with aclosing(stream):
                async for delta in stream:
                    await queue.put((index, delta, None))
            await queue.put((index, None, None))  # this stream is done
        except Exception as e:  # (a cancellation passes through)
            await queue.put((index, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                running -= 1
            else:
                yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- response shapes -----------------------------------------------------------------------
class _Shape:
    """JSON of one response: ids, chunk and final layouts, logprobs format."""

    object = chunk_object = ""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, tokens_as_ids: bool = False):
        """tokens_as_ids: logprobs name tokens "token_id:N" (ParsedRequest.tokens_as_ids)."""
        self.id, self.model, self.tokenizer = request_id, model, tokenizer
        self.tokens_as_ids = tokens_as_ids
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def opening_chunks(self, index: int) -> list[dict]:
        return []

    def usage_chunk(self, usage: dict) -> dict:
        return self._head(self.chunk_object) | {"choices": [], "usage": usage}

    def response(self, choices: list[dict], usage: dict) -> dict:
        return self._head(self.object) | {"choices": choices, "usage": usage}

    def _token(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_logprobs(self, prompt: tuple[list[int], list[Logprob]], num_top: int) -> list:
        """vLLM's prompt_logprobs: null for the first token (nothing precedes it), then per
        token {id: {logprob, rank, decoded_token}}, the token itself first, then its top
        num_top (ranks 1..num_top), each id once."""
        out: list[dict | None] = [None]
        for entry in prompt[1]:
            ranked = {str(entry.token_id): self._ranked(entry.token_id, entry.logprob, entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top[:num_top], 1):
                ranked.setdefault(str(token_id), self._ranked(token_id, logprob, rank))
            out.append(ranked)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": _clamp(logprob), "rank": rank, "decoded_token": self._token(token_id)}


class _CompletionShape(_Shape):
    object = chunk_object = "text_completion"
    prompt_logprobs_per_choice = True  # (vLLM's place for them; chat's: the response)

    def chunks(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> list[dict]:
        return [self._head(self.object) | {"choices": [self.choice(index, text, logprobs, finish_reason)]}]

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, entries: list[Logprob], offsets: list[int], num_top: int,
                 prompt: tuple[list[int], list[Logprob]] | None = None) -> dict:
        """OpenAI's legacy format: parallel lists, top alternatives as {token: logprob} with the
        sampled token among them (OpenAI's "up to logprobs + 1" entries; vLLM's too). With
        echo, the prompt's tokens come first, the first with null entries (nothing precedes
        it), each offset where the token's text starts in the echoed prompt, as the output's
        are (a token that ends inside a character starts where that character will)."""
        out = {"tokens": [self._token(e.token_id) for e in entries],
               "token_logprobs": [_clamp(e.logprob) for e in entries],
               "top_logprobs": [self._top(e, num_top) for e in entries],
               "text_offset": list(offsets)}
        if prompt is None:
            return out
        ids, scored = prompt
        tokens = [self._token(t) for t in ids]
        return {"tokens": tokens + out["tokens"],
                "token_logprobs": [None] + [_clamp(e.logprob) for e in scored] + out["token_logprobs"],
                "top_logprobs": [None] + [self._top(e, num_top) for e in scored] + out["top_logprobs"],
                "text_offset": self._offsets(ids) + out["text_offset"]}

    def _offsets(self, ids: list[int]) -> list[int]:
        """Where each token's text starts in the prompt's text, as OutputText finds the output's."""
        text = OutputText(self.tokenizer, [], [], skip_special_tokens=False)
        text.add(ids)
        return text.token_offsets

    def _top(self, entry: Logprob, num_top: int) -> dict[str, float]:
        top = {self._token(t): _clamp(lp) for t, lp in entry.top[:num_top]}
        top.setdefault(self._token(entry.token_id), _clamp(entry.logprob))
        return top


class _ChatShape(_Shape):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    prompt_logprobs_per_choice = False

    outputs: list[ChatOutput]  # per choice: its text read for reasoning and tool calls

    def opening_chunks(self, index: int) -> list[dict]:
        return [self._chunk(index, {"role": "assistant", "content": ""}, None, None)]

    def chunks(self, index: int, text: str, logprobs: dict | None,
               finish_reason: str | None) -> list[dict]:
        """The stream chunks of the next text: logprobs on the first, finish_reason on the last."""
        output = self.outputs[index]
        deltas = output.deltas(text, finish_reason is not None)
        if not deltas and (logprobs is not None or finish_reason is not None):
            deltas = [{}]
        finish_reason = _finish_reason(finish_reason,
                                       output.num_calls if output.calls_finish else 0)
        return [self._chunk(index, delta, logprobs if j == 0 else None,
                            finish_reason if j == len(deltas) - 1 else None)
                for j, delta in enumerate(deltas)]

    def _chunk(self, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._head(self.chunk_object) | {"choices": [choice]}

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        output = self.outputs[index]
        message = output.message(text)
        num_calls = len(message.get("tool_calls", ())) if output.calls_finish else 0
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": _finish_reason(finish_reason, num_calls)}

    def logprobs(self, entries: list[Logprob], offsets: list[int], num_top: int, prompt=None) -> dict:
        return {"content": [self._entry(e.token_id, e.logprob)
                            | {"top_logprobs": [self._entry(t, lp) for t, lp in e.top[:num_top]]}
                            for e in entries]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        """bytes: the token's own (a piece of a character too, where `token` shows U+FFFD)."""
        return {"token": self._token(token_id), "logprob": _clamp(logprob),
                "bytes": list(self.tokenizer.token_bytes(token_id))}


# ---- helpers -------------------------------------------------------------------------------
MAX_BODY_BYTES = 32 * 2**20  # of a request body (a 128k-token prompt as ids is ~1 MiB of JSON)
LARGE_BODY_BYTES = 2**20  # a body larger than this (or of unknown length) counts against:
LARGE_BODIES_BYTES = 2**27  # the bytes of large bodies read and parsed at once, all clients'


class BodyBudget:
    """Bounds the memory of large request bodies held at once. A body is read, decoded and
    parsed (a chat template rendered, a prompt tokenized) with its declared length (chunked:
    the body limit) held here: parsed JSON takes up to ~20x its bytes, and without a bound
    thirty clients uploading 32 MB each took a gateway from 0.3 to 1.3 GB, eight 30 MB chats
    of 900k messages to 3.7 GB. Small bodies (every usual request) pass freely; a large one
    waits its turn, within the body timeout (then a 503 to retry)."""

    def __init__(self, total: int):
        self.total = self.free = total
        self._waiters: list[asyncio.Future] = []

    @asynccontextmanager
    async def hold(self, request: web.Request, timeout_s: float):
        length = request.content_length  # None: chunked, as long as the limit allows
        if length is not None and length <= LARGE_BODY_BYTES:
            yield
            return
        size = min(MAX_BODY_BYTES if length is None else length, self.total)
        try:
            async with asyncio.timeout(timeout_s):
                while self.free < size:
                    waiter = asyncio.get_running_loop().create_future()
                    self._waiters.append(waiter)
                    try:
                        await waiter
                    finally:
                        self._waiters.remove(waiter)
        except TimeoutError:
            raise ApiError(f"the gateway is reading {self.total // 2**20} MiB of large request "
                           f"bodies already; retry", status=503, retry_after=1) from None
        self.free -= size
        try:
            yield
        finally:
            self.free += size
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)


async def _read_json(request: web.Request, timeout_s: float):
    """The body's JSON, read within `timeout_s` (a stalled upload must not hold a handler)."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(f"the request body did not arrive within {timeout_s:g} s", status=408) from None
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(f"request body too large: {e.text}", status=413) from None
    except web.RequestPayloadError as e:  # e.g. a Content-Encoding the body does not decode by
        raise ApiError(f"the request body could not be read: {e}") from None
    return await asyncio.to_thread(decode_body, raw) if len(raw) > 2**20 else decode_body(raw)


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def _write(response: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """One SSE event (or a slice of a whole reply) out. A client that has read none of what is
    buffered for timeout_s is taken as gone (ConnectionResetError, as when it leaves): it holds
    no request for longer."""
    try:
        async with asyncio.timeout(timeout_s):
            await response.write(data)
    except TimeoutError:
        raise ConnectionResetError(f"the client read nothing for {timeout_s:g} s") from None


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _api_error(exc: Exception, request_id: str) -> ApiError:
    """What a failure while generating becomes: the source's error with the status it names,
    a prompt the engine rejects 400, anything else (a bug) 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValueError):
        return ApiError(str(exc))
    if isinstance(exc, SourceError):
        status = exc.status if 400 <= exc.status < 600 else 500
        message = str(exc) if status < 500 else f"generation failed: {exc}"
        return ApiError(message, status=status, retry_after=exc.retry_after)
    logger.exception("%s: generation failed", request_id, exc_info=exc)
    return ApiError(f"generation failed: {exc}", status=500)


def error_response(error: ApiError, headers: dict | None = None) -> web.Response:
    """The error as OpenAI's JSON body with its status, and Retry-After (whole seconds) if set."""
    headers = dict(headers or {})
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(0, math.ceil(error.retry_after)))
    response = web.json_response(error.body(), status=error.status, headers=headers)
    if error.status in (408, 413):  # the body was left unread: the connection cannot go on
        response.force_close()
    return response


def _finish_reason(reason: str | None, num_tool_calls: int) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended by itself with calls in it."""
    return "tool_calls" if reason == "stop" and num_tool_calls else reason


def _usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def _cached_tokens(per_choice: list[int], n: int) -> int:
    """Prompt tokens whose KV a prefix cache held (prefill's, or the colocated worker's), counted
    once per prompt as prompt_tokens is: by each prompt's first choice (choice i is prompt i // n's)."""
    return sum(per_choice[::n])


def _clamp(logprob: float) -> float:
    return max(float(logprob), _MIN_LOGPROB)
