"""Tokenizer of a Hugging Face-format model folder, chat prompt rendering, streaming detokenization.

Built on the `tokenizers` library and jinja2 only (no transformers at serving time).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

# Prompt tokens decoded with the first output tokens, so a token's text is seen in context.
_PROMPT_CONTEXT_TOKENS = 5
# Ids an IncrementalDetokenizer holds back while their text ends inside a character (U+FFFD),
# at most: a character takes 4 tokens at most, so more are bytes that never form one.
_MAX_PENDING_TOKENS = 8
LONG_TEXT = 1 << 16  # characters from which encode releases the GIL (encode_batch)
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Attributes
    ----------
    eos_token_ids : frozenset[int]
        Ids that end generation: tokenizer_config's eos_token together with
        generation_config's eos_token_id (an int or a list).
    bos_token_id : int | None
    vocab_size : int
        Number of ids the tokenizer can produce, added tokens included.
    """

    def __init__(self, backend: _Backend, special_tokens: dict[str, str],
                 eos_token_ids: frozenset[int], bos_token_id: int | None,
                 chat_template: str | None):
        self._backend = backend
        self._special_tokens = special_tokens  # e.g. {"bos_token": "<|im_start|>", ...}
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._chat_template_source = chat_template
        self._chat_template = None  # compiled on first use
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        self._decoding = _decoding(json.loads(backend.to_str()).get("decoder"))
        self._token_bytes: dict[int, bytes] = {}  # token_bytes' answers so far

    @classmethod
    def from_dir(cls, model_dir: Path) -> "Tokenizer":
        """Load `tokenizer.json`, `tokenizer_config.json`, `generation_config.json` and
        `chat_template.jinja` (which, when present, wins over tokenizer_config's template).
        Only tokenizer.json is required; its absence raises ValueError naming the path."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer file not found: {path}")
        backend = _Backend.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        gen_config = _read_json(model_dir / "generation_config.json")

        special_tokens = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                special_tokens[key] = value

        eos_ids = set(_as_id_list(gen_config.get("eos_token_id")))
        if "eos_token" in special_tokens:
            eos_id = backend.token_to_id(special_tokens["eos_token"])
            if eos_id is not None:
                eos_ids.add(eos_id)
        bos_id = None
        if "bos_token" in special_tokens:
            bos_id = backend.token_to_id(special_tokens["bos_token"])
        if bos_id is None and isinstance(gen_config.get("bos_token_id"), int):
            bos_id = gen_config["bos_token_id"]

        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_template(config.get("chat_template"))
        return cls(backend, special_tokens, frozenset(eos_ids), bos_id, chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text are always recognised;
        `add_special_tokens` only controls what the post-processor adds (e.g. a BOS).
        A long text goes through encode_batch, which releases the GIL (encode holds it for
        seconds on a few MiB, stalling the gateway's event loop thread)."""
        if len(text) >= LONG_TEXT:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its vocabulary piece's length
        (a byte-level piece has a character per byte; a SentencePiece piece is its text, or
        `<0xNN>` for one byte), added tokens included. A text of more than N times this many
        characters tokenizes to more than N tokens."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also when it holds only part of a UTF-8 character
        (which `decode` shows as U+FFFD): OpenAI's logprob `bytes`, which a client joins to
        rebuild such characters. Byte-level BPE vocabularies (GPT-2's byte-to-character map)
        and SentencePiece byte fallback (`<0xNN>`, `▁` for a space) are read exactly; another
        decoder's tokens are their decoded text. Added tokens are their content."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._read_token_bytes(token_id)
        return cached

    def _read_token_bytes(self, token_id: int) -> bytes:
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if self._decoding == "byte_level":
            to_byte = _unicode_to_byte()
            if all(c in to_byte for c in piece):
                return bytes(to_byte[c] for c in piece)
        elif self._decoding == "byte_fallback":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def chat_template_matches(self, pattern: re.Pattern) -> bool:
        """Whether the chat template's source (if any) matches `pattern`."""
        return self._chat_template_source is not None and bool(
            pattern.search(self._chat_template_source))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) into a prompt string the
        way transformers does; extra keyword arguments (e.g. `tools`) reach the template."""
        if self._chat_template is None:
            if self._chat_template_source is None:
                raise ValueError("this model has no chat template (none in tokenizer_config.json "
                                 "or chat_template.jinja); send a plain prompt instead")
            self._chat_template = _compile_template(self._chat_template_source)
        return self._chat_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **self._special_tokens, **kwargs)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without ever splitting a UTF-8 character.

    Only a small window of ids is decoded per step: ids[prefix_offset:read_offset] is text
    already emitted (kept as context, since a token's text can depend on its neighbours) and
    ids[read_offset:] is not emitted yet. A step whose text ends in U+FFFD (an incomplete
    multi-byte character) emits "" and waits for the next token; flush() emits that text with
    its U+FFFD when the output ends there (as tokenizer.decode of the whole output gives it).
    It keeps no output text: callers join the deltas (a string grown on every token is copied
    on every token, which makes a long output's text work quadratic).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def step(self, new_token_ids: list[int]) -> str:
        """Append generated ids and return the text they complete (possibly "")."""
        self._ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The output ended: the text of ids not emitted yet (it ends inside a character, so in
        U+FFFD), or "" when there are none."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self._ids[self._prefix_offset:]
        read = self._read_offset - self._prefix_offset  # window[read:] is not emitted yet
        prefix_text = self._decode(window[:read])
        new_text = self._decode(window)
        end = len(window)
        if new_text.endswith("\ufffd") and not final:
            if len(window) - read <= _MAX_PENDING_TOKENS:
                return ""
            # A character's bytes span at most 4 tokens: text still ending in U+FFFD after
            # more pending tokens than that holds bytes no character completes (a model made
            # to emit lone continuation bytes, by logit_bias). Waiting on, the window grew a
            # token a step and each step decoded all of it: 8k such tokens took 8 s of the
            # gateway's event loop per choice. The text up to a cut before the last tokens is
            # emitted, at the last cut whose text the whole window's text goes on from.
            end = next((cut for cut in range(len(window) - 3, read, -1)
                        if new_text.startswith(text := self._decode(window[:cut]))), end)
            if end < len(window):
                new_text = text
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset += end - read
        # Drop ids left of the window so memory stays O(window) too.
        del self._ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""


def _decoding(decoder: dict | None) -> str:
    """How token_bytes reads a vocabulary piece, from tokenizer.json's decoder: "byte_level"
    (a ByteLevel decoder, alone or in a sequence), "byte_fallback" (a sequence with
    ByteFallback, SentencePiece style), else "text"."""
    decoder = decoder or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {step.get("type") for step in steps if isinstance(step, dict)}
    return "byte_level" if "ByteLevel" in types else (
        "byte_fallback" if "ByteFallback" in types else "text")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte-level map: printable Latin-1 bytes stand for themselves,
    the other 68 bytes (controls, space, ...) for the characters from U+0100 on, in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_id_list(value) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _pick_template(value) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {"name", "template"}."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Like transformers' filter: no HTML escaping (jinja2's own tojson escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
