"""Structured outputs: a request's Grammar as an xgrammar matcher, and the token bitmask that
keeps each sampled token inside it.

A matcher's state is a function of the output tokens so far, so nothing of it travels between
workers: every executor that samples a request (colocated; prefill, which samples token 1;
decode, from token 2 on) builds its own matcher from the plan's Grammar and replays the output
tokens it knows (decode: token 1) before it samples. Grammars are compiled once per (tokenizer,
Grammar): one `GrammarCompiler` per executor, its compiled grammars cached. A compile takes from
milliseconds to seconds (a 7 KiB EBNF grammar: 1 s on one core), so it runs on a thread of its
own (`GrammarCompiler.ready`): the engine's scheduler admits the request once it is done, and
every other request steps on meanwhile.

The host work of a grammar row (take the token just sampled, fill the next token's bitmask) runs
on one background thread (`advance_grammars`), queued as soon as a step's sampling is: it waits
for that step's tokens and works while the host plans and launches the next step and the device
runs its forward (xgrammar lets go of the GIL). The next step's mask then only gathers the rows
filled ahead. A state waits for its job before anything else reads or moves its matcher.

xgrammar (and the transformers tokenizer it reads the vocabulary from) is imported on the first
grammar request: a worker that serves none never loads it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pd_serve.engine.sampling_params import Grammar

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
MAX_CACHED_GRAMMAR_BYTES = 2**30  # and their compiled size (a large enum's is tens of MiB)
# A grammar's text (a schema, regex or EBNF; a required tool_choice's is all the tools'). The
# compile has no time bound and grows faster than its text: on 2 CPU cores an enum of 128 KiB
# compiles in 0.4 s to 27 MiB, one of 2 MB took 37 s.
MAX_GRAMMAR_CHARS = 2**17
# JSON is generated without free whitespace between its tokens (vLLM's --disable-any-whitespace):
# with it a model can pad forever and never close the object.
_JSON_OPTIONS = dict(any_whitespace=False)


def check_grammar(grammar: Grammar) -> None:
    """Raise ValueError (xgrammar's reason) when the grammar does not parse (a bad schema,
    regex or EBNF) or admits no output at all (`root ::= root "a"`: every token would be
    masked). Needs no model tokenizer: it compiles against a vocabulary of the 256 bytes and a
    stop token, where a grammar that admits any string allows a first byte or the stop. The
    gateway calls it so a bad grammar is a 400."""
    import xgrammar as xgr
    _check_size(grammar)
    with _invalid(grammar):
        compiled = _compile_with(_byte_compiler(), grammar)
    bitmask = xgr.allocate_token_bitmask(1, 257)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    if not bitmask.any():
        raise ValueError(f"invalid {grammar.kind}: it admits no output (no string matches it)")


def parse_grammar(grammar: Grammar) -> None:
    """Raise ValueError when the grammar does not parse: what a worker checks of a request's
    grammar as it arrives (the gateway's check_grammar also compiles it; a peer with the
    cluster key may send one that fails to compile, which would fail the worker's step).
    Parsing alone costs little next to the compile, which runs later, off the main loop."""
    import xgrammar as xgr
    _check_size(grammar)
    with _invalid(grammar):
        if grammar.kind == "json_schema":
            xgr.Grammar.from_json_schema(_schema_text(grammar.spec), **_JSON_OPTIONS)
        elif grammar.kind == "regex":
            xgr.Grammar.from_regex(grammar.spec)
        elif grammar.kind == "ebnf":
            xgr.Grammar.from_ebnf(grammar.spec)


def _check_size(grammar: Grammar) -> None:
    if len(grammar.spec) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the {grammar.kind} is {len(grammar.spec)} characters; at most "
                         f"{MAX_GRAMMAR_CHARS} (its compile grows faster than its size)")


@contextlib.contextmanager
def _invalid(grammar: Grammar):
    """xgrammar's errors (RuntimeError, ValueError, its own kinds) as a ValueError naming the
    grammar's kind and xgrammar's reason."""
    try:
        yield
    except Exception as e:
        raise ValueError(f"invalid {grammar.kind}: {_first_line(e)}") from None


@functools.cache
def _byte_compiler():
    """An xgrammar compiler over the 256 bytes as tokens, and a stop token (id 256)."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"],
                             vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _compile_with(compiler, grammar: Grammar):
    """The grammar compiled by an xgrammar GrammarCompiler."""
    if grammar.kind == "json_schema":
        return compiler.compile_json_schema(_schema_text(grammar.spec), **_JSON_OPTIONS)
    if grammar.kind == "json_object":  # any object: a schema that names no properties
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **_JSON_OPTIONS)
    if grammar.kind == "regex":
        return compiler.compile_regex(grammar.spec)
    return compiler.compile_grammar(grammar.spec)


