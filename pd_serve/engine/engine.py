"""The colocated engine: one process doing prefill and decode. Reference and baseline for the rest.

    from pd_serve import Engine, SamplingParams
    engine = Engine()                        # the embedded SmolLM2-135M-Instruct on CPU
    outs = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from pd_serve.cache.allocator import PageAllocator
from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.config import CacheConfig, EngineConfig, SchedulerConfig
from pd_serve.engine.attention.torch_backend import TorchAttentionBackend
from pd_serve.engine.output import OutputTracker, RequestOutput
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.runner import ModelRunner
from pd_serve.engine.sampler import Sampler
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.engine.scheduler import Scheduler
from pd_serve.model.config import ModelConfig, resolve_dtype
from pd_serve.model.loader import load_model
from pd_serve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class Engine:
    """Continuous-batching engine over a paged KV cache. Not thread-safe: see AsyncEngine."""

    def __init__(self, model: str | Path | None = None, *, device: str = "auto",
                 dtype: str = "auto", context_length: int | None = None, seed: int = 0,
                 page_size: int = 16, max_total_tokens: int | None = None,
                 mem_fraction_static: float = 0.88, cpu_kv_cache_gb: float = 1.0,
                 kv_cache_dtype: str = "auto", max_running_requests: int = 256,
                 chunked_prefill_size: int = 2048, schedule_policy: str = "fcfs"):
        self.config = EngineConfig(
            model=None if model is None else str(model), device=device, dtype=dtype,
            context_length=context_length, seed=seed,
            cache=CacheConfig(page_size=page_size, max_total_tokens=max_total_tokens,
                              mem_fraction_static=mem_fraction_static,
                              cpu_kv_cache_gb=cpu_kv_cache_gb, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_running_requests=max_running_requests,
                                      chunked_prefill_size=chunked_prefill_size,
                                      schedule_policy=schedule_policy))
        self._build()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        engine = cls.__new__(cls)
        engine.config = config
        engine._build()
        return engine

    def _build(self) -> None:
        cfg = self.config
        model_dir = Path(cfg.model) if cfg.model else _default_model_dir()
        if not model_dir.is_dir():
            raise ValueError(f"--model {model_dir}: no such directory")
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is available; use --device cpu")
        self.device = torch.device(device)
        self.dtype = resolve_dtype(cfg.dtype, self.device.type)
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        limit = self.model_config.max_position_embeddings
        if cfg.context_length and cfg.context_length > limit:
            raise ValueError(f"--context-length {cfg.context_length} exceeds the model's "
                             f"max_position_embeddings ({limit}) in {model_dir}/config.json")
        self.max_model_len = cfg.context_length or limit
        self.model = load_model(model_dir, self.dtype, self.device)
        mc = self.model_config
        layout = KVLayout(mc.num_layers, cfg.cache.page_size, mc.num_kv_heads, mc.head_dim,
                          str(self.dtype).removeprefix("torch."))
        num_pages = _num_kv_pages(cfg.cache, layout, self.device)
        self.kv_pool = KVPool(layout, num_pages, self.device)
        self.allocator = PageAllocator(num_pages)
        logger.info("KV cache: %d pages x %d tokens = %d tokens, %d bytes per token, %.2f GiB",
                    num_pages, layout.page_size, self.kv_pool.num_tokens, layout.bytes_per_token,
                    self.kv_pool.num_bytes / 2**30)
        attn = TorchAttentionBackend(self.kv_pool, mc.num_heads, mc.head_dim, mc.head_dim ** -0.5)
        self.runner = ModelRunner(self.model, attn, Sampler(cfg.seed), layout.page_size)
        self.scheduler = Scheduler(cfg.scheduler, self.allocator, layout.page_size)
        self._trackers: dict[str, OutputTracker] = {}

    # ---- request API ----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queue one request; returns its id. Raises ValueError on a bad prompt."""
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids)
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
        plan = self.scheduler.schedule()
        sampled = self.runner.execute(plan) if plan.chunks else None
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
    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the context length is "
                             f"{self.max_model_len} (prompt + output must fit; see --context-length)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def _postprocess(self, plan, sampled) -> list[RequestOutput]:
        self.scheduler.update(plan, sampled.token_ids if sampled else [])
        changed = [c.request for c in plan.chunks if c.sample] + plan.finished
        sampled_requests = [c.request for c in plan.chunks if c.sample]
        for i, request in enumerate(sampled_requests):
            if sampled.logprobs[i] is not None:
                request.output_logprobs.append(sampled.logprobs[i])
            reason = self._trackers[request.request_id].on_token(request.output_token_ids[-1])
            if reason is not None:
                self.scheduler.finish(request, reason)
        outputs = [self._trackers[r.request_id].make_output() for r in changed]
        for out in outputs:
            if out.finished:
                del self._trackers[out.request_id]
        return outputs


def _default_model_dir() -> Path:
    from pd_serve.model.gguf_default import default_model_dir
    return default_model_dir()


def _num_kv_pages(cache: CacheConfig, layout: KVLayout, device: torch.device) -> int:
    """Pool size in pages: --max-total-tokens if given, else from free memory."""
    if cache.max_total_tokens is not None:
        return -(-cache.max_total_tokens // layout.page_size)
    if device.type == "cpu":
        budget = cache.cpu_kv_cache_gb * 2**30
    else:
        total = torch.cuda.get_device_properties(device).total_memory
        budget = total * cache.mem_fraction_static - torch.cuda.memory_allocated(device)
        if budget < layout.bytes_per_page:
            raise ValueError(f"--mem-fraction-static {cache.mem_fraction_static} leaves no room "
                             "for the KV cache after the weights; raise it")
    return int(budget // layout.bytes_per_page)
