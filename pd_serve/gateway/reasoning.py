"""--reasoning-parser: a reasoning model's `<think>...</think>` split out of the output as
`reasoning_content`, the rest as `content` (vLLM's rules).

deepseek-r1: the output starts inside the reasoning (R1 leaves out the opening tag; a leading
`<think>` is dropped); `</think>` ends it; without one the whole output is reasoning.
qwen3: reasoning only where thinking is open: the output starts with `<think>`, or the prompt
(the chat template) ends inside an unclosed `<think>` (Qwen3-Thinking, Qwen3.5); `</think>`
ends it. Output that opens neither way is all content (thinking switched off).

One state machine serves streams and whole answers: fed the text in pieces, it hands out what
it is sure of (a possible start of a tag is held back); fed all at once, it gives the same split.
"""

from __future__ import annotations

from pd_serve.config import REASONING_PARSERS

START, END = "<think>", "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an unclosed <think> (the template opened it): its
    generation prompt, which ends it, ends with the tag. A <think> earlier on, unclosed (a user
    asking about the tag, an earlier turn's text), is inside a finished message."""
    return prompt.rstrip().endswith(START)


class ReasoningSplitter:
    """Splits one choice's output text; `feed(delta, final)` -> (reasoning delta, content delta)."""

    def __init__(self, parser: str, prompt_open: bool = False, constrained: bool = False):
        """constrained: the output is a grammar's from its first token (a structured output),
        so it is reasoning only where it opens `<think>` itself."""
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; one of {', '.join(REASONING_PARSERS)}")
        self._starts_inside = not constrained and (parser == "deepseek-r1" or prompt_open)
        self._state = "start"  # start (an opening tag may come) -> reasoning -> content
        self._pending = ""  # text received and not handed out
        self.reasoning_seen = False  # any reasoning state entered: content may be null

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self._pending += text
        reasoning = ""
        if self._state == "start":
            head = self._pending.lstrip()
            if not final and START.startswith(head):
                return "", ""  # nothing yet, or the opening tag still arriving
            if head.startswith(START):
                self._pending = head[len(START):]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self._starts_inside else "content"
            self.reasoning_seen = self._state == "reasoning"
        if self._state == "reasoning":
            end = self._pending.find(END)
            if end < 0:
                keep = 0 if final else _partial_tail(self._pending, END)
                reasoning = self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return reasoning, ""
            reasoning, self._pending = self._pending[:end], self._pending[end + len(END):]
            self._state = "content"
        content, self._pending = self._pending, ""
        return reasoning, content


def split_reasoning(parser: str, text: str, prompt_open: bool = False,
                    constrained: bool = False) -> tuple[str | None, str | None]:
    """A whole output as (reasoning or None, content or None), vLLM's non-streamed shape."""
    splitter = ReasoningSplitter(parser, prompt_open, constrained)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if splitter.reasoning_seen else None), (content or None)


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
