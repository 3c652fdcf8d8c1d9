"""One chat choice's output text as OpenAI's assistant message: `reasoning_content` (a
--reasoning-parser), `content`, and `tool_calls` (a tool parser), whole or as stream deltas.

The text goes through the reasoning splitter first; what it leaves as content goes to the tool
parser. A stream sends what the parsers are sure of: a call's first delta carries its index,
id, type and name (arguments ""), later deltas the arguments' next fragments. An auto parser's
calls go out once the output has ended (tool_parsers.py: its final reading may take them back),
the text before the first call marker as it comes. With parallel_tool_calls false (max_calls
1) only the first call is kept, streamed or not, as vLLM does.
"""

from __future__ import annotations

import secrets

from pd_serve.gateway.reasoning import ReasoningSplitter, split_reasoning
from pd_serve.gateway.tool_parsers import ToolCallText, ToolParser, ToolReading


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ChatOutput:
    """Reads one choice's text. reasoning_parser: a REASONING_PARSERS name or None;
    prompt_open: the prompt ends inside <think>; tools: the tool parser or None; constrained:
    the output is under a grammar (reasoning only where it opens <think> itself); max_calls:
    the calls kept (None: all)."""

    def __init__(self, reasoning_parser: str | None, prompt_open: bool, tools: ToolParser | None,
                 constrained: bool = False, max_calls: int | None = None):
        self._reasoning_parser, self._prompt_open, self._tools = reasoning_parser, prompt_open, tools
        self._max_calls = max_calls
        self._constrained = constrained  # a grammar's output: reasoning only where it opens it
        self._splitter = (ReasoningSplitter(reasoning_parser, prompt_open, constrained)
                          if reasoning_parser else None)
        self._content = ""  # content text so far (what the tool parser reads)
        self._num_content_sent = 0
        self._sent_args: list[int] = []  # per call begun in the stream: characters of arguments sent
        self._call_ids: list[str] = []
        self._settled = 0  # leading calls complete, all their arguments sent

    @property
    def num_calls(self) -> int:
        """Tool calls begun in the stream so far."""
        return len(self._call_ids)

    @property
    def calls_finish(self) -> bool:
        """Whether an answer with calls ends with finish_reason "tool_calls" (not a named
        tool_choice's forced call, which ends as OpenAI ends it: "stop")."""
        return self._tools is not None and self._tools.names_finish

    def _calls(self, reading: ToolReading, final: bool) -> list[ToolCallText]:
        """The reading's calls to send: an auto parser's only at the end; at most max_calls."""
        if not final and self._tools.strict:
            return []
        return reading.calls[:self._max_calls]

    def deltas(self, text: str, final: bool) -> list[dict]:
        """The stream deltas (message fields) that `text`, the next piece of output, makes sure."""
        reasoning, content = self._splitter.feed(text, final) if self._splitter else ("", text)
        delta = {"reasoning_content": reasoning} if reasoning else {}
        if self._tools is None:
            if content:
                delta["content"] = content
            return [delta] if delta else []
        self._content += content
        reading = self._tools.parse(self._content, final)
        read_calls = self._calls(reading, final)
        if len(reading.content) > self._num_content_sent:
            delta["content"] = reading.content[self._num_content_sent:]
            self._num_content_sent = len(reading.content)
        calls, fragments = [], []
        # (calls before _settled are complete and sent whole: a reading repeats them unchanged)
        for i in range(self._settled, len(read_calls)):
            call = read_calls[i]
            if i == len(self._call_ids):
                self._call_ids.append(new_call_id())
                self._sent_args.append(0)
                calls.append({"index": i, "id": self._call_ids[i], "type": "function",
                              "function": {"name": call.name, "arguments": ""}})
            fragment = call.arguments[self._sent_args[i]:]
            if fragment:
                self._sent_args[i] = len(call.arguments)
                fragments.append({"index": i, "function": {"arguments": fragment}})
            if i == self._settled and call.complete and i + 1 < len(read_calls):
                self._settled += 1
        if calls:  # a call's first delta; its arguments follow in the next
            delta["tool_calls"] = calls
        elif fragments:
            delta["tool_calls"], fragments = fragments, []
        out = [delta] if delta else []
        return out + ([{"tool_calls": fragments}] if fragments else [])

    def message(self, text: str) -> dict:
        """The whole output as the assistant message."""
        message: dict = {"role": "assistant", "content": text}
        if self._reasoning_parser:
            reasoning, content = split_reasoning(self._reasoning_parser, text, self._prompt_open,
                                                 self._constrained)
            message.update(reasoning_content=reasoning, content=content)
        if self._tools is not None:
            reading = self._tools.parse(message["content"] or "", final=True)
            message["content"] = reading.content or None
            if calls := self._calls(reading, final=True):
                message["tool_calls"] = [
                    {"id": new_call_id(), "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}
                    for call in calls]
        return message
