"""The gateway's aiohttp application: OpenAI routes over a TokenSource, plus whatever a caller adds.

    app = build_app(EngineSource(AsyncEngine(engine), name="default"), engine.tokenizer)
    runner = await start_server(app, "127.0.0.1", 8000)   # ...; await runner.cleanup()
"""

from __future__ import annotations

import itertools
import secrets
from typing import Callable, Iterable

from aiohttp import web

from pd_serve.gateway.openai_api import OpenAIServer
from pd_serve.gateway.source import TokenSource
from pd_serve.model.tokenizer import Tokenizer

CLIENT_MAX_SIZE = 32 * 2**20  # bytes of request body; a 128k-token prompt as ids is ~1 MiB of JSON
APP_KEY_OPENAI = web.AppKey("openai", OpenAIServer)


def request_id_generator() -> Callable[[str], str]:
    """`new_id("cmpl")` -> "cmpl-<32 hex>": a random per-process part, then a counter.

    Unique across gateways (the random part) and within one (the counter), without a uuid per call.
    """
    process_part = secrets.token_hex(8)
    counter = itertools.count()
    return lambda prefix: f"{prefix}-{process_part}{next(counter):016x}"


def build_app(source: TokenSource, tokenizer: Tokenizer,
              extra_routes: Iterable[web.RouteDef] | None = None) -> web.Application:
    """An application serving the OpenAI API from `source`.

    `extra_routes` are added first and win: a route of theirs with the same method and path
    replaces the built-in one (a cluster gateway's own /health, for example).
    """
    app = web.Application(client_max_size=CLIENT_MAX_SIZE)
    server = OpenAIServer(source, tokenizer, request_id_generator())
    app[APP_KEY_OPENAI] = server
    extra = list(extra_routes or [])
    taken = {(r.method, r.path) for r in extra}
    app.add_routes(extra + [r for r in server.routes() if (r.method, r.path) not in taken])
    return app


async def start_server(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve `app` on host:port from the running event loop; `await runner.cleanup()` stops it.

    Handlers are cancelled when their client disconnects, so a request whose client left
    during a long prefill is aborted at once rather than at its next token.
    """
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
