"""Per-request sampling parameters, named and defined as vLLM and the OpenAI API define them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")


@dataclass(frozen=True)
class Grammar:
    """A structured-output constraint: what every sampled token must keep the output inside.

    kind json_schema: spec is the schema as JSON text; json_object: any JSON object, spec "";
    regex: a regular expression the whole output matches; ebnf: an EBNF grammar (GBNF, as
    llama.cpp and xgrammar write it) whose `root` rule derives the output. Hashable: the
    executor compiles each (tokenizer, grammar) once (engine/grammar.py).
    """

    kind: str
    spec: str


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
SAMPLING_EPS = 1e-5  # a temperature below it samples greedily


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy, and so does any below SAMPLING_EPS (vLLM's rule: dividing the
    logits by less overflows them). top_k <= 0 and top_p == 1 and min_p == 0 disable those
    filters.
    Penalties follow vLLM: repetition_penalty scales logits of tokens seen in the prompt or the
    output (divide if positive, multiply if negative); presence_penalty subtracts a constant from
    tokens present in the output; frequency_penalty subtracts it once per occurrence in the output.
    logprobs: None for none, N >= 0 for the sampled token's logprob plus the top N alternatives
    (log-softmax of the raw model logits, before penalties and temperature, as vLLM v1 returns).
    prompt_logprobs: None, or N >= 0 for each prompt token's logprob (the first excepted: nothing
    precedes it) plus the top N at its position, as vLLM's field (OpenAI completions' echo with
    logprobs). Such a prompt is computed in full: no prefix-cache hit.
    logit_bias: token id -> a value in [-100, 100] added to that token's logit before anything
    else (penalties, temperature, filters); OpenAI's field. The logprobs stay the raw model's.
    grammar: the output is constrained to it (tokens it forbids are masked before sampling).
    min_tokens: EOS and stop_token_ids are masked until this many tokens are out, and no stop
    (token or string) ends the output before (vLLM's field); max_tokens still does.
    include_stop_str_in_output: the stop string, stop token id or EOS that ends the output
        stays in its text (vLLM's; an EOS adds "" unless skip_special_tokens is off).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    grammar: Grammar | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()  # (before the floats below: an error names the value as given)
        # The wire keeps an integral value an int (temperature 2): the sampler's tensors of
        # these fields must be float ones (an int past int64 makes no tensor at all).
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if type(value) is int:
                setattr(self, name, float(value))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def may_stop(self, num_output_tokens: int) -> bool:
        """Whether EOS, a stop token id or a stop string may end the output once it has this
        many tokens (min_tokens)."""
        return num_output_tokens >= self.min_tokens

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (not self.min_tokens or self.grammar is None, "min_tokens",  # (its end is a stop)
             "cannot be combined with a structured output (response_format, a guided field or a "
             "required or named tool_choice)"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1 (off), 0 (off) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative token ids"),
            (self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and math.isfinite(b)
                and -100 <= b <= 100 for t, b in self.logit_bias.items())), "logit_bias",
             "must map token ids to values in [-100, 100]"),
            (self.grammar is None or (isinstance(self.grammar, Grammar)
                                      and self.grammar.kind in GRAMMAR_KINDS
                                      and isinstance(self.grammar.spec, str)), "grammar",
             f"must be a Grammar of kind {', '.join(GRAMMAR_KINDS)}"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {rule}")
