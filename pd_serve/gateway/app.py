"""The gateway's aiohttp application: OpenAI routes over a TokenSource, plus whatever a caller adds.

    app = build_app(EngineSource(AsyncEngine(engine), name="default"), engine.tokenizer)
    runner = await start_server(app, "127.0.0.1", 8000)   # ...; await runner.cleanup()

Every error leaves as OpenAI's JSON error body, aiohttp's own (404, 405, 413) included; with an
API key, every path but OPEN_PATHS needs "Authorization: Bearer <key>". With allowed origins
(CORS, for browser apps), responses to them carry Access-Control-Allow-Origin, streams and
errors included, and their preflight OPTIONS requests are answered before the key is checked.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
from typing import Callable, Iterable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_log import AccessLogger

from pd_serve.config import GatewayConfig
from pd_serve.gateway.openai_api import MAX_BODY_BYTES, OpenAIServer, error_response
from pd_serve.gateway.openai_protocol import ApiError
from pd_serve.gateway.source import TokenSource
from pd_serve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

APP_KEY_OPENAI = web.AppKey("openai", OpenAIServer)
OPEN_PATHS = ("/health", "/metrics")  # served without the API key (probes, scrapers)


class _QuietBadRequests(logging.Filter):
    """aiohttp's records of requests a client got a 400 for, which it logs with a traceback at
    ERROR: one per request of any client, key or none.
    - A body its Content-Encoding does not decode: aiohttp reads what a handler left of it
      after the answer (a 401, a 404, our 400 for that very body), hits the decode error
      again and closes the connection. Dropped.
    - A request that does not parse as HTTP (a header too long, a NUL in one, Content-Length
      beside chunked): one warning line (the parser's message without its pointer lines), as
      uvicorn logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, web.RequestPayloadError):
            return False
        if isinstance(error, HttpProcessingError) and record.levelno >= logging.ERROR:
            # (aiohttp logs some, a TLS hello on the port for one, at DEBUG: left as they are)
            record.msg = "malformed HTTP request (400): %s"
            record.args = (str(error.message).splitlines()[0] if error.message else "",)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


logging.getLogger("aiohttp.server").addFilter(_QuietBadRequests())


class _FewAcceptFailures(logging.Filter):
    """Lets through one of asyncio's "socket.accept() out of system resource" records (with
    the count held back) per `every_s`. Out of file descriptors, asyncio logs one, traceback
    and all, at every turn of the loop until one frees: 237,540 records, 105 MB, in 40 s."""

    def __init__(self, every_s: float = 10.0):
        super().__init__()
        self.every_s, self.next_at, self.held_back = every_s, 0.0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("socket.accept() out of system resource"):
            return True
        if record.created < self.next_at:
            self.held_back += 1
            return False
        self.next_at = record.created + self.every_s
        if self.held_back:
            record.msg = f"{record.msg} ({self.held_back} more such records held back)"
            self.held_back = 0
        return True


logging.getLogger("asyncio").addFilter(_FewAcceptFailures())


