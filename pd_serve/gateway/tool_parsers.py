"""Tool calls read out of a model's text: the formats --tool-call-parser names, and the JSON
that `tool_choice` required / named force through a grammar.

Every parser answers `parse(text, final)` for the output text so far. While the request runs
(final False) the answer is a prefix-stable partial reading: `content` is text that is surely
not part of a call (a possible start of a call marker is held back), and each call appears once
its name is known, its `arguments` the raw JSON text received so far. The final reading of an
auto parser (`strict`) is strict, as vLLM's: output that does not parse as calls is all
content. A later token can still turn such a reading's calls into content (a bad block, text
after a JSON call), so a stream sends an auto parser's calls only from its final reading
(openai_message.py): streamed and whole answers agree. Required and named choices are JSON a
grammar forces: their partial readings are the final one's beginning, and stream as they come.

Arguments are the model's own JSON text (a slice of the output, not re-serialised), so the
streamed fragments add up to exactly the non-streamed arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pd_serve.config import TOOL_CALL_PARSERS


_DECODER = json.JSONDecoder()
# An object that opens with its name, then its arguments: {"name": "f", "arguments": ...
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WHITESPACE = re.compile(r"\s*")


@dataclass
class ToolCallText:
    """One call as read so far: arguments is raw JSON text (partial while `complete` is False)."""

    name: str
    arguments: str
    complete: bool = True


@dataclass
class ToolReading:
    """What a parser reads in the output: content text and the calls."""

    content: str
    calls: list[ToolCallText] = field(default_factory=list)


class ToolParser:
    """Reads tool calls in output text. `keeps_special_tokens`: its markers are special tokens,
    so the output must be detokenized with them (skip_special_tokens off)."""

    keeps_special_tokens = False
    strict = True  # the final reading may take back partial calls (module docstring)
    names_finish = True  # an answer with calls ends with finish_reason "tool_calls"
    # (text, state): where a parser of the calls in `text` may go on from in a text that goes
    # on from it (what is before reads the same there). A stream parses its output again at
    # every delta: reading every call from the start made n calls cost n^2 (800 small calls:
    # 20-35 s of the gateway's event loop per choice).
    _resume: tuple[str, tuple] | None = None

    def parse(self, text: str, final: bool) -> ToolReading:
        raise NotImplementedError

    def _resumed(self, text: str) -> tuple | None:
        resume = self._resume
        return resume[1] if resume is not None and text.startswith(resume[0]) else None

    def _keep(self, text: str, upto: int, *state) -> None:
        self._resume = (text[:upto], state)


class HermesParser(ToolParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
    call; content is the text before the first block."""

    keeps_special_tokens = True
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ToolReading:
        first = text.find(self.start)
        if first < 0:
            return ToolReading(text if final else _hold_back(text, self.start))
        content, calls, pos = text[:first].rstrip(), [], first
        if resume := self._resumed(text):  # (after a block's end marker)
            calls, pos = list(resume[0]), _skip(text, resume[1])
        while text.startswith(self.start, pos):
            call, end = object_call(text, _skip(text, pos + len(self.start)), final)
            if call is not None:
                calls.append(call)
            if call is None or end is None:  # not a call, or not complete yet
                return ToolReading(text) if final else ToolReading(content, calls)
            pos = _skip(text, end)
            if text.startswith(self.end, pos):  # (a last block may leave it out)
                pos += len(self.end)
                self._keep(text, pos, calls[:], pos)
                pos = _skip(text, pos)
        return ToolReading(content, calls)  # text after the blocks is dropped, as in vLLM


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects (v0.3), or
    `name[ARGS]{...}` after each `[TOOL_CALLS]` (tokenizer v11 on)."""

    keeps_special_tokens = True
    start, args = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> ToolReading:
        first = text.find(self.start)
        if first < 0:
            return ToolReading(text if final else _hold_back(text, self.start))
        content = text[:first].rstrip()
        rest = text[first + len(self.start):]
        pos = _skip(rest, 0)
        if pos == len(rest) or rest[pos] == "[":
            resume = self._resumed(text)
            calls, end, point = array_calls(rest, pos, final, resume)
            if point is not None:  # (rest's offsets: the prefix is the same in both)
                self._keep(text, first + len(self.start) + point[1] + 1, *point)
            if final and (end is None or rest[end:].strip()):
                return ToolReading(text)
            return ToolReading(content, calls)
        calls = []
        while True:  # name[ARGS]{...}, each after a [TOOL_CALLS]
            name, sep, _ = rest[pos:].partition(self.args)
            if not sep or self.start in name:
                return ToolReading(text) if final else ToolReading(content, calls)
            start = _skip(rest, pos + len(name) + len(self.args))
            end = json_end(rest, start)
            if end is None and final:
                return ToolReading(text)
            calls.append(ToolCallText(name.strip(), rest[start:end or len(rest)], end is not None))
            if end is None:
                return ToolReading(content, calls)
            pos = _skip(rest, end)
            if not rest.startswith(self.start, pos):
                return ToolReading(text) if final and rest[pos:] else ToolReading(content, calls)
            pos += len(self.start)


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
    (after an optional <|python_tag|>), several separated by `;`. Output that starts otherwise
    is content."""

    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ToolReading:
        pos = _skip(text, 0)
        if text.startswith(self.python_tag, pos):
            pos = _skip(text, pos + len(self.python_tag))
        elif not final and self.python_tag.startswith(text[pos:]):
            return ToolReading("")  # empty so far, or a tag still arriving
        if pos == len(text) and not final:
            return ToolReading("")
        if pos == len(text) or text[pos] != "{":
            return ToolReading(text)
        calls = []
        if resume := self._resumed(text):  # (after a call's ";")
            calls, pos = list(resume[0]), _skip(text, resume[1])
        while True:
            call, end = object_call(text, pos, final)
            if call is None and end is not None:
                return ToolReading(text)  # a JSON object, but not a call: an answer
            if call is not None:
                calls.append(call)
            if end is None:
                return ToolReading(text) if final else ToolReading("", calls)
            pos = _skip(text, end)
            if pos == len(text):
                return ToolReading("", calls)
            if text[pos] != ";":
                return ToolReading(text) if final else ToolReading("", calls)
            self._keep(text, pos + 1, calls[:], pos + 1)
            pos = _skip(text, pos + 1)


