"""The colocated engine: one process doing prefill and decode. Reference and baseline for the rest.

    from pd_serve import Engine, SamplingParams
    engine = Engine()                        # the embedded SmolLM2-135M-Instruct on CPU
    outs = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from pd_serve.config import EngineConfig
from pd_serve.engine.core import EngineCore
from pd_serve.engine.output import OutputTracker, RequestOutput
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class Engine(EngineCore):
    """Continuous-batching engine over a paged KV cache, with text in and out. Not thread-safe:
    see AsyncEngine."""

    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 **options):
        """model: a Hugging Face folder (default: the embedded SmolLM2-135M-Instruct). options:
        any engine flag by its CLI name with underscores (device="cpu", max_total_tokens=4096,
        attention_backend="triton", ...); see EngineConfig, CacheConfig, SchedulerConfig.
        config: a whole EngineConfig instead of model and options."""
        if config is None:
            config = EngineConfig.from_flat(model=None if model is None else str(model), **options)
        elif model is not None or options:
            raise TypeError("Engine: pass either config or model and options, not both")
        super().__init__(config)
        self._trackers: dict[str, OutputTracker] = {}

    # ---- request API ----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queue one request; returns its id. Raises ValueError on a bad prompt."""
        params = params or SamplingParams()
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json: pass token ids, not text")
        if self.tokenizer is None and params.stop:
            raise ValueError(f"{self.model_dir} has no tokenizer.json: stop strings need one")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(token_ids, params)
        request = Request(token_ids, params, priority=priority)
        if request_id is not None:
            if request_id in self._trackers:
                raise ValueError(f"request id {request_id!r} is already in use")
            request.request_id = request_id
        self._trackers[request.request_id] = OutputTracker(request, self.tokenizer, self.max_model_len)
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str) -> None:
        """End a request now; its pages are freed. Unknown or finished ids are ignored."""
        tracker = self._trackers.pop(request_id, None)
        if tracker is not None:
            self.scheduler.finish(tracker.request, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule -> run -> postprocess. Returns an output for each request that changed."""
        plan, sampled = EngineCore.step(self)
        return self._postprocess(plan, sampled)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs of one request as they arrive (runs the engine; other requests progress too)."""
        request_id = self.add_request(prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(request_id)

    # ---- internals --------------------------------------------------------------------
    def _postprocess(self, plan, sampled: list[Request]) -> list[RequestOutput]:
        self.apply_stops(sampled, lambda r: self._trackers[r.request_id].on_token(r.output_token_ids[-1]))
        outputs = [self._trackers[r.request_id].make_output() for r in sampled + plan.finished]
        for out in outputs:
            if out.finished:
                del self._trackers[out.request_id]
        return outputs
