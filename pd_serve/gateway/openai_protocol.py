"""OpenAI request bodies -> a validated `ParsedRequest`; bad input -> `ApiError` (a 4xx to send).

Parsing knows the tokenizer (prompts become token ids here) and the served model's name and
context length, nothing about where tokens come from. Field names and defaults follow the
OpenAI API, with vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ...).
Structured outputs: OpenAI's response_format (json_object, json_schema), vLLM's
structured_outputs (json, regex, choice, grammar, json_object) and its older guided_json /
guided_regex / guided_grammar / guided_choice, and SGLang's regex / ebnf become one
SamplingParams.grammar, checked here (a schema, regex or grammar that does not parse is a
400). Chat's tools and tool_choice: openai_tools (required and named choices become the
grammar).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Iterator

from jinja2 import TemplateError

from pd_serve.engine.grammar import canonical_json, check_grammar
from pd_serve.engine.sampling_params import Grammar, SamplingParams
from pd_serve.gateway.openai_tools import (ToolChoice, ToolsError, parse_tools,
                                           strict_schema_problem)
from pd_serve.gateway.reasoning import prompt_opens_reasoning
from pd_serve.gateway.tool_parsers import make_parser
from pd_serve.model.tokenizer import Tokenizer
from pd_serve.protocol import MAX_TOP_LOGPROBS

_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Message keys passed through to the chat template besides role and content.
_MESSAGE_EXTRA_KEYS = ("name", "tool_calls", "tool_call_id")
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 128  # choices in one request: prompts (a completions batch) x n
# A chat's messages: a long agent session has hundreds. Each costs the chat template's render
# (GIL-bound: 900k one-letter messages took 2.5 s a request, other clients waiting meanwhile).
MAX_MESSAGES = 16384
# echo with logprobs, or prompt_logprobs: prompt tokens x choices x (N + 1) in one request: one
# worker's message of them stays far inside the control plane's 64 MiB, the response under ~50 MB
MAX_PROMPT_LOGPROB_ENTRIES = 2**20
# A text of more characters than this times the context is judged by its head first (_encode).
HEAD_CHARS_PER_TOKEN = 8
# Stop strings are matched on every token of every choice, on the gateway's event loop, and
# travel with the request to each worker: bounded (OpenAI's API takes 4).
MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024
# guided_choice becomes a grammar compiled per request: its strings are bounded
MAX_GUIDED_CHOICES, MAX_GUIDED_CHOICE_CHARS = 1024, 65536
_PARAMS_ERROR = re.compile(r"^SamplingParams\.(\w+)=(.*)$", re.S)
MAX_JSON_DEPTH = 64  # nesting of a request body; real requests need a handful of levels
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_INT64 = (-2**63, 2**63)  # [low, high) of integer fields: what msgpack and the engine carry
_SEED_RANGE = (-2**63, 2**64)  # a seed may also be an unsigned 64-bit integer

# vLLM's chat fields for the template (render_chat)
CHAT_TEMPLATE_FIELDS = frozenset(("add_generation_prompt", "continue_final_message",
                                  "chat_template_kwargs", "reasoning_effort"))
# OpenAI's reasoning_effort values; the chat template gets the one asked for (render_chat)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_ROLE_IN_TEMPLATE = re.compile(r"""["']developer["']""")  # a template that handles the role
# names the template gets from the server, which chat_template_kwargs may not set
_RESERVED_TEMPLATE_NAMES = frozenset(("messages", "tools", "add_generation_prompt",
                                      "continue_final_message", "bos_token", "eos_token",
                                      "pad_token", "unk_token"))
_CONTINUE_MARK = "PD_SERVE_CONTINUE_HERE "
# Body fields each endpoint implements, plus ones accepted and ignored because they do not
# change the output. Any other field is a 400 unless it is null or in _OFF_VALUES: a request
# is never served while silently dropping what it asked for (a JSON format, tools, a grammar).
_COMMON_FIELDS = frozenset((
    "model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
    "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "logit_bias", "logprobs",
    "prompt_logprobs", "priority", "user", "metadata", "store", "service_tier",
    "parallel_tool_calls", "prompt_cache_key", "prompt_cache_retention", "add_special_tokens",
    "return_tokens_as_token_ids",
    "safety_identifier", "response_format", "guided_json", "guided_regex", "guided_grammar",
    "guided_choice", "structured_outputs", "regex", "ebnf", "min_tokens",
    "include_stop_str_in_output"))
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "top_logprobs", "max_completion_tokens", "tools",
                                 "tool_choice"} | CHAT_TEMPLATE_FIELDS
