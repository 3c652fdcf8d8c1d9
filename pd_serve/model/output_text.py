"""Output text of one request: incremental detokenization, stop strings, and stream hold-back,
for the gateway's OpenAI handlers and the engine's RequestOutput alike.

The token source enforces EOS, stop token ids and max_tokens; stop strings need text, so they
are found here. While a request runs, the last len(longest stop string) - 1 characters are held
back, so a stream never shows the start of a stop string that a later token completes.
"""

from __future__ import annotations

from pd_serve.model.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputText:
    """Feed it token ids as they arrive; take text deltas that are safe to show.

    Attributes
    ----------
    text : str
        All output text so far; cut before the stop string once one is found.
    stopped : bool
        A stop string was found; tokens after the one that completed it are not taken.
    token_offsets : list[int]
        Per taken token, where its text starts in `text` (OpenAI's text_offset).
    shown : str
        The text handed out by `take_delta` so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True):
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._num_chars_sent = 0
        self.text = ""
        self.stopped = False
        self.token_offsets: list[int] = []

    def add(self, token_ids: list[int], hide_last: bool = False) -> int:
        """Take token ids in order until one completes a stop string; return how many were taken.
        hide_last: the last token is the EOS that ended the output; it adds no text (as in vLLM,
        also when special tokens are kept)."""
        for i, token_id in enumerate(token_ids):
            start = len(self._detokenizer.text)
            self.token_offsets.append(start)
            if hide_last and i == len(token_ids) - 1:
                break
            self._detokenizer.step([token_id])
            if self._took_text(start):
                return i + 1
        return len(token_ids)

    def _took_text(self, start: int) -> bool:
        """The detokenizer's text grew from `start`: update `text`; True if a stop string ends
        in the new text (`text` is then cut before it)."""
        self.text = self._detokenizer.text
        if self._stop and len(self.text) > start:
            # A stop string ending in the new text starts at most holdback chars before it.
            window = max(0, start - self._holdback)
            hits = [j for j in (self.text.find(s, window) for s in self._stop) if j >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
        return self.stopped

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; all of it once finished (with the text of tokens that end
        inside a character, U+FFFD, as tokenizer.decode gives it), else all but the hold-back."""
        if finished and not self.stopped:
            start = len(self._detokenizer.text)
            self._detokenizer.flush()
            self._took_text(start)
        end = len(self.text) if finished or self.stopped else len(self.text) - self._holdback
        if end <= self._num_chars_sent:
            return ""
        delta, self._num_chars_sent = self.text[self._num_chars_sent:end], end
        return delta

    @property
    def shown(self) -> str:
        return self.text[:self._num_chars_sent]