class GrammarCompiler:
    """Compiles Grammars against one tokenizer (a model folder's tokenizer.json) and makes
    matchers; the last compiled grammars are kept (_store's bounds)."""

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
        self._bytes = 0  # the kept grammars' compiled size
        self._compiling: dict[Grammar, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.vocab_size = vocab_size

    def ready(self, grammar: Grammar) -> bool:
        """Whether `matcher(grammar)` returns at once: compiled (the compile starts on the
        first call, on the compile thread, which xgrammar runs without the GIL)."""
        if grammar in self._compiled:
            return True
        future = self._compiling.get(grammar)
        if future is None:
            self._compiling[grammar] = self._pool.submit(self._compile, grammar)
            return False
        if not future.done():
            return False
        del self._compiling[grammar]
        if future.exception() is None:  # else matcher() compiles it again, and raises
            self._store(grammar, future.result())
        return True

    def wait(self, timeout_s: float) -> None:
        """Until a compile under way ends, or timeout_s (at once when none is)."""
        if self._compiling:
            futures.wait(list(self._compiling.values()), timeout_s,
                         return_when=futures.FIRST_COMPLETED)

    def matcher(self, grammar: Grammar) -> "GrammarState":
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = self._compile(grammar)
            self._store(grammar, compiled)
        else:
            self._compiled.move_to_end(grammar)
        return GrammarState(self._xgr.GrammarMatcher(compiled))

    def _store(self, grammar: Grammar, compiled) -> None:
        """Keep it; the oldest go while more than MAX_CACHED_GRAMMARS or _BYTES are kept."""
        self._compiled[grammar] = compiled
        self._bytes += compiled.memory_size_bytes
        while len(self._compiled) > 1 and (len(self._compiled) > MAX_CACHED_GRAMMARS
                                           or self._bytes > MAX_CACHED_GRAMMAR_BYTES):
            self._bytes -= self._compiled.popitem(last=False)[1].memory_size_bytes

    def _compile(self, grammar: Grammar):
        return _compile_with(self._compiler, grammar)


class GrammarState:
    """One request's matcher, how many of its output tokens it has taken, the background job
    (advance_grammars) that may be moving it, and its next token's bitmask when filled ahead."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_accepted = 0
        self.num_queued = 0  # num_accepted plus the token a background job has still to take
        self.ended = False  # the matcher has terminated (kept here: no call into xgrammar to ask)
        self._job: Future | None = None
        self._mask: tuple[_Filled, int] | None = None  # valid while num_accepted == _mask_at
        self._mask_at = -1

    def accept(self, output_token_ids: list[int]) -> None:
        """Advance over the output tokens not taken yet (the list is every output token so far;
        a token the background job takes is not taken twice). Waits for the job only when
        there is a token past it (one sampled elsewhere), so a plan's update never waits for
        the step in flight."""
        if len(output_token_ids) <= self.num_queued:
            return
        self.wait()
        for token in output_token_ids[self.num_accepted:]:
            self._take(token)

    def wait(self) -> None:
        """Wait for the background job on this matcher (its error is raised here)."""
        if self._job is not None:
            job, self._job = self._job, None
            job.result()

    @property
    def active(self) -> bool:
        self.wait()
        return not self.ended

    def filled_mask(self) -> tuple[_Filled, int] | None:
        """Where the background job filled the next token's bitmask (the job's masks and this
        state's row in them), if it did for the current state."""
        self.wait()
        return self._mask if self._mask_at == self.num_accepted else None

    def _take(self, token: int) -> None:
        # After the grammar has ended (its stop token sampled under ignore_eos) the rest of the
        # output is unconstrained.
        if not self.ended:
            if not self.matcher.accept_token(token):
                logger.warning("grammar refused token %d after %d output tokens", token,
                               self.num_accepted)
            self.ended = self.matcher.is_terminated()
        self.num_accepted += 1
        self.num_queued = max(self.num_queued, self.num_accepted)


@dataclass
class _Filled:
    """One background job's next-token bitmasks: row i for states[i] (a row whose grammar has
    ended allows every token), in host memory the device copies from."""

    states: list[GrammarState]
    bitmask: torch.Tensor  # int32 [len(states), ceil(V / 32)]


def needs_grammar(requests) -> bool:
    """Whether any row samples under a grammar (rows: anything with an optional `grammar`)."""
    return any(getattr(r, "grammar", None) is not None for r in requests)


def apply_grammars(logits: torch.Tensor, requests) -> None:
    """Set to -inf, in place, the logits [B, V] (float32) of the tokens each row's grammar
    forbids next. The masks the background job filled for these rows are used as they are when
    the rows are that job's, in its order (a steady decode batch), else gathered; rows it did
    not fill (a request new to this executor, a token replayed) are filled here. Applied on the
    logits' device."""
    import xgrammar as xgr
    states = [getattr(r, "grammar", None) for r in requests]
    rows = [i for i, state in enumerate(states) if state is not None and state.active]
    if not rows:
        return
    masks = [states[i].filled_mask() for i in rows]
    filled = masks[0][0] if masks[0] is not None else None
    if filled is not None and filled.states == states and all(m is not None and m[0] is filled
                                                              for m in masks):
        bitmask = filled.bitmask
    else:
        bitmask = xgr.allocate_token_bitmask(len(requests), logits.shape[1])  # [B, ceil(V / 32)]
        ready = [(i, m) for i, m in zip(rows, masks) if m is not None]
        if ready:
            bitmask[[i for i, _ in ready]] = torch.stack([m[0].bitmask[m[1]] for _, m in ready])
        todo = [i for i, m in zip(rows, masks) if m is None]
        if todo:
            _batch_matcher().batch_fill_next_token_bitmask([states[i].matcher for i in todo],
                                                           bitmask, todo)
        if logits.device.type == "cuda":
            bitmask = bitmask.pin_memory()
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=rows)