# Unimplemented fields, with the values that ask for nothing beyond plain text (OpenAI's and
# vLLM's defaults, which clients that send a whole request object fill in).
_OFF_VALUES = {"functions": [[]], "function_call": ["none", "auto"], "suffix": [""],
               "best_of": [1], "echo": [False], "modalities": [["text"]],
               "use_beam_search": [False], "length_penalty": [1.0],
               "spaces_between_special_tokens": [True], "return_token_ids": [False],
               "bad_words": [[]]}


class ApiError(Exception):
    """A request the gateway refuses or could not serve: HTTP status plus OpenAI's error object,
    and optionally the seconds a client should wait before retrying (a Retry-After header)."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.type = type or error_type(status)
        self.retry_after = retry_after

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def model_not_found(name: str, served: str) -> ApiError:
    """The 404 for a model name this server does not serve (vLLM's wording and type)."""
    return ApiError(f"The model `{name}` does not exist. This server serves `{served}`.", "model",
                    status=404, type="NotFoundError", code="model_not_found")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


def decode_body(raw: bytes):
    """A request body's JSON, which must be UTF-8. Refused (400) besides malformed JSON: nesting
    deeper than MAX_JSON_DEPTH, and a lone surrogate ("\\ud800") in any string, which JSON
    allows but the tokenizer and a UTF-8 reply cannot carry."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ApiError(f"request body is not valid UTF-8: {e}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise ApiError(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None
    # Walk only a body that may fail: more brackets than the depth allows, or a surrogate escape.
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH and not _SURROGATE_ESCAPE.search(text):
        return body
    for key, value in (body.items() if isinstance(body, dict) else [(None, body)]):
        _check_json(key, None)
        _check_json(value, key)
    return body


def _check_json(value, param: str | None) -> None:
    """Depth and lone surrogates of one top-level field, walked without recursion (a recursive
    walk of deep input would hit Python's recursion limit itself)."""
    where = f"'{param}'" if param is not None else "the request body"
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                raise ApiError(f"{where} holds a lone surrogate (an unpaired \\ud800-\\udfff "
                               f"escape): not valid Unicode", param)
        elif isinstance(value, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels", param)
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in items if isinstance(v, (str, list, dict)))


@dataclass
class ModelInfo:
    """What parsing needs to know about the served model."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int | None  # None: the source does not say; no context check
    tool_call_parser: str | None = None  # --tool-call-parser: tool_choice auto needs one


@dataclass
class ParsedRequest:
    """One validated completion or chat request.

    prompts: one prompt's token ids, or a /v1/completions batch's. Each prompt gets n choices.
    logprobs: None, or N top alternatives per token (chat's top_logprobs, completions' logprobs).
    echo_texts: completions' echo: each prompt's text, put in front of its choices' text.
    echo_only: completions' echo with max_tokens 0 (OpenAI's way to score a prompt): the
        prompt is computed (params ask one token, which no worker skips) and the reply holds
        the echo alone: no token, finish_reason "length".
    prompt_logprobs: vLLM's field: N top alternatives of each prompt token, with ranks (params'
        prompt_logprobs is the larger of it and echo's logprobs: one scoring serves both).
    tool_choice: chat's, when the output is read for tool calls (None: it is not).
    prompt_opens_reasoning: chat's rendered prompt ends inside an open <think>.
    continuous_usage: stream_options' continuous_usage_stats (vLLM's) with include_usage: every
        chunk carries its choice's usage so far (its prompt, its tokens).
    tokens_as_ids: vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N" (tokens
        of one text, such as byte pieces that all show U+FFFD, stay apart).
    """

    prompts: list[list[int]]
    params: SamplingParams  # stop strings included; the HTTP layer applies them
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    priority: int
    echo_texts: list[str] | None = None
    echo_only: bool = False
    prompt_logprobs: int | None = None
    tool_choice: ToolChoice | None = None
    prompt_opens_reasoning: bool = False
    continuous_usage: bool = False
    tokens_as_ids: bool = False

    def choices(self) -> list[tuple[list[int], SamplingParams]]:
        """(prompt, params) of each choice, in the response's order (choice index prompt * n + i).
        With a seed, choice i of a prompt samples with seed + i (vLLM's rule): its n samples
        differ, and the first is what n=1 gives. A whole (not streamed) reply has a prompt
        scored once, by its first choice, whose scores the others show too."""
        out = []
        for prompt in self.prompts:
            for i in range(self.n):
                changes = {}
                if self.params.seed is not None and i:
                    changes["seed"] = _wrap_seed(self.params.seed + i)
                if self.params.prompt_logprobs is not None and i and not self.stream:
                    changes["prompt_logprobs"] = None
                out.append((prompt, dataclasses.replace(self.params, **changes) if changes
                            else self.params))
        return out


def parse_completion(body, model: ModelInfo) -> ParsedRequest:
    """Validate a /v1/completions body and tokenize its prompt (add_special_tokens: vLLM's
    field, default true: the tokenizer's BOS, if it adds one)."""
    body = _check_common(body, model, _COMPLETION_FIELDS)
    if "prompt" not in body:
        raise ApiError("'prompt' is a required field", "prompt")
    echo = _opt(body, "echo", bool) or False
    best_of = _opt(body, "best_of", int)
    if best_of is not None and best_of != 1:
        raise ApiError("best_of > 1 is not supported (one sequence per request)", "best_of")
    logprobs = _opt(body, "logprobs", int)
    max_tokens = _opt(body, "max_tokens", int)
    given = max_tokens is not None
    echo_only = echo and max_tokens == 0
    if echo_only and _opt(body, "min_tokens", int):
        raise ApiError("min_tokens must be 0 with max_tokens 0", "min_tokens")
    params = _sampling_params(body, 1 if echo_only else max_tokens if given else
                              _COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs, {"logprobs": "logprobs"},
                              model.tokenizer.vocab_size)
    prompts = []
    special = _opt(body, "add_special_tokens", bool)
    # each prompt checked as it comes: a batch past the context stops at its first such
    # prompt, the rest left untokenized
    for ids in _prompts(body["prompt"], model, special is not False):
        _check_context(len(ids), 0 if echo_only else params.max_tokens, given,
                       model.max_model_len, "prompt")
        prompts.append(ids)
    parsed = _parsed(body, prompts, params, logprobs)
    parsed.echo_only = echo_only
    _score_prompts(parsed, body, logprobs if echo else None)
    if echo:
        texts = body["prompt"] if _is_batch(body["prompt"]) else [body["prompt"]]
        # a prompt of ids echoes as their whole text, special tokens included (as its
        # text form, which tokenizes to the same ids, echoes itself; vLLM's too)
        parsed.echo_texts = [t if isinstance(t, str) else
                             model.tokenizer.decode(ids, skip_special_tokens=False)
                             for t, ids in zip(texts, prompts)]
    return parsed


def parse_chat(body, model: ModelInfo) -> ParsedRequest:
    """Validate a /v1/chat/completions body, render the chat template and tokenize it."""
    body = _check_common(body, model, _CHAT_FIELDS)
    if "messages" not in body:
        raise ApiError("'messages' is a required field", "messages")
    messages = _messages(body["messages"])
    try:
        tools = parse_tools(body, model.tool_call_parser)
    except ToolsError as e:
        raise ApiError(str(e), e.param) from None
    text = render_chat(body, model, messages, **({"tools": tools.tools} if tools.tools else {}))
    # the template writes the special tokens; vLLM's add_special_tokens adds the tokenizer's too
    prompt_ids = _encode(text, model, "messages", bool(_opt(body, "add_special_tokens", bool)))
    if not prompt_ids:
        raise ApiError("the messages rendered to an empty prompt", "messages")
    want_logprobs = _opt(body, "logprobs", bool) or False
    top_logprobs = _opt(body, "top_logprobs", int)
    if top_logprobs is not None and not want_logprobs:
        raise ApiError("top_logprobs requires logprobs=true", "top_logprobs")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _opt(body, max_field, int)
    given = max_tokens is not None
    if not given:  # as many as fit; max(1, ...) lets the context check word the error
        limit = model.max_model_len
        max_tokens = max(1, limit - len(prompt_ids)) if limit else _COMPLETIONS_DEFAULT_MAX_TOKENS
    params = _sampling_params(body, max_tokens, logprobs,
                              {"logprobs": "top_logprobs", "max_tokens": max_field},
                              model.tokenizer.vocab_size, tools.grammar)
    if tools.choice is not None and tools.choice.mode == "auto" \
            and make_parser(model.tool_call_parser).keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)  # the call markers
    _check_context(len(prompt_ids), params.max_tokens, given, model.max_model_len, "messages")
    parsed = _parsed(body, [prompt_ids], params, logprobs)
    _score_prompts(parsed, body, None)
    parsed.tool_choice = tools.choice
    parsed.prompt_opens_reasoning = prompt_opens_reasoning(text)
    return parsed


# ---- shared pieces -------------------------------------------------------------------------
def _check_common(body, model: ModelInfo, fields: frozenset[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {_json_type(body)}")
    name = body.get("model")
    if name is None:
        raise ApiError("'model' is a required field", "model")
    if not isinstance(name, str):
        raise ApiError(f"'model' must be a string, got {_json_type(name)}", "model")
    if name != model.name:
        raise model_not_found(name, model.name)
    for key, value in body.items():
        if key not in fields and value is not None and not any(
                isinstance(value, bool) == isinstance(off, bool) and value == off
                for off in _OFF_VALUES.get(key, ())):  # (true is not 1, nor 0 false)
            raise ApiError(f"'{key}' is not supported by this server", key)
    n = _opt(body, "n", int)
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise ApiError(f"n={n} must be in [1, {MAX_CHOICES}]", "n")
    _opt(body, "parallel_tool_calls", bool)  # (read where tools are: a non-boolean is refused)
    return body


def _score_prompts(parsed: ParsedRequest, body: dict, echo_logprobs: int | None) -> None:
    """Set what scores the prompt: vLLM's prompt_logprobs N (not with stream, as vLLM) and
    completions' echo with logprobs take one SamplingParams.prompt_logprobs, the larger N."""
    asked = _opt(body, "prompt_logprobs", int)
    if asked is not None:
        if not 0 <= asked <= MAX_TOP_LOGPROBS:
            raise ApiError(f"prompt_logprobs={asked} must be in [0, {MAX_TOP_LOGPROBS}]", "prompt_logprobs")
        if parsed.stream:
            raise ApiError("prompt_logprobs is not available with stream=true", "prompt_logprobs")
        parsed.prompt_logprobs = asked
    wanted = [n for n in (asked, echo_logprobs) if n is not None]
    if not wanted:
        return
    num_top, field = max(wanted), "prompt_logprobs" if asked == max(wanted) else "logprobs"
    entries = sum(map(len, parsed.prompts)) * parsed.n * (num_top + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ApiError(f"{field} {num_top} for the prompt tokens of {len(parsed.prompts) * parsed.n} "
                       f"choice(s) would take {entries} logprob entries, more than "
                       f"{MAX_PROMPT_LOGPROB_ENTRIES}; ask for fewer logprobs, choices or prompt "
                       f"tokens", field)
    parsed.params = dataclasses.replace(parsed.params, prompt_logprobs=num_top)


def _parsed(body: dict, prompts: list[list[int]], params: SamplingParams,
            logprobs: int | None) -> ParsedRequest:
    n = _opt(body, "n", int) or 1
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; at most "
                       f"{MAX_CHOICES} per request", "n")
    stream = _opt(body, "stream", bool) or False
    options = _opt(body, "stream_options", dict)
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise ApiError("stream_options is only allowed with stream=true", "stream_options")
        include_usage = _opt(options, "include_usage", bool, "stream_options.include_usage") or False
        continuous = bool(_opt(options, "continuous_usage_stats", bool,
                               "stream_options.continuous_usage_stats")) and include_usage
        known = {"include_usage", "continuous_usage_stats", "include_obfuscation"}  # (no padding)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ApiError(f"stream_options.{unknown[0]} is not supported by this server (only "
                           f"{', '.join(sorted(known))})", f"stream_options.{unknown[0]}")
    priority = _opt(body, "priority", int)
    return ParsedRequest(prompts, params, n, stream, include_usage, logprobs, priority or 0,
                         continuous_usage=continuous,
                         tokens_as_ids=bool(_opt(body, "return_tokens_as_token_ids", bool)))


def _sampling_params(body: dict, max_tokens: int, logprobs: int | None,
                     field_names: dict[str, str], vocab_size: int,
                     tool_grammar: Grammar | None = None) -> SamplingParams:
    """SamplingParams from the body's fields; its ValueError becomes a 400 naming the body field.
    tool_grammar: what a required or named tool_choice forces (with no other grammar)."""
    kwargs = {"max_tokens": max_tokens, "logprobs": logprobs}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        kwargs[name] = _opt(body, name, float)
    kwargs["top_k"] = _opt(body, "top_k", int)
    kwargs["seed"] = _opt(body, "seed", int, int_range=_SEED_RANGE)
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        kwargs[name] = _opt(body, name, bool)
    kwargs["min_tokens"] = _opt(body, "min_tokens", int)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError("'stop' must be a string or a list of strings", "stop")
    if stop is not None and len(stop) > MAX_STOP:
        raise ApiError(f"{len(stop)} stop strings; at most {MAX_STOP}", "stop")
    longest = max(map(len, stop or ()), default=0)
    if longest > MAX_STOP_CHARS:
        raise ApiError(f"a stop string of {longest} characters; at most {MAX_STOP_CHARS}", "stop")
    kwargs["stop"] = stop
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        raise ApiError("'stop_token_ids' must be a list of integers", "stop_token_ids")
    if stop_ids is not None and len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(f"{len(stop_ids)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS}",
                       "stop_token_ids")
    bad = next((t for t in stop_ids or [] if not _INT64[0] <= t < _INT64[1]), None)
    if bad is not None:
        raise ApiError(f"stop_token_ids: {bad} is out of range (a 64-bit integer)", "stop_token_ids")
    kwargs["stop_token_ids"] = stop_ids
    kwargs["logit_bias"] = _logit_bias(body, vocab_size)
    kwargs["grammar"] = _grammar(body)
    if tool_grammar is not None:
        if kwargs["grammar"] is not None:
            raise ApiError("a required or named tool_choice constrains the output itself; it "
                           "cannot be combined with response_format or a guided field", "tool_choice")
        kwargs["grammar"] = tool_grammar
    try:
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except ValueError as e:
        match = _PARAMS_ERROR.match(str(e))
        if match is None:
            raise ApiError(str(e))
        field = field_names.get(match.group(1), match.group(1))
        rule = match.group(2).replace("max_tokens", field_names.get("max_tokens", "max_tokens"))
        raise ApiError(f"{field}={rule}", field)


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} with ids in the vocabulary and biases in [-100, 100]."""
    bias = _opt(body, "logit_bias", dict)
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20
        token = int(key) if digits else None
        if token is None or token >= vocab_size:
            raise ApiError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                           "logit_bias")
        if not (_is_int(value) or isinstance(value, float)) or not -100 <= value <= 100:
            raise ApiError(f"logit_bias[{key!r}]={value!r} must be a number in [-100, 100]",
                           "logit_bias")
        out[token] = float(value)
    return out


# Body fields that constrain the output with a grammar: the Grammar kind each gives.
_GRAMMAR_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "regex": "regex",
                   "guided_grammar": "ebnf", "ebnf": "ebnf", "guided_choice": "ebnf"}


# vLLM's structured_outputs object: its keys and the field each stands for
_STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                       "grammar": "guided_grammar", "json_object": "response_format"}


def _grammar(body: dict) -> Grammar | None:
    """The one grammar the body asks for (response_format or a vLLM / SGLang field), checked."""
    asked = [(name, g) for name, field, value in _grammar_requests(body)
             if (g := _grammar_field(value, field, name)) is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(f"{' and '.join(n for n, _ in asked)} each constrain the output; give one",
                       asked[1][0])
    name, grammar = asked[0]
    try:
        check_grammar(grammar)
    except ValueError as e:
        raise ApiError(f"{name}: {e}", name) from None
    return grammar


def _grammar_requests(body: dict) -> list[tuple[str, str, object]]:
    """(name, field, value) of each grammar field the body gives: the name its errors use, the
    field it is or stands for (vLLM's structured_outputs.json is guided_json), its value."""
    asked = [(name, name, body[name]) for name in ("response_format", *_GRAMMAR_FIELDS)
             if body.get(name) is not None]
    outputs = body.get("structured_outputs")
    if outputs is None:
        return asked
    if not isinstance(outputs, dict):
        raise ApiError(f"'structured_outputs' must be an object, got {_json_type(outputs)}",
                       "structured_outputs")
    for key, value in outputs.items():
        name = f"structured_outputs.{key}"
        if value is None or value is False:  # vLLM's defaults of its options: nothing asked
            continue
        if key not in _STRUCTURED_OUTPUTS:
            raise ApiError(f"{name} is not supported; structured_outputs takes "
                           f"{', '.join(_STRUCTURED_OUTPUTS)}", name)
        if key == "json_object":
            if value is not True:
                raise ApiError(f"{name} must be a boolean, got {_json_type(value)}", name)
            value = {"type": "json_object"}
        asked.append((name, _STRUCTURED_OUTPUTS[key], value))
    return asked


def _grammar_field(value, field: str, name: str) -> Grammar | None:
    """The grammar of one field's value (field: a _GRAMMAR_FIELDS key or response_format);
    errors name `name`."""
    if field == "response_format":
        return _response_format(value)
    kind = _GRAMMAR_FIELDS[field]
    if field == "guided_choice":
        return Grammar(kind, _choice_ebnf(value, name))
    if kind == "json_schema":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ApiError(f"{name} is not valid JSON: {e}", name) from None
        if not isinstance(value, dict):
            raise ApiError(f"'{name}' must be a JSON schema object, got {_json_type(value)}", name)
        if problem := strict_schema_problem(None, value, name):
            raise ApiError(*problem)
        return Grammar(kind, canonical_json(value))
    if not isinstance(value, str) or not value:
        got = "an empty string" if value == "" else _json_type(value)
        raise ApiError(f"'{name}' must be a non-empty string, got {got}", name)
    return Grammar(kind, value)


def _choice_ebnf(choices, name: str = "guided_choice") -> str:
    """vLLM's guided_choice (the output is one of the strings) as an EBNF alternation."""
    if not (isinstance(choices, list) and choices
            and all(isinstance(c, str) and c for c in choices)):
        raise ApiError(f"'{name}' must be a non-empty list of non-empty strings", name)
    if any("\0" in c for c in choices):  # (xgrammar's literals end at a NUL)
        raise ApiError(f"{name} strings may not hold a NUL character", name)
    if len(choices) > MAX_GUIDED_CHOICES or sum(map(len, choices)) > MAX_GUIDED_CHOICE_CHARS:
        raise ApiError(f"{name} takes at most {MAX_GUIDED_CHOICES} strings of "
                       f"{MAX_GUIDED_CHOICE_CHARS} characters in all", name)
    return "root ::= " + " | ".join(map(_ebnf_literal, choices))


def _ebnf_literal(text: str) -> str:
    """`text` as an xgrammar EBNF string literal: quotes and backslashes escaped, control
    characters as \\n, \\t, \\r or \\uHHHH (its \\x takes every hex digit that follows)."""
    named = {"\n": "\\n", "\t": "\\t", "\r": "\\r", '"': '\\"', "\\": "\\\\"}
    escaped = (named.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 else c) for c in text)
    return '"' + "".join(escaped) + '"'


def _response_format(value) -> Grammar | None:
    """OpenAI's response_format: text (no grammar), json_object, or json_schema with a schema."""
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object", "")
    if kind != "json_schema":
        raise ApiError(f"response_format.type must be text, json_object or json_schema, got "
                       f"{kind!r}", param)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError("response_format.json_schema must be an object with the 'schema'",
                       f"{param}.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ApiError(f"response_format.json_schema.schema must be a JSON schema object, got "
                       f"{_json_type(schema)}", f"{param}.json_schema.schema")
    # (without strict the output follows the schema where the grammar can)
    if problem := strict_schema_problem(spec, schema, f"{param}.json_schema", "schema"):
        raise ApiError(*problem)
    return Grammar("json_schema", canonical_json(schema))


def _check_context(num_prompt: int, max_tokens: int, max_tokens_given: bool,
                   max_model_len: int | None, what: str) -> None:
    if max_model_len is None or num_prompt + max_tokens <= max_model_len:
        return
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if not max_tokens_given:
        raise ApiError(f"{head}your {what} resulted in {num_prompt} tokens. "
                       f"Please reduce the length of the {what}.", what)
    raise ApiError(f"{head}you requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                   f"{what}, {max_tokens} in the completion). Please reduce the length of the "
                   f"{what} or completion.", what)


