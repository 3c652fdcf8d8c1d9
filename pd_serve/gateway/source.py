"""The gateway's view of whatever produces tokens: a cluster of workers, or an in-process engine.

The HTTP layer (openai_api.py) turns a request into a GenerateSpec, iterates the TokenEvents
of `source.generate(spec)` and turns them into OpenAI responses. Closing the iterator early
(client gone) must abort the request wherever it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator

from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.protocol import Logprob


@dataclass
class GenerateSpec:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    # The client gets the output only once it is whole (not streamed): a request that loses
    # a worker after tokens came may then start over (a TokenEvent with restart first).
    whole: bool = False


@dataclass
class TokenEvent:
    """New tokens of one request. The last event has finished=True (or an error)."""

    new_token_ids: list[int]
    logprobs: list[Logprob] | None = None  # one per new token, when the request asked for them
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str = ""  # set when the request failed inside the cluster (worker died, timeout)
    timings: dict = field(default_factory=dict)  # phase timings in seconds, on the last event
    cached_tokens: int = 0  # with token 1: prompt tokens whose KV a prefix cache held
    # with token 1, when asked for (SamplingParams.prompt_logprobs): prompt token i + 1's at entry i
    prompt_logprobs: list[Logprob] | None = None
    # With an error: the HTTP status it maps to (400 the request can never be served, 429 the
    # queue is full, 503 no workers or no capacity in time, 504 a timeout, 500 a failure), and
    # how many seconds a client should wait before retrying (a Retry-After header), if known.
    status: int = 500
    retry_after: float | None = None
    restart: bool = False  # a whole request's tokens so far are void: it starts over


class TokenSource(ABC):
    @abstractmethod
    def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenEvent]:
        """Yield the request's events; the final one has finished=True."""

    @abstractmethod
    def model_name(self) -> str:
        """The id /v1/models lists and requests must name."""

    def max_model_len(self) -> int | None:
        return None

    def priority_scheduling(self) -> bool:
        """Whether a request's `priority` is honoured (--schedule-policy priority): else a
        request with a non-zero one is refused, as vLLM does, so that no client moves ahead of
        the others where the operator did not ask for it."""
        return False

    def max_choices(self) -> int | None:
        """The most choices (n x prompts) one request may have: what could never all be taken
        at once is a 400, not a 429 to retry forever. None: no limit."""
        return None

    def closed_early(self, reason: str) -> None:
        """The HTTP layer closed a request's events before their last one: at a stop string
        ("stop") or because its client went ("abort"). A source that counts how requests end
        counts these here (the last event, or an error, it sees itself)."""


class EngineSource(TokenSource):
    """A colocated AsyncEngine in the gateway's own process (tests and single-process serving)."""

    def __init__(self, async_engine, name: str):
        self.engine = async_engine
        self.name = name
        self._ids = itertools.count()

    def model_name(self) -> str:
        return self.name

    def max_model_len(self) -> int | None:
        return self.engine.engine.max_model_len

    def priority_scheduling(self) -> bool:
        return self.engine.engine.config.scheduler.schedule_policy == "priority"

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenEvent]:
        # The engine does token-level stops; stop strings are the HTTP layer's (it detokenizes).
        params = dataclasses.replace(spec.params, stop=[])
        outputs = self.engine.generate(spec.prompt_token_ids, params, request_id=spec.request_id,
                                       priority=spec.priority)
        sent = 0  # tokens so far
        async with contextlib.aclosing(outputs):  # closing us aborts the engine request now
            async for out in outputs:
                n = len(out.new_token_ids)
                new_logprobs = out.new_logprobs
                logprobs = None if new_logprobs is None else [Logprob.of(lp) for lp in new_logprobs]
                first, sent = n and not sent, sent + n
                prompt = out.prompt_logprobs if first and out.prompt_logprobs is not None else None
                yield TokenEvent(out.new_token_ids, logprobs, out.finished, out.finish_reason,
                                 cached_tokens=out.num_cached_tokens if first else 0,
                                 prompt_logprobs=None if prompt is None else [Logprob.of(lp) for lp in prompt])
                await asyncio.sleep(0)