def advance_grammars(sample, requests, vocab_size: int) -> None:
    """Queue on the grammar thread: once `sample` (a PendingSample, row i for requests[i]) has
    its tokens, each grammar row takes its token and, unless its grammar ended, fills its next
    token's bitmask. Until then the rows' states wait for this job before any use."""
    pairs = [(i, r.grammar) for i, r in enumerate(requests) if getattr(r, "grammar", None) is not None]
    if not pairs:
        return
    all_rows = len(pairs) == len(requests)
    job = _grammar_thread().submit(_advance, sample, pairs, vocab_size, all_rows,
                                   sample.tokens.device.type == "cuda")
    for _, state in pairs:
        state._job = job
        state.num_queued += 1


def _advance(sample, pairs: list, vocab_size: int, all_rows: bool, pinned: bool) -> None:
    """The job advance_grammars queues (jobs run one at a time, in order: a state's job before
    is done, so its matcher is this job's alone)."""
    import xgrammar as xgr
    tokens = sample.result().token_ids
    live = [(state, tokens[i]) for i, state in pairs if not state.ended]
    accepted = _batch_matcher("job").batch_accept_token([s.matcher for s, _ in live],
                                                        [t for _, t in live])
    for (state, token), ok in zip(live, accepted):
        if not ok:
            logger.warning("grammar refused token %d after %d output tokens", token,
                           state.num_accepted)
        state.ended = state.matcher.is_terminated()
    for _, state in pairs:
        state.num_accepted += 1
    going = [row for row, (_, state) in enumerate(pairs) if not state.ended]
    if not going:
        return
    bitmask = xgr.allocate_token_bitmask(len(pairs), vocab_size)  # ended rows: every token
    if pinned:
        bitmask = bitmask.pin_memory()
    _batch_matcher("job").batch_fill_next_token_bitmask([pairs[r][1].matcher for r in going],
                                                        bitmask, going)
    filled = _Filled([state for _, state in pairs] if all_rows else [], bitmask)
    for row in going:
        state = pairs[row][1]
        state._mask, state._mask_at = (filled, row), state.num_accepted