def _prompts(prompt, model: ModelInfo, special: bool = True) -> Iterator[list[int]]:
    """A string or a list of token ids (one prompt), or a list of those (a batch): each
    prompt's ids, tokenized as they are asked for (special: add_special_tokens)."""
    if not _is_batch(prompt):
        yield _prompt_token_ids(prompt, model, "prompt", special)
        return
    if len(prompt) > MAX_CHOICES:
        raise ApiError(f"{len(prompt)} prompts; at most {MAX_CHOICES} per request", "prompt")
    for i, p in enumerate(prompt):
        yield _prompt_token_ids(p, model, f"prompt[{i}]", special)


def _is_batch(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)


def _encode(text: str, model: ModelInfo, what: str, add_special_tokens: bool = True) -> list[int]:
    """The text's token ids. Tokenizing a body of MiBs holds a gateway thread for tens of
    seconds and takes hundreds of MiB, so a text its length shows past the context is a 400
    before that: a text longer than HEAD_CHARS_PER_TOKEN characters per token of the context
    when its head alone passes the context; then one of more characters than the context's
    tokens can stand for (tokenizer.max_token_chars each), which the head alone would let
    through behind a head that tokenizes into few tokens (a run of spaces)."""
    limit = model.max_model_len
    if limit is not None and len(text) > limit * HEAD_CHARS_PER_TOKEN:
        head = model.tokenizer.encode(text[:limit * HEAD_CHARS_PER_TOKEN],
                                       add_special_tokens=add_special_tokens)
        if len(head) > limit:
            raise ApiError(f"This model's maximum context length is {limit} tokens. However, "
                           f"the first {limit * HEAD_CHARS_PER_TOKEN} characters of your {what} "
                           f"({len(text)} in all) alone resulted in {len(head)} tokens. Please "
                           f"reduce the length of the {what}.", what.split("[")[0])
        check_chars(text, model, what)
    return model.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_chars(text: str, model: ModelInfo, what: str) -> None:
    """400 for a text of more characters than the context's tokens can stand for (each at most
    tokenizer.max_token_chars): it cannot fit, and tokenizing it may take seconds and MiBs."""
    limit = model.max_model_len
    if limit is not None and len(text) > limit * model.tokenizer.max_token_chars:
        raise ApiError(f"This model's maximum context length is {limit} tokens. However, your "
                       f"{what} has {len(text)} characters, more than {limit} tokens of at most "
                       f"{model.tokenizer.max_token_chars} characters each can hold. Please "
                       f"reduce the length of the {what}.", what.split("[")[0])


