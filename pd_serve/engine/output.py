"""What a caller gets back per request, and the stop rules applied to each new token."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_serve.engine.core import token_stop_reason
from pd_serve.engine.request import FinishReason, Request, TokenLogprob
from pd_serve.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    """A request's generated part so far. new_* hold what arrived since the previous output."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held


class OutputTracker:
    """Per request: incremental text, stop-string search, and what has been handed out already.

    While a request runs, the last len(longest stop string) - 1 characters are held back, so a
    stream never shows the start of a stop string that later cuts the text.
    """

    def __init__(self, request: Request, tokenizer: Tokenizer | None, max_model_len: int):
        """tokenizer None (a dummy-weight model without one): token ids only, no text."""
        self.request = request
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer else ()
        self.max_model_len = max_model_len
        params = request.sampling_params
        self.detokenizer = tokenizer and IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                                params.skip_special_tokens)
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.text = ""
        self.stopped = False  # a stop string ended the text
        self.num_tokens_sent = 0
        self.num_chars_sent = 0

    def on_token(self, token_id: int) -> FinishReason | None:
        """Account for one sampled token (already appended); return why it ends the request."""
        request = self.request
        if self.detokenizer is None:
            return token_stop_reason(request, self.eos_token_ids, self.max_model_len)
        self.detokenizer.step([token_id])
        if self._took_text():
            return FinishReason.STOP
        return token_stop_reason(request, self.eos_token_ids, self.max_model_len)

    def _took_text(self) -> bool:
        """Take the detokenizer's new text; True if a stop string ends in it (`text` is then
        cut before the stop string)."""
        stop = self.request.sampling_params.stop
        window = max(0, len(self.text) - self.holdback)  # where a stop string could start
        self.text = self.detokenizer.text
        hits = [i for i in (self.text.find(s, window) for s in stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def make_output(self) -> RequestOutput:
        request = self.request
        if request.finished and self.detokenizer and not self.stopped:
            # tokens that end inside a character: their text, U+FFFD as tokenizer.decode gives it
            self.detokenizer.flush()
            self._took_text()
        visible = self.text if request.finished else self.text[:len(self.text) - self.holdback]
        new_text = visible[self.num_chars_sent:]
        self.num_chars_sent = max(self.num_chars_sent, len(visible))
        new_token_ids = request.output_token_ids[self.num_tokens_sent:]
        self.num_tokens_sent = len(request.output_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=visible,
            finished=request.finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
            new_token_ids=new_token_ids,
            new_text=new_text,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens,
        )
