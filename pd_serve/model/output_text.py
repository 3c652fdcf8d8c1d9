"""Output text of one request: incremental detokenization, stop strings, and stream hold-back,
for the gateway's OpenAI handlers and the engine's RequestOutput alike.

The token source enforces EOS, stop token ids and max_tokens; stop strings need text, so they
are found here. While a request runs, the last len(longest stop string) - 1 characters are held
back, so a stream never shows the start of a stop string that a later token completes.
"""

from __future__ import annotations

from pd_serve.model.tokenizer import IncrementalDetokenizer, Tokenizer


def _stop_token(params, token_id: int, eos_token_ids) -> bool:
    """A stop_token_ids entry, or an EOS unless ignore_eos. params: SamplingParams."""
    return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids)


def stop_token_ends(params, token_id: int, num_output: int, eos_token_ids) -> bool:
    """Whether `token_id`, the output's num_output-th token, ends it: a stop token once
    min_tokens are out (the token source's rule, engine.core.token_stop_reason)."""
    return params.may_stop(num_output) and _stop_token(params, token_id, eos_token_ids)


def hides_stop_token(params, token_id: int, eos_token_ids) -> bool:
    """Whether `token_id`, having ended an output with finish_reason stop, stays out of its text:
    vLLM's rule, an EOS or a stop_token_ids entry adds no text unless include_stop_str_in_output
    (then its text, "" for a special token skipped)."""
    return not params.include_stop_str_in_output and _stop_token(params, token_id, eos_token_ids)


def stop_reason(stop_string: str | None, params, token_id: int | None,
                eos_token_ids) -> str | int | None:
    """vLLM's stop_reason of an output that ended with finish_reason stop: the stop string
    found (OutputText.stop_string), else the last token `token_id` if it is a stop_token_ids
    entry and not an EOS that ended it; None for an EOS."""
    if stop_string is not None:
        return stop_string
    if token_id is None or token_id not in params.stop_token_ids:
        return None
    return None if not params.ignore_eos and token_id in eos_token_ids else token_id


class OutputText:
    """Feed it token ids as they arrive; take text deltas that are safe to show.

    The text is kept as the pieces handed out plus the text not handed out yet (the hold-back
    and what came since), so a token costs its own text, never a copy of the output so far. A
    stop string found in new text starts at most hold-back characters before it, inside the
    text not handed out.

    Attributes
    ----------
    text : str
        All output text so far; cut before the stop string once one is found.
    stopped : bool
        A stop string was found; tokens after the one that completed it are not taken.
    stop_string : str or None
        The stop string found.
    token_offsets : list[int]
        Per taken token, where its text starts in `text` (OpenAI's text_offset).
    shown : str
        The text handed out by `take_delta` so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, min_tokens: int = 0,
                 include_stop: bool = False):
        """min_tokens: stop strings are looked for only once more tokens than this are out
        (vLLM's rule); include_stop: the stop string found stays in the text."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = stop
        self._min_tokens, self._include_stop = min_tokens, include_stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._shown: list[str] = []  # the deltas take_delta handed out
        self._num_chars_sent = 0
        self._unsent = ""  # the text after them
        self.stopped = False
        self.stop_string: str | None = None
        self.token_offsets: list[int] = []

    @property
    def text(self) -> str:
        return self.shown + self._unsent

    @property
    def num_chars_shown(self) -> int:
        return self._num_chars_sent

    @property
    def shown(self) -> str:
        if len(self._shown) > 1:
            self._shown[:] = ["".join(self._shown)]
        return self._shown[0] if self._shown else ""

    def add(self, token_ids: list[int], hide_last: bool = False) -> int:
        """Take token ids in order until one completes a stop string; return how many were taken.
        hide_last: the last token ended the output and adds no text (`hides_stop_token`)."""
        for i, token_id in enumerate(token_ids):
            self.token_offsets.append(self._num_chars_sent + len(self._unsent))
            if hide_last and i == len(token_ids) - 1:
                break
            if self._took_text(self._detokenizer.step([token_id])):
                return i + 1
        return len(token_ids)

    def _took_text(self, delta: str) -> bool:
        """Append `delta`; True if a stop string ends in it once more than min_tokens tokens
        are out: the text is then cut before the first one found (after it, with include_stop)."""
        start = len(self._unsent)
        self._unsent += delta
        look = len(self.token_offsets) > self._min_tokens
        if self._stop and delta and look:  # a stop string ends in the new text, if anywhere
            hits = [(j, len(s), s) for s in self._stop
                    if (j := self._unsent.find(s, max(0, start - len(s) + 1))) >= 0]
            if hits:
                at, size, self.stop_string = min(hits)
                self._unsent = self._unsent[:at + size if self._include_stop else at]
                self.stopped = True
        return self.stopped

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; all of it once finished (with the text of tokens that end
        inside a character, U+FFFD, as tokenizer.decode gives it), else all but the hold-back."""
        if finished and not self.stopped:
            self._took_text(self._detokenizer.flush())
        end = len(self._unsent) if finished or self.stopped else len(self._unsent) - self._holdback
        if end <= 0:
            return ""
        delta, self._unsent = self._unsent[:end], self._unsent[end:]
        self._shown.append(delta)
        self._num_chars_sent += end
        return delta