def _prompt_token_ids(prompt, model: ModelInfo, where: str, special: bool = True) -> list[int]:
    """A string (tokenized, with add_special_tokens `special`) or a list of token ids."""
    tokenizer = model.tokenizer
    if isinstance(prompt, str):
        ids = _encode(prompt, model, where, special)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = prompt
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise ApiError(f"{where}: token id {bad} is outside the vocabulary "
                           f"[0, {tokenizer.vocab_size})", "prompt")
    else:
        raise ApiError(f"'{where}' must be a string, a list of token ids, or a list of those, got "
                       f"{_json_type(prompt)}", "prompt")
    if not ids:
        raise ApiError(f"{where} is empty", "prompt")
    return ids


def _wrap_seed(seed: int) -> int:
    """seed + i kept in the 64-bit range _sampling_params allows."""
    return seed - 2**64 if seed >= 2**64 else seed


def render_chat(body: dict, model: ModelInfo, messages: list[dict], **extra) -> str:
    """The prompt text of checked `messages` under the body's template fields, as vLLM reads
    them: add_generation_prompt (default true) opens the assistant's turn;
    continue_final_message (default false) leaves the final message open, its text the
    prompt's end, for the model to go on from; chat_template_kwargs reach the template (such
    as Qwen3's enable_thinking), and so does OpenAI's reasoning_effort (gpt-oss's template reads
    it; others ignore it). OpenAI's developer role is the system role (as llama.cpp maps it)
    unless the template names the role itself."""
    generation = _opt(body, "add_generation_prompt", bool)
    effort = _opt(body, "reasoning_effort", str)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise ApiError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got "
                           f"{effort!r}", "reasoning_effort")
        extra = extra | {"reasoning_effort": effort}
    if not model.tokenizer.chat_template_matches(_ROLE_IN_TEMPLATE):
        messages = [m | {"role": "system"} if m["role"] == "developer" else m for m in messages]
    resume = _opt(body, "continue_final_message", bool) or False
    if resume and generation:
        raise ApiError("continue_final_message and add_generation_prompt cannot both be true",
                       "continue_final_message")
    kwargs = _opt(body, "chat_template_kwargs", dict) or {}
    taken = sorted(k for k in kwargs if k in _RESERVED_TEMPLATE_NAMES or k in extra)
    if taken:
        raise ApiError(f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: the "
                       "server sets it", "chat_template_kwargs")
    if resume:  # the text's end is found by a mark put after it (it may be anywhere else too)
        if not messages[-1]["content"].strip():
            raise ApiError("continue_final_message: the final message has no text to continue",
                           "continue_final_message")
        messages = messages[:-1] + [messages[-1] | {"content": messages[-1]["content"] + _CONTINUE_MARK}]
    try:
        text = model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=not resume and generation is not False, **kwargs, **extra)
    except (TemplateError, ValueError, TypeError) as e:
        raise ApiError(f"messages could not be rendered with the chat template: {e}", "messages")
    if not resume:
        return text
    at = text.rfind(_CONTINUE_MARK.strip())
    if at < 0:
        raise ApiError("continue_final_message: the chat template drops the final message's text",
                       "continue_final_message")
    # its trailing spaces stay where the template kept them (as transformers cuts)
    return text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()


