"""Async streaming on top of the engine: steps run in a worker thread, outputs fan out per request."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from pd_serve.engine.engine import Engine, Prompt
from pd_serve.engine.output import RequestOutput
from pd_serve.engine.sampling_params import SamplingParams


class AsyncEngine:
    """`async for out in engine.generate(prompt, params)` yields outputs as tokens arrive.

    Requests are added and aborted only between steps, by the one loop task, so the engine
    never sees two threads at once. Leaving the iterator early (a client gone) aborts the request.
    """

    def __init__(self, engine: Engine, max_queued: int = 4096):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._pending: list[tuple[str, tuple]] = []
        self._max_queued = max_queued
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        if len(self._queues) >= self._max_queued:
            raise RuntimeError(f"engine queue is full ({self._max_queued} requests)")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        self._submit("add", (prompt, params, request_id, priority))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._submit("abort", (request_id,))

    def _submit(self, kind: str, args: tuple) -> None:
        self._pending.append((kind, args))
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for kind, args in pending:
            if kind == "abort":
                self.engine.abort(*args)
                continue
            prompt, params, request_id, priority = args
            try:
                self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
            except ValueError as e:
                if request_id in self._queues:
                    self._queues[request_id].put_nowait(e)

    async def _loop(self) -> None:
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                if not self._pending:
                    await self._wakeup.wait()
                continue
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as e:  # no stream may hang: every waiter gets the error
                for queue in self._queues.values():
                    queue.put_nowait(e)
                raise
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
