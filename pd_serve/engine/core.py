"""The parts every worker role shares: model, KV pool, allocator, scheduler, runner.

EngineCore.step() is schedule -> run -> take the sampled tokens back. It knows token ids only;
text, stop strings and APIs live above it (the colocated Engine, the prefill and decode workers).

The overlap schedule (on by default on GPU; --disable-overlap-schedule, as SGLang names it):
step() plans and launches step N while step N-1 is still on the device, then waits for N-1's
tokens and returns those. The host's work (scheduling, attention planning, the callers' stop
checks and streaming) so hides behind the device's. A request's token from N-1 is pending while
N is planned (its input is read on the device); a request that ends on N-1's token has one
wasted row in N, whose token is dropped. Steps that sample with penalties (they read the output
tokens) or report finished layers (prefill) wait for the step before them first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kernels._triton import interpret_requested
from pd_serve.cache.allocator import PageAllocator
from pd_serve.cache.kv_quant import kv_cache_dtype, load_kv_scales
from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.config import CacheConfig, EngineConfig
from pd_serve.engine import tp_group
from pd_serve.engine.attention import create_backend, resolve_backend_name
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.runner import ModelRunner
from pd_serve.engine.sampler import PendingSample, Sampler, SamplerOutput, needs_penalties
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.engine.scheduler import Scheduler, SchedulerOutput
from pd_serve.launch import free_port
from pd_serve.model.config import ModelConfig, resolve_dtype
from pd_serve.model.llama import use_batch1_kernels
from pd_serve.model.loader import load_model
from pd_serve.model.parallel import shard_model
from pd_serve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_port: int = 0, handoff=None):
        """tp_rank, tp_port: a follower rank of a tensor-parallel engine (engine/tp_group.py).
        handoff: a prefill or decode worker's HandoffSpec, from which rank 0 has its followers
        build their half of the KV hand-off (transfer/tp_handoff.py)."""
        self.config = config
        self.tp, self._tp_followers, self.tp_results = None, [], None
        self._handoff = handoff
        # step_extra(plan): what a step's broadcast carries for the followers' hand-off halves
        self.step_extra = None
        self._build(tp_rank, tp_port)

    def _build(self, tp_rank: int, tp_port: int) -> None:
        cfg = self.config
        model_dir = Path(cfg.model) if cfg.model else _default_model_dir()
        if not model_dir.is_dir():
            raise ValueError(f"--model {model_dir}: no such directory")
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is available; use --device cpu")
        self.device = torch.device(device)
        if cfg.tp > 1:
            self._join_tp(tp_rank, tp_port)
        self.dtype = resolve_dtype(cfg.dtype, self.device.type)
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_dir(model_dir)
        # A dummy-weight model (benchmarks) may come as a bare config.json: token ids only then.
        has_tokenizer = (model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(model_dir) if has_tokenizer or cfg.load_format != "dummy" else None
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else ()
        limit = self.model_config.max_position_embeddings
        if cfg.context_length and cfg.context_length > limit:
            raise ValueError(f"--context-length {cfg.context_length} exceeds the model's "
                             f"max_position_embeddings ({limit}) in {model_dir}/config.json")
        self.max_model_len = cfg.context_length or limit
        if self.tp is None:
            self.model = load_model(model_dir, self.dtype, self.device, cfg.load_format, cfg.seed,
                                    cfg.quantization)
        else:  # every rank loads the whole model on the host and keeps its shard
            full = load_model(model_dir, self.dtype, "cpu", cfg.load_format, cfg.seed, cfg.quantization)
            self.model = shard_model(full, self.tp).to(self.device)
            del full
        mc = self.model.config  # this rank's shape (its heads) under TP
        kv_dtype = kv_cache_dtype(cfg.cache.kv_cache_dtype, self.dtype)
        k_scales, v_scales = load_kv_scales(model_dir, mc.num_layers, kv_dtype,
                                            f"--kv-cache-dtype {cfg.cache.kv_cache_dtype}")
        layout = KVLayout(mc.num_layers, cfg.cache.page_size, mc.num_kv_heads, mc.head_dim,
                          str(kv_dtype).removeprefix("torch."), k_scales, v_scales)
        num_pages = _num_kv_pages(cfg.cache, layout, self.device)
        if self.tp is not None:  # the same page ids on every rank: the smallest pool
            smallest = torch.tensor([num_pages])
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=self.tp.control)
            num_pages = int(smallest)
        self.kv_pool = KVPool(layout, num_pages, self.device)
        self.allocator = PageAllocator(num_pages)
        logger.info("KV cache: %d pages x %d tokens = %d tokens, %s, %d bytes per token, %.2f GiB",
                    num_pages, layout.page_size, self.kv_pool.num_tokens, layout.dtype,
                    layout.bytes_per_token, self.kv_pool.num_bytes / 2**30)
        self.attention_backend = resolve_backend_name(cfg.attention_backend, self.device, self.dtype,
                                                      mc.head_dim)
        attn = create_backend(self.attention_backend, self.kv_pool, mc.num_heads, mc.head_dim,
                              mc.head_dim ** -0.5, self.dtype,
                              batch1_kernels=cfg.enable_batch1_kernels)
        if cfg.enable_batch1_kernels:
            use_batch1_kernels(self.model)
            if self.device.type != "cuda" and not interpret_requested():
                logger.warning("--enable-batch1-kernels has no effect on %s: its kernels run on "
                               "GPUs", self.device)
        self.runner = ModelRunner(self.model, attn, Sampler(cfg.seed), layout.page_size)
        if self.tp is not None and self.tp.rank == 0:
            self.runner.on_launch = lambda plan: tp_group.broadcast(
                self.tp, plan, self.step_extra(plan) if self.step_extra else None)
        if self.device.type == "cuda" and not cfg.disable_cuda_graph and attn.supports_cuda_graph \
                and self.tp is None:
            max_bs = min(cfg.cuda_graph_max_bs, cfg.scheduler.max_running_requests)
            if cfg.scheduler.max_running_requests > cfg.cuda_graph_max_bs:
                logger.warning("decode batches above %d run without CUDA graphs (eagerly, several "
                               "times slower): --max-running-requests %d > --cuda-graph-max-bs %d; "
                               "raise --cuda-graph-max-bs to capture them", max_bs,
                               cfg.scheduler.max_running_requests, cfg.cuda_graph_max_bs)
            self.runner.capture_cuda_graphs(max_bs, -(-self.max_model_len // layout.page_size))
        self.scheduler = Scheduler(cfg.scheduler, self.allocator, layout.page_size)
        self.scheduler.max_model_len = self.max_model_len
        # PD_SERVE_OVERLAP_CPU=1 turns it on for CPU too (where nothing runs asynchronously): for
        # tests of its bookkeeping in real workers.
        on_device = self.device.type == "cuda" or os.environ.get("PD_SERVE_OVERLAP_CPU") == "1"
        self.overlap = on_device and not cfg.disable_overlap_schedule and self.tp is None
        logger.info("attention backend %s, CUDA graphs %s, overlap schedule %s%s",
                    self.attention_backend, "on" if self.runner.graphs else "off",
                    "on" if self.overlap else "off", f", tp {cfg.tp}" if self.tp else "")
        self._in_flight: InFlight | None = None

    def _join_tp(self, rank: int, port: int) -> None:
        """Start (rank 0) or join the tensor-parallel group; on GPU rank r runs on cuda:r."""
        if rank == 0:
            self.tp, self._tp_followers, self.tp_results = tp_group.start(
                self.config, free_port(), self._handoff)
        else:
            self.tp = tp_group.join(self.config, rank, port)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", rank)

    def exited_tp_ranks(self) -> list[int]:
        """Ranks of this (rank 0) engine's tensor-parallel followers that have exited."""
        return [rank for rank, p in enumerate(self._tp_followers, 1) if p.exitcode is not None]

    def close(self) -> None:
        """End a tensor-parallel group's followers (a no-op without TP); the engine is unusable after."""
        if self.tp is None or self.tp.rank != 0:
            return
        try:
            tp_group.broadcast(self.tp, None)
        except RuntimeError as e:  # a follower is gone already
            logger.warning("tensor-parallel group: %s", e)
        for p in self._tp_followers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()
        self.tp, self._tp_followers = None, []

    def warmup(self, num_tokens: int = 16) -> None:
        """One throwaway prefill and decode, so the first real request does not pay for lazy
        initialisation (kernel selection, allocator growth). Leaves every page free."""

        request = Request(list(range(1, num_tokens + 1)), SamplingParams(temperature=0, max_tokens=2,
                                                                          ignore_eos=True))
        self.scheduler.add(request)
        while len(request.output_token_ids) < 2 and not request.finished:
            self.step()
        self.scheduler.finish(request, FinishReason.ABORT)
        self.drain()

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (one line, naming the limit) for a request this worker cannot take."""
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the context length is "
                             f"{self.max_model_len} (prompt + output must fit; see --context-length)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.logit_bias or {} if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")

    def step(self, on_layer=None) -> tuple[SchedulerOutput, list[Request]]:
        """One batch. Returns a plan and the requests that got a new token from it (appended):
        this step's, or under the overlap schedule the step before's (module docstring).

        on_layer(plan, i), if given, is called as the forward finishes layer i."""
        if on_layer is not None and self._in_flight is not None:
            raise RuntimeError("step(on_layer) needs the synchronous schedule: a step is in flight")
        if not self.overlap or on_layer is not None:
            plan = self.scheduler.schedule()
            after_layer = None if on_layer is None else (lambda i: on_layer(plan, i))
            sampled = self.runner.execute(plan, after_layer) if plan.chunks else SamplerOutput([], [])
            self.scheduler.update(plan, sampled.token_ids)
            return plan, _with_logprobs([c.request for c in plan.chunks if c.sample], sampled.logprobs)
        done = None
        if self._in_flight is not None and needs_penalties(self._in_flight.requests):
            done = self._settle(self._in_flight)  # penalties read the tokens: wait for them
            self._in_flight = None
        plan = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        if plan.chunks:
            sample = self.runner.launch(plan, prev_tokens=previous.sample.tokens if previous else None)
            self.scheduler.update(plan, None)
            self._in_flight = InFlight(plan, sample, self.scheduler.launched())
        if previous is not None:
            done = self._settle(previous)
        if not plan.chunks:  # nothing launched: what scheduling ended is reported now
            return _merged(done, plan), done[1] if done else []
        return done or (SchedulerOutput(), [])

    def drain(self) -> None:
        """Wait for the step in flight and settle it (its tokens are appended, not returned):
        for callers that stop stepping with work launched (warm-up, benchmarks)."""
        if self._in_flight is not None:
            flight, self._in_flight = self._in_flight, None
            self._settle(flight)

    def _settle(self, flight: "InFlight") -> tuple[SchedulerOutput, list[Request]]:
        """Wait for a launched step; append its tokens to its requests that are still live."""
        sampled = flight.sample.result()
        self.scheduler.completed(flight.number)
        live = []
        for request, token, logprob in zip(flight.requests, sampled.token_ids, sampled.logprobs):
            request.num_pending -= 1
            if not request.finished:
                request.output_token_ids.append(token)
                live.append((request, logprob))
        return flight.plan, _with_logprobs([r for r, _ in live], [lp for _, lp in live])


def _with_logprobs(requests: list[Request], logprobs: list) -> list[Request]:
    """Append the logprobs that came with the sampled tokens; returns the requests."""
    for request, logprob in zip(requests, logprobs):
        if logprob is not None:
            request.output_logprobs.append(logprob)
    return requests


@dataclass
class InFlight:
    """A step launched on the device whose tokens are not yet known."""

    plan: SchedulerOutput
    sample: PendingSample
    number: int  # the scheduler's count of launched steps

    @property
    def requests(self) -> list[Request]:
        return [c.request for c in self.plan.chunks if c.sample]


def _merged(done: tuple[SchedulerOutput, list[Request]] | None, plan: SchedulerOutput) -> SchedulerOutput:
    """One plan to report: the settled step's chunks plus what scheduling ended or preempted since."""
    if done is None:
        return plan
    first = done[0]
    return SchedulerOutput(chunks=first.chunks, preempted=first.preempted + plan.preempted,
                           finished=first.finished + plan.finished)


def token_stop_reason(request: Request, eos_token_ids, max_model_len: int) -> FinishReason | None:
    """Why the request's newest token ends it (EOS, stop token id, max_tokens, context), if it does."""
    params, token_id = request.sampling_params, request.output_token_ids[-1]
    if token_id in params.stop_token_ids:
        return FinishReason.STOP
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if len(request.output_token_ids) >= params.max_tokens or request.num_known_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


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