def _messages(messages) -> list[dict]:
    """Messages as the chat template wants them: role plus string content."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of message objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(f"{len(messages)} messages; at most {MAX_MESSAGES} in one request", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"{where} must be an object, got {_json_type(message)}", where)
        role = message.get("role")
        if role not in _CHAT_ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(_CHAT_ROLES)}; got {role!r}",
                           f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        elif isinstance(content, list):
            content = "\n".join(_text_part(part, f"{where}.content[{j}]", role)
                                for j, part in enumerate(content))
        elif not isinstance(content, str):
            raise ApiError(f"{where}.content must be a string or a list of text parts, "
                           f"got {_json_type(content)}", f"{where}.content")
        clean = {"role": role, "content": content}
        clean.update({k: message[k] for k in _MESSAGE_EXTRA_KEYS if message.get(k) is not None})
        for key in ("name", "tool_call_id"):
            if key in clean and not isinstance(clean[key], str):
                raise ApiError(f"{where}.{key} must be a string, got {_json_type(clean[key])}",
                               f"{where}.{key}")
        if "tool_calls" in clean:
            calls = clean["tool_calls"]
            if role != "assistant" or not isinstance(calls, list):
                raise ApiError(f"{where}.tool_calls must be a list, in an assistant message",
                               f"{where}.tool_calls")
            clean["tool_calls"] = [_template_tool_call(c, f"{where}.tool_calls[{j}]")
                                   for j, c in enumerate(calls)]
        out.append(clean)
    return out


def _template_tool_call(call, where: str) -> dict:
    """An assistant message's earlier tool call, checked ({"id": str, "type": "function",
    "function": {"name": str, "arguments": str}}, id and type optional), as chat templates
    read it: arguments as an object where the string parses as JSON, as transformers expects."""
    function = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
            or not isinstance(call.get("id", ""), str) or call.get("type", "function") != "function"):
        raise ApiError(f"{where} must be {{\"id\": string, \"type\": \"function\", \"function\": "
                       f"{{\"name\": string, \"arguments\": string}}}}", where)
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return call | {"function": function | {"arguments": arguments}}


def _text_part(part, where: str, role: str) -> str:
    """A content part's text: a text part's, or an assistant's refusal part's (what the model
    said, as OpenAI returns it and clients send it back in the history)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind != "text" or not isinstance(part.get("text"), str):
        raise ApiError(f"{where}: only {{\"type\": \"text\", \"text\": ...}} parts (and an "
                       f"assistant's {{\"type\": \"refusal\", \"refusal\": ...}}) are supported, "
                       f"got {kind if kind is not None else _json_type(part)!r}", where)
    return part["text"]


def _opt(body: dict, name: str, kind: type, param: str | None = None, *,
         int_range: tuple[int, int] = _INT64):
    """body[name] if present and not null, checked against a JSON type (float accepts ints);
    an integer must be in [low, high) of `int_range`, a number must be finite."""
    value = body.get(name)
    if value is None:
        return None
    ok = {bool: lambda v: isinstance(v, bool), int: _is_int, dict: lambda v: isinstance(v, dict),
          str: lambda v: isinstance(v, str),
          float: lambda v: _is_int(v) or isinstance(v, float)}[kind](value)
    if not ok:
        expected = {bool: "a boolean", int: "an integer", float: "a number", dict: "an object",
                    str: "a string"}[kind]
        raise ApiError(f"'{param or name}' must be {expected}, got {_json_type(value)}", param or name)
    if kind is int and not int_range[0] <= value < int_range[1]:
        raise ApiError(f"{param or name}={value} is out of range (a 64-bit integer)", param or name)
    if kind is float:
        try:
            value = float(value)
        except OverflowError:  # an integer beyond the float range
            value = math.inf
        if not math.isfinite(value):
            raise ApiError(f"'{param or name}' must be a finite number, got {value}", param or name)
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