def raise_open_files_limit(want: int = 65536) -> int:
    """Every client connection takes a file descriptor, and the usual soft limit (1024) is
    soon reached (then no client is served until one leaves): raise it towards the hard limit,
    as SGLang does. Returns the soft limit now."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft, target, e)
    return soft


def request_id_generator() -> Callable[[str], str]:
    """`new_id("cmpl")` -> "cmpl-<32 hex>": a random per-process part, then a counter.

    Unique across gateways (the random part) and within one (the counter), without a uuid per call.
    """
    process_part = secrets.token_hex(8)
    counter = itertools.count()
    return lambda prefix: f"{prefix}-{process_part}{next(counter):016x}"


def build_app(source: TokenSource, tokenizer: Tokenizer,
              extra_routes: Iterable[web.RouteDef] | None = None, *, api_key: str = "",
              body_timeout_s: float = 30.0, send_timeout_s: float = 30.0,
              tool_call_parser: str | None = None,
              reasoning_parser: str | None = None,
              allowed_origins: tuple[str, ...] = ()) -> web.Application:
    """An application serving the OpenAI API from `source`.

    `extra_routes` are added first and win: a route of theirs with the same method and path
    replaces the built-in one (a cluster gateway's own /health, for example). `api_key`, when
    set, is required of every request outside OPEN_PATHS; a body slower than `body_timeout_s`
    is a 408; a reply (a stream, a whole answer, an error) its client leaves unread for
    `send_timeout_s` ends the connection (and aborts the request).
    `tool_call_parser` / `reasoning_parser`: read tool calls (tool_choice auto) and
    reasoning out of chat output (gateway/tool_parsers.py, gateway/reasoning.py; None: off).
    `allowed_origins`: browser origins (or "*") the API answers CORS requests of.
    """
    middlewares = [reply_within(send_timeout_s)] \
        + ([cors_preflight(allowed_origins)] if allowed_origins else []) + [json_errors] \
        + ([require_api_key(api_key)] if api_key else [])
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    if allowed_origins:
        app.on_response_prepare.append(cors_headers(allowed_origins))
    server = OpenAIServer(source, tokenizer, request_id_generator(), body_timeout_s,
                          tool_call_parser, reasoning_parser, send_timeout_s)
    app[APP_KEY_OPENAI] = server
    extra = list(extra_routes or [])
    taken = {(r.method, r.path) for r in extra}
    app.add_routes(extra + [r for r in server.routes() if (r.method, r.path) not in taken])
    return app


def reply_within(timeout_s: float):
    """The outermost middleware: a reply a handler returns unsent (a JSON body, an error, a
    401) is sent here, and a client that reads none of it for `timeout_s` loses the
    connection. aiohttp's own send of it waits for the client without end, and a client that
    pipelines requests and never reads held the connection (and ~6 MB of socket buffers) for
    good, without an API key. Streams and whole completions send themselves, each write so
    bounded (openai_api._write)."""
    @web.middleware
    async def send(request: web.Request, handler) -> web.StreamResponse:
        response = await handler(request)
        if response.prepared:
            return response
        try:
            async with asyncio.timeout(timeout_s):
                await response.prepare(request)
                await response.write_eof()
        except TimeoutError:
            logger.info("%s %s: the client read nothing of the reply for %g s: disconnected",
                        request.method, request.path, timeout_s)
            if request.transport is not None:
                request.transport.abort()
        return response

    return send


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's HTTP errors (no route 404, wrong method 405, body too large 413, ...) and
    unexpected exceptions as OpenAI's JSON error bodies; 405 keeps its Allow header."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        detail = e.text if e.text and e.text != f"{e.status}: {e.reason}" else ""
        message = f"{e.reason} ({request.method} {request.path})" + (f": {detail}" if detail else "")
        headers = {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}
        return error_response(ApiError(message, status=e.status), headers)
    except ConnectionError:
        raise
    except Exception as e:
        logger.exception("%s %s failed", request.method, request.path)
        return error_response(ApiError(f"internal error: {e!r}", status=500))


CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer


def _allowed(origin: str | None, origins: tuple[str, ...]) -> str | None:
    """The Access-Control-Allow-Origin value for a request's Origin header (None: not allowed)."""
    if origin is None:
        return None
    return "*" if "*" in origins else (origin if origin in origins else None)


def cors_preflight(origins: tuple[str, ...]):
    """A middleware answering an allowed origin's preflight (OPTIONS with
    Access-Control-Request-Method) with 204 and what it may send: the API's methods and the
    headers it asked for (Authorization, Content-Type); the browser sends no key on it."""
    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers \
                and _allowed(request.headers.get("Origin"), origins) is not None:
            asked = request.headers.get("Access-Control-Request-Headers", "")
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": asked or "Authorization, Content-Type",
                "Access-Control-Max-Age": str(CORS_MAX_AGE_S)})
        return await handler(request)

    return preflight


def cors_headers(origins: tuple[str, ...]):
    """An on_response_prepare hook: every response to an allowed origin (a stream's before its
    first byte, an error's too) lets the browser read it, Retry-After included."""
    async def add(request: web.Request, response: web.StreamResponse) -> None:
        allow = _allowed(request.headers.get("Origin"), origins)
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            response.headers["Access-Control-Expose-Headers"] = "Retry-After"
            if allow != "*":
                response.headers["Vary"] = "Origin"

    return add


def require_api_key(api_key: str):
    """A middleware answering 401 to a request outside OPEN_PATHS without
    "Authorization: Bearer <api_key>" (the key compared in constant time; the scheme's case
    does not matter, RFC 7235)."""
    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization")
            scheme, _, key = (given or "").partition(" ")
            if given is None or scheme.lower() != "bearer" or not hmac.compare_digest(
                    key.encode("utf-8", "surrogatepass"), expected):
                message = ("Missing API key: send 'Authorization: Bearer <key>'" if given is None
                           else "Incorrect API key provided")
                return error_response(ApiError(message, status=401, code="invalid_api_key"),
                                      {"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def _access_logger(quiet: frozenset[str]) -> type[AccessLogger]:
    """aiohttp's access logger, leaving out requests to the `quiet` paths."""
    class Logger(AccessLogger):
        def log(self, request, response, time: float) -> None:
            if request.path not in quiet:
                super().log(request, response, time)

    return Logger


async def start_server(app: web.Application, host: str, port: int,
                       keep_alive_s: float = GatewayConfig.timeout_keep_alive_s,
                       quiet_paths: tuple[str, ...] = ()) -> web.AppRunner:
    """Serve `app` on host:port from the running event loop; `await runner.cleanup()` stops it.

    Handlers are cancelled when their client disconnects, so a request whose client left
    during a long prefill is aborted at once rather than at its next token. A connection with
    no request running is closed `keep_alive_s` after it opened or its last response ended,
    headers half sent or not (aiohttp's own default, an hour, let idle sockets pile up).
    Requests to `quiet_paths` are left out of the access log.
    """
    runner = web.AppRunner(app, handler_cancellation=True, keepalive_timeout=keep_alive_s,
                           access_log_class=_access_logger(frozenset(quiet_paths)))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