# A JSON string's characters that need no escape, as a regex: not '"', '\\' or U+0000-U+001F, and
# no surrogate (U+D800-U+DFFF). One range per UTF-8 length: xgrammar 0.2.9 builds a range that
# spans two lengths (or a negated class) with byte paths no decoder takes, overlong forms and
# surrogates, each of whose bytes then decodes to its own U+FFFD, past the length bound.
_PLAIN_CHAR = ('(?:[ !#-\\[\\]-\\x7f]|[\\u0080-\\u07ff]|[\\u0800-\\ud7ff]|[\\ue000-\\uffff]'
               '|[\\u{10000}-\\u{10ffff}])')


def _schema_text(spec: str) -> str:
    """The schema xgrammar compiles: xgrammar 0.2.9 turns a string's minLength / maxLength into
    that many characters of a class that lets control characters through (the output is then
    not JSON), so such a string gets a pattern with the same bounds over the characters JSON
    allows unescaped (and a decoder reads as one character) instead."""
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


# JSON-schema keywords that xgrammar 0.2.9 compiles but does not enforce: its grammar then admits
# instances the schema refuses (tried on a valid and an invalid instance of each). It also drops
# what sits beside allOf, $ref, anyOf or oneOf (but annotations), and takes allOf as one subschema.
_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
               "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedProperties")
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated",
                "readOnly", "writeOnly", "$defs", "definitions", "$schema", "$id"}
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedItems",
              "propertyNames", "contains", "not", "if", "then", "else", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def unenforced_keyword(schema, path: str = "$") -> str | None:
    """What of a JSON schema the grammar does not enforce, first found, as "'keyword' at
    path" (with why, where it is not the keyword itself), or None. Walks the schema's
    keywords, not its data (const, enum, default) or property names."""
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return f"{key!r} at {path}"
    for key in ("allOf", "$ref", "anyOf", "oneOf"):
        if key in schema and (beside := sorted(set(schema) - _ANNOTATIONS - {key})):
            return f"{key!r} at {path} (with {', '.join(beside)} beside it)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' at {path} (of more than one schema)"
    if isinstance(schema.get("$ref"), str) and not schema["$ref"].startswith("#"):
        return f"'$ref' at {path} (to another document)"
    names = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if isinstance(schema.get("required"), list) and (missing := [
            n for n in schema["required"] if n not in names]):
        return f"'required' at {path} ({missing[0]!r} is not among its properties)"
    children = [(f"{path}.{key}", schema[key]) for key in _SUBSCHEMA if key in schema]
    children += [(f"{path}.{key}[{i}]", sub) for key in _SUBSCHEMA_LISTS
                 if isinstance(schema.get(key), list) for i, sub in enumerate(schema[key])]
    children += [(f"{path}.{key}.{name}", sub) for key in _NAMED_SUBSCHEMAS
                 if isinstance(schema.get(key), dict) for name, sub in schema[key].items()]
    for where, sub in children:
        if found := unenforced_keyword(sub, where):
            return found
    return None


@functools.cache
def _grammar_thread() -> ThreadPoolExecutor:
    """The one thread advance_grammars queues on (one: a state's jobs stay in order)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")


@functools.cache
def _batch_matcher(user: str = "sampler"):
    """xgrammar's thread pool that fills many rows' bitmasks at once: one per thread that uses
    it (user: "sampler" or "job"), as one is not safe to call from two threads at once. Half
    the cores, up to 8: on a 16-core H200 host 8 threads filled 64 JSON rows about twice as
    fast as one; on 2 cores a second thread costs more than it saves (2 ms against 0.5 ms)."""
    import xgrammar as xgr
    return xgr.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))


def _first_line(error: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix, first line only."""
    text = str(error).strip() or type(error).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:500]


def canonical_json(schema) -> str:
    """A schema as compact JSON, its keys in the request's order: xgrammar writes an object's
    properties in the schema's order, as OpenAI's structured outputs do (a "reasoning"
    property listed before "answer" is written first); sorted keys would reorder them."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
