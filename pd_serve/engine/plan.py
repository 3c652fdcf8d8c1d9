"""What a scheduler hands an executor each step (StepPlan) and what it gets back (StepResult).

As vLLM v1's SchedulerOutput: a request new to the executor is sent once in full (its known
token ids, pages, sampling fields); later steps carry only what changed (tokens learned since,
new pages). Executors keep a request's state until it is named in `finished_ids`; a preempted
one keeps its tokens and generator but loses its pages (it gets new ones when it runs again).

Both are plain dataclasses with to_wire() / from_wire(): lists, ints, floats and strings, so a
plan crosses a process boundary in msgpack (a TP group's rank 0 sends it to its followers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_serve.engine.request import TokenLogprob
from pd_serve.engine.sampling_params import Grammar, SamplingParams

# The SamplingParams fields an executor samples with (stop rules stay with the scheduler; the
# stop ids and max_tokens come along for min_tokens, which masks the stop ids until then).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "logprobs", "prompt_logprobs",
                   "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos")


def sampling_to_wire(params: SamplingParams) -> list:
    """The fields an executor samples with, then logit_bias as [id, bias] pairs and the grammar
    as [kind, spec] (each None when absent)."""
    bias, grammar = params.logit_bias, params.grammar
    return [getattr(params, f) for f in SAMPLING_FIELDS] + [
        None if bias is None else [[t, b] for t, b in bias.items()],
        None if grammar is None else [grammar.kind, grammar.spec]]


def sampling_from_wire(row: list) -> SamplingParams:
    *values, bias, grammar = row
    return SamplingParams(**dict(zip(SAMPLING_FIELDS, values)),
                          logit_bias=None if bias is None else {t: b for t, b in bias},
                          grammar=None if grammar is None else Grammar(*grammar))


@dataclass
class NewRequest:
    """A request the executor has not seen: everything it needs, once. Output tokens already
    in token_ids were sampled elsewhere (a prefill worker's token 1)."""

    request_id: str
    token_ids: list[int]  # prompt + known output tokens
    num_prompt_tokens: int
    page_ids: list[int]
    sampling: list  # sampling_to_wire(params)

    def to_wire(self) -> list:
        return [self.request_id, self.token_ids, self.num_prompt_tokens, self.page_ids, self.sampling]


@dataclass
class RequestDiff:
    """What a known request gained since the executor last heard of it."""

    request_id: str
    new_token_ids: list[int]  # tokens learned since (sampled, now known)
    new_page_ids: list[int]  # pages appended to its page list

    def to_wire(self) -> list:
        return [self.request_id, self.new_token_ids, self.new_page_ids]


@dataclass
class StepChunk:
    """Compute positions [start, start + num_tokens) of a request; sample after them if `sample`.
    Only the last position can be unknown yet (a token of the step still in flight)."""

    request_id: str
    start: int
    num_tokens: int
    sample: bool

    def to_wire(self) -> list:
        return [self.request_id, self.start, self.num_tokens, self.sample]


@dataclass
class KVSend:
    """A prompt whose KV this step completes, and where it goes (one receiver per decode rank):
    each rank sends its own KV heads from inside the step's forward."""

    request_id: str
    addresses: list[str]
    src_page_ids: list[int]
    dst_page_ids: list[int]

    def to_wire(self) -> list:
        return [self.request_id, self.addresses, self.src_page_ids, self.dst_page_ids]


@dataclass
class StepPlan:
    """One step. The executor applies, in order: finished_ids (drop), preempted_ids (drop the
    pages), new_requests, request_diffs; then runs `chunks` (rows sample in chunk order)."""

    chunks: list[StepChunk] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    request_diffs: list[RequestDiff] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    kv_sends: list[KVSend] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def to_wire(self) -> list:
        return [[c.to_wire() for c in self.chunks], [r.to_wire() for r in self.new_requests],
                [d.to_wire() for d in self.request_diffs], self.finished_ids, self.preempted_ids,
                [s.to_wire() for s in self.kv_sends]]

    @classmethod
    def from_wire(cls, row: list) -> "StepPlan":
        chunks, new, diffs, finished, preempted, sends = row
        return cls([StepChunk(*c) for c in chunks], [NewRequest(*r) for r in new],
                   [RequestDiff(*d) for d in diffs], list(finished), list(preempted),
                   [KVSend(*s) for s in sends])


@dataclass
class StepResult:
    """One sampled token per sampling chunk of the plan, in order, and its logprobs where the
    request asked for them; and request id -> (start, logprobs of prompt tokens start + 1, ...)
    for the chunks of requests that asked for prompt logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)

    def to_wire(self) -> list:
        return [self.token_ids, [None if lp is None else _lp_wire(lp) for lp in self.logprobs],
                {rid: [start, [_lp_wire(lp) for lp in lps]] for rid, (start, lps) in self.prompt_logprobs.items()}]

    @classmethod
    def from_wire(cls, row: list) -> "StepResult":
        token_ids, logprobs, prompt = row
        return cls(list(token_ids), [None if lp is None else _lp_from_wire(lp) for lp in logprobs],
                   {rid: (start, [_lp_from_wire(lp) for lp in lps]) for rid, (start, lps) in prompt.items()})


def _lp_wire(lp: TokenLogprob) -> list:
    return [lp.token_id, lp.logprob, [list(t) for t in lp.top], lp.rank]


def _lp_from_wire(row: list) -> TokenLogprob:
    return TokenLogprob(row[0], row[1], [tuple(t) for t in row[2]], row[3])
