"""Structured outputs: a request's Grammar as an xgrammar matcher, and the token bitmask that
keeps each sampled token inside it.

A matcher's state is a function of the output tokens so far, so nothing of it travels between
workers: every executor that samples a request (colocated; prefill, which samples token 1;
decode, from token 2 on) builds its own matcher from the plan's Grammar and replays the output
tokens it knows (decode: token 1) before it samples. Grammars are compiled once per (tokenizer,
Grammar): one `GrammarCompiler` per executor, its compiled grammars cached.

xgrammar (and the transformers tokenizer it reads the vocabulary from) is imported on the first
grammar request: a worker that serves none never loads it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections import OrderedDict
from pathlib import Path

import torch

from pd_serve.engine.sampling_params import Grammar

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
# JSON is generated without free whitespace between its tokens (vLLM's --disable-any-whitespace):
# with it a model can pad forever and never close the object.
_JSON_OPTIONS = dict(any_whitespace=False)


def check_grammar(grammar: Grammar) -> None:
    """Raise ValueError (xgrammar's reason) when the grammar does not parse: a bad schema,
    regex or EBNF. Needs no tokenizer; the gateway calls it so a bad one is a 400."""
    import xgrammar as xgr
    try:
        if grammar.kind == "json_schema":
            xgr.Grammar.from_json_schema(_schema_text(grammar.spec), **_JSON_OPTIONS)
        elif grammar.kind == "regex":
            xgr.Grammar.from_regex(grammar.spec)
        elif grammar.kind == "ebnf":
            xgr.Grammar.from_ebnf(grammar.spec)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own kinds
        raise ValueError(f"invalid {grammar.kind}: {_first_line(e)}") from None


class GrammarCompiler:
    """Compiles Grammars against one tokenizer (a model folder's tokenizer.json) and makes
    matchers; the last MAX_CACHED_GRAMMARS compiled grammars are kept."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        # vocab_size: the logits' width (the model's), which may exceed the tokenizer's.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[Grammar, object] = OrderedDict()
        self.vocab_size = vocab_size

    def matcher(self, grammar: Grammar) -> "GrammarState":
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = self._compile(grammar)
            self._compiled[grammar] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return GrammarState(self._xgr.GrammarMatcher(compiled))

    def _compile(self, grammar: Grammar):
        c = self._compiler
        if grammar.kind == "json_schema":
            return c.compile_json_schema(_schema_text(grammar.spec), **_JSON_OPTIONS)
        if grammar.kind == "json_object":  # any object: a schema that names no properties
            return c.compile_json_schema('{"type": "object"}', strict_mode=False, **_JSON_OPTIONS)
        if grammar.kind == "regex":
            return c.compile_regex(grammar.spec)
        return c.compile_grammar(grammar.spec)


class GrammarState:
    """One request's matcher, how many of its output tokens it has taken, and where its next
    token is while that is still on the device (overlap schedule: `defer`)."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_accepted = 0
        self._pending = None  # (PendingSample, row) of the newest output token, not known yet

    def accept(self, output_token_ids: list[int]) -> None:
        """Advance over the output tokens not taken yet (the list is every output token so far)."""
        self.catch_up()  # a deferred token first: it is among them
        for token in output_token_ids[self.num_accepted:]:
            self._take(token)

    def defer(self, sample, row: int) -> None:
        """The next output token is row `row` of `sample` (a PendingSample): taken, with a
        wait for it, by catch_up(), just before the mask is needed."""
        self._pending = (sample, row)

    def catch_up(self) -> None:
        if self._pending is not None:
            sample, row = self._pending
            self._pending = None
            self._take(sample.result().token_ids[row])

    def _take(self, token: int) -> None:
        # After the grammar has ended (its stop token sampled under ignore_eos) the rest of the
        # output is unconstrained.
        if self.active and not self.matcher.accept_token(token):
            logger.warning("grammar refused token %d after %d output tokens", token,
                           self.num_accepted)
        self.num_accepted += 1

    @property
    def active(self) -> bool:
        return not self.matcher.is_terminated()


def needs_grammar(requests) -> bool:
    """Whether any row samples under a grammar (rows: anything with an optional `grammar`)."""
    return any(getattr(r, "grammar", None) is not None for r in requests)


def apply_grammars(logits: torch.Tensor, requests) -> None:
    """Set to -inf, in place, the logits [B, V] (float32) of the tokens each row's grammar
    forbids next. Deferred tokens are taken first (a wait for the step before, whose samples
    are queued ahead of this step's forward). The bitmask is filled on the host, rows in
    parallel threads, and applied on the logits' device."""
    import xgrammar as xgr
    states = [getattr(r, "grammar", None) for r in requests]
    for state in states:
        if state is not None:
            state.catch_up()
    rows = [i for i, state in enumerate(states) if state is not None and state.active]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(requests), logits.shape[1])  # [B, ceil(V / 32)] int32
    _batch_matcher().batch_fill_next_token_bitmask([states[i].matcher for i in rows], bitmask, rows)
    if logits.device.type == "cuda":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


# A JSON string's characters that need no escape, as a regex class: not '"', '\\' or U+0000-U+001F.
_PLAIN_CHAR = '[^"\\\\\\x00-\\x1f]'


def _schema_text(spec: str) -> str:
    """The schema xgrammar compiles: xgrammar 0.2.9 turns a string's minLength / maxLength into
    that many characters of a class that lets control characters through (the output is then
    not JSON), so such a string gets a pattern with the same bounds over the characters JSON
    allows unescaped instead."""
    if "Length" not in spec:
        return spec
    try:
        schema = json.loads(spec)
    except ValueError:
        return spec  # xgrammar says what is wrong with it
    _bound_strings(schema)
    return json.dumps(schema)


def _bound_strings(node) -> None:
    if isinstance(node, list):
        for item in node:
            _bound_strings(item)
    if not isinstance(node, dict):
        return
    low, high = node.get("minLength", 0), node.get("maxLength", "")
    if node.get("type") == "string" and ("minLength" in node or "maxLength" in node) \
            and "pattern" not in node and "format" not in node \
            and isinstance(low, int) and isinstance(high, (int, str)):
        node["pattern"] = f"^{_PLAIN_CHAR}{{{low},{high}}}$"  # the bounds move into it
        node.pop("minLength", None)
        node.pop("maxLength", None)
    for value in node.values():
        _bound_strings(value)


@functools.cache
def _batch_matcher():
    """xgrammar's thread pool that fills many rows' bitmasks at once."""
    import xgrammar as xgr
    return xgr.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))


def _first_line(error: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix, first line only."""
    text = str(error).strip() or type(error).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:500]


def canonical_json(schema) -> str:
    """A schema as compact JSON with sorted keys: equal schemas give one cache entry."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