class RequiredParser(ToolParser):
    """tool_choice required: the grammar makes the output a JSON array of
    {"name": ..., "parameters": {...}}. Read the same way while running and at the end (a cut
    output keeps the calls begun); no call at all leaves the text as content."""

    strict = False

    def parse(self, text: str, final: bool) -> ToolReading:
        calls, _, point = array_calls(text, _skip(text, 0), False, self._resumed(text))
        if point is not None:
            self._keep(text, point[1] + 1, *point)
        return ToolReading(text if final and not calls else "", calls)


class NamedParser(ToolParser):
    """tool_choice naming a function: the grammar makes the whole output its arguments. The
    answer ends as any other ("stop", "length"), as OpenAI ends a forced call."""

    strict = False
    names_finish = False

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> ToolReading:
        return ToolReading("", [ToolCallText(self.name, text, final)])


def make_parser(name: str) -> ToolParser:
    """The parser --tool-call-parser names."""
    parsers = {"llama3_json": Llama3JsonParser, "hermes": HermesParser, "mistral": MistralParser}
    if name not in parsers:
        raise ValueError(f"unknown tool call parser {name!r}; one of {', '.join(TOOL_CALL_PARSERS)}")
    return parsers[name]()


# ---- JSON pieces -----------------------------------------------------------------------------
def json_end(text: str, start: int) -> int | None:
    """Where the JSON value at text[start] ends, or None when it is not complete (or not JSON)."""
    try:
        return _DECODER.raw_decode(text, start)[1]
    except ValueError:
        return None


def object_call(text: str, start: int, final: bool) -> tuple[ToolCallText | None, int | None]:
    """The call in the JSON object at text[start] and where the object ends (None: not complete).
    Partial (final False): a call once its name is read, with the arguments received so far.
    An object that names its arguments before its name is read once complete. A name (or
    arguments) whose escapes do not make text (a bad escape, a lone surrogate) is no call."""
    end = json_end(text, start)
    match = _NAME_FIRST.match(text, start)
    if match is not None:
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            return None, end
        if not _is_text(name):
            return None, end
        args_end = json_end(text, match.end())
        complete = args_end is not None and end is not None
        if final and not complete:
            return None, None
        return ToolCallText(name, text[match.end():args_end or len(text)], complete), end
    if end is None:
        return None, None
    obj = json.loads(text[start:end])
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, end
    args = obj.get("arguments", obj.get("parameters", {}))
    text_args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    if not (_is_text(obj["name"]) and _is_text(text_args)):
        return None, end
    return ToolCallText(obj["name"], text_args), end


def _is_text(s: str) -> bool:
    """Whether s encodes as UTF-8 (a JSON escape can make a lone surrogate, which cannot)."""
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def array_calls(text: str, start: int, final: bool,
                resume: tuple[list[ToolCallText], int] | None = None
                ) -> tuple[list[ToolCallText], int | None, tuple[list[ToolCallText], int] | None]:
    """The calls in a JSON array of call objects at text[start], where the array ends, and the
    point to resume at (the calls before a comma, the comma's place; None: none) for a longer
    text that begins with text[:comma + 1]: what is before it reads the same there."""
    calls: list[ToolCallText] = []
    point = None
    if resume is not None:
        calls, point, pos = list(resume[0]), resume, _skip(text, resume[1] + 1)
    elif not text.startswith("[", start):
        return calls, None, None
    else:
        pos = _skip(text, start + 1)
    while pos < len(text):
        if text[pos] == "]":
            return calls, pos + 1, point
        call, end = object_call(text, pos, final)
        if call is not None:
            calls.append(call)
        if end is None:
            break
        pos = _skip(text, end)
        if text.startswith(",", pos):
            point = (calls[:], pos)
            pos = _skip(text, pos + 1)
    return calls, None, point


def _skip(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def _hold_back(text: str, marker: str) -> str:
    """Text without a tail that could be the start of `marker`, and without trailing whitespace
    (it may stand before a call, where it is dropped)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k].rstrip()
    return text.rstrip()
