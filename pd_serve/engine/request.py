"""A request's state inside an engine: its tokens, its KV pages, and how far it has been computed."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from pd_serve.engine.sampling_params import SamplingParams

_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass
class TokenLogprob:
    """Logprob of the sampled token and its top alternatives as (token_id, logprob) pairs; a
    prompt token's also has its rank in the vocabulary (1: the likeliest; 0: not computed)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 0


@dataclass(eq=False)
class Request:
    """One sequence. token_ids = prompt + output; the first num_computed_tokens are in the KV cache.

    Prefill, chunked prefill, decode and recompute after preemption are the same thing: each
    step computes some of the tokens not yet in the cache, and when the cache holds them all the
    engine samples one more token.

    Under the overlap schedule a sampled token can still be on the device when the next step is
    planned: num_pending counts it into num_tokens (1; 2 between launching a step and settling
    the one before); output_token_ids holds known tokens only. (Where the device finds a pending
    token is the executor's business: engine/executor.py.)
    """

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    priority: int = 0  # smaller runs first under --schedule-policy priority (as vLLM)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With sampling_params.prompt_logprobs: entry i is prompt token i + 1's (filled as its chunks run)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_pending: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Sequence length as the scheduler sees it: known tokens and the one pending, if any."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt logprobs and has not got them all: its prompt is computed in full."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def add_prompt_logprobs(self, start: int, logprobs: list[TokenLogprob]) -> None:
        """Those of prompt tokens start + 1, ...: a chunk computed again (after a preemption)
        brings some it has already."""
        have = len(self.prompt_logprobs)
        if start <= have:  # (chunks of such a prompt run from its first token: no cache hit)
            self.prompt_logprobs.extend(logprobs[have - start:])

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
