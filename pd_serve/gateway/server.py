"""`pd-serve gateway`: the cluster behind the OpenAI HTTP API, with /health and /metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from pathlib import Path

from aiohttp import web

from pd_serve.config import GatewayConfig
from pd_serve.gateway.app import build_app, raise_open_files_limit, start_server
from pd_serve.gateway.cluster import Cluster
from pd_serve.gateway.metrics import render
from pd_serve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def make_routes(cluster: Cluster) -> list[web.RouteDef]:
    async def health(_request: web.Request) -> web.Response:
        why = cluster.not_ready()
        workers = {w.worker_id: {"role": w.status.role, "free_pages": w.status.num_free_pages,
                                 "total_pages": w.status.num_pages, "running": w.status.num_running,
                                 "waiting": w.status.num_waiting, "inflight": len(w.inflight),
                                 "draining": w.status.draining}
                   for w in cluster.workers.values()}
        status = cluster.fatal or why or "ok"
        return web.json_response({"status": status, "queued": cluster.num_queued, "workers": workers},
                                 status=200 if status == "ok" else 503)

    async def metrics(_request: web.Request) -> web.Response:
        body = render(cluster.metrics, cluster.workers)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    return [web.get("/health", health), web.get("/metrics", metrics)]


async def serve(config: GatewayConfig, model_dir: Path, host: str, port: int) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    open_files = raise_open_files_limit()
    if open_files < 4096:
        logger.warning("open files limit %d: at most about that many clients at once (ulimit -n)",
                       open_files)
    cluster = Cluster(config)
    await cluster.start()
    app = build_app(cluster, tokenizer, make_routes(cluster), api_key=config.api_key,
                    body_timeout_s=config.body_timeout_s, send_timeout_s=config.send_timeout_s,
                    tool_call_parser=config.tool_call_parser or None,
                    reasoning_parser=config.reasoning_parser or None,
                    allowed_origins=config.origins)
    try:
        runner = await start_server(app, host, port, config.timeout_keep_alive_s, config.quiet_paths)
    except OSError as e:  # bad input: one line naming the flags (cli.main)
        await cluster.stop()
        why = (f"the host does not resolve: {e.strerror}" if isinstance(e, socket.gaierror)
               else os.strerror(e.errno) if e.errno else str(e))
        raise ValueError(f"--host {host} --port {port}: cannot bind ({why})") from None
    logger.info("gateway: http://%s:%d (model %s), workers register at %s", host, port,
                config.served_model_name, cluster.control_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.wait([asyncio.create_task(stop.wait()), asyncio.create_task(cluster.dead.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    await runner.cleanup()
    await cluster.stop()
    if cluster.fatal:  # a background task died: exit non-zero, not serve as a zombie
        raise SystemExit(1)
