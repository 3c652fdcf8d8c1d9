"""What every worker role is built on: a scheduler and allocator over an executor (model, KV
pool, runner: engine/executor.py), and under --tp the follower ranks' executors.

EngineCore.step() is schedule -> plan (PlanBuilder) -> execute -> take the sampled tokens back.
It knows token ids only; text, stop strings and APIs live above it (the colocated Engine, the
prefill and decode workers).

The overlap schedule (on by default on GPU; --disable-overlap-schedule, as SGLang names it):
step() plans and launches step N while step N-1 is still on the device, then waits for N-1's
tokens and returns those. The host's work (scheduling, attention planning, the callers' stop
checks and streaming) so hides behind the device's. A request's token from N-1 is pending while
N is planned (its input is read on the device); a request that ends on N-1's token has one
wasted row in N, whose token is dropped. Steps that sample with penalties (they read the output
tokens) or report finished layers (prefill) wait for the step before them first. A step with
grammar rows queues its sampling only when step N+1 is launched (sampler.DeferredSample), so
the callers' host work on N-1's tokens runs while the grammar thread fills N's masks.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pd_serve.cache.allocator import PageAllocator
from pd_serve.cache.radix import PrefixCache
from pd_serve.config import EngineConfig
from pd_serve.engine import tp_group
from pd_serve.engine.executor import Executor, resolve_device
from pd_serve.engine.grammar import parse_grammar
from pd_serve.engine.plan import StepPlan, StepResult
from pd_serve.engine.request import FinishReason, Request
from pd_serve.engine.sampler import DeferredSample, PendingSample, needs_penalties
from pd_serve.engine.sampling_params import SamplingParams
from pd_serve.engine.scheduler import PlanBuilder, Scheduler, SchedulerOutput
from pd_serve.model.config import ModelConfig
from pd_serve.model.output_text import stop_token_ends
from pd_serve.model.parallel import check_shards
from pd_serve.model.tokenizer import Tokenizer
from pd_serve.ports import free_port

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
GRAMMAR_POLL_S = 0.01  # an idle step's wait for a grammar's compile


class EngineCore:
    def __init__(self, config: EngineConfig, tp_follower_io=None, prefix_cache: bool = True):
        """tp_follower_io(executor, rank, reports): builds a follower rank's part of the KV
        hand-off in its process (picklable; see follow()), for a prefill or decode worker under
        --tp; its reports reach rank 0 on `tp_reports`. prefix_cache: keep ended requests'
        pages for later prompts (cache/radix.py) unless --disable-radix-cache (benchmarks of
        one step pass False)."""
        self.config = config
        cfg = config
        self.model_dir, model_config, self.max_model_len = resolve_model(cfg)
        # A dummy-weight model (benchmarks) may come as a bare config.json: token ids only then.
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer = (Tokenizer.from_dir(self.model_dir)
                          if has_tokenizer or cfg.load_format != "dummy" else None)
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else ()
        device = resolve_device(cfg.device)
        self.tp, self._tp_followers, self.tp_reports = None, [], None
        if cfg.world_size > 1:  # --tp, or --ep-size over replicated attention
            check_shards(model_config, cfg.tp, cfg.ep_size)
            self.tp, self._tp_followers, self.tp_reports = tp_group.start(
                cfg, free_port(), follow, (tp_follower_io,))
            device = _rank_device(device, 0)
        self.executor = Executor(cfg, self.model_dir, self.max_model_len, device, self.tp)
        ex = self.executor
        self.device, self.dtype, self.model, self.model_config = ex.device, ex.dtype, ex.model, ex.model_config
        self.kv_pool, self.runner, self.attention_backend = ex.kv_pool, ex.runner, ex.attention_backend
        self.allocator = PageAllocator(self.kv_pool.num_pages)
        page_size = self.kv_pool.layout.page_size
        pool_tokens = self.kv_pool.num_pages * page_size
        if pool_tokens < self.max_model_len:  # a longer request could only end early
            logger.warning("the KV cache holds %d tokens, fewer than the context length %d: "
                           "requests are limited to %d tokens (prompt + output); raise "
                           "--max-total-tokens or --mem-fraction-static, or lower "
                           "--context-length", pool_tokens, self.max_model_len, pool_tokens)
            self.max_model_len = pool_tokens
        self.prefix_cache = (PrefixCache(self.allocator, page_size)
                             if prefix_cache and not cfg.cache.disable_radix_cache else None)
        self.scheduler = Scheduler(cfg.scheduler, self.allocator, page_size, self.max_model_len,
                                   self.prefix_cache)
        self.scheduler.ready = self.grammar_ready
        self.plans = PlanBuilder()
        # PD_SERVE_OVERLAP_CPU=1 turns it on for CPU too (where nothing runs asynchronously): for
        # tests of its bookkeeping in real workers.
        on_device = self.device.type == "cuda" or os.environ.get("PD_SERVE_OVERLAP_CPU") == "1"
        self.overlap = on_device and not cfg.disable_overlap_schedule
        logger.info("attention backend %s, CUDA graphs %s, overlap schedule %s%s",
                    self.attention_backend, "on" if self.runner.graphs else "off",
                    "on" if self.overlap else "off", f", tp {cfg.tp}" if self.tp else "")
        self._launched: LaunchedStep | None = None

    @property
    def step_in_flight(self) -> bool:
        """A step is launched (overlap schedule) whose tokens the next step() takes."""
        return self._launched is not None

    def exited_tp_ranks(self) -> list[int]:
        """Ranks of this (rank 0) engine's tensor-parallel followers that have exited."""
        return [rank for rank, p in enumerate(self._tp_followers, 1) if p.exitcode is not None]

    def close(self) -> None:
        """End a tensor-parallel group's followers (a no-op without TP); the engine is unusable after."""
        if self.tp is None:
            return
        try:
            tp_group.send(self.tp, None)
        except RuntimeError as e:  # a follower is gone already
            logger.warning("tensor-parallel group: %s", e)
        for p in self._tp_followers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()
        self.tp, self._tp_followers = None, []

    def warmup(self, num_tokens: int | None = None) -> None:
        """One throwaway prefill and decode, so the first real request does not pay for lazy
        initialisation (kernel selection, allocator growth). Leaves every page free.

        On a GPU the prompt is the largest prefill step the scheduler takes (--chunked-prefill-size,
        within the context and the pool): a step that cannot fit beside the KV cache then fails
        here, with what to change, instead of killing the worker under load."""
        if num_tokens is None:
            num_tokens = 16 if self.device.type == "cpu" else self._largest_prefill_step()
        request = Request(list(range(1, num_tokens + 1)), SamplingParams(temperature=0, max_tokens=2,
                                                                          ignore_eos=True))
        self.scheduler.add(request)
        try:
            while len(request.output_token_ids) < 2 and not request.finished:
                self.step()
        except torch.OutOfMemoryError as e:
            raise ValueError(
                f"a {num_tokens}-token prefill step runs out of GPU memory beside the KV cache "
                f"({self.kv_pool.num_tokens} tokens): lower --mem-fraction-static (now "
                f"{self.config.cache.mem_fraction_static}) or --chunked-prefill-size") from e
        self.scheduler.finish(request, FinishReason.ABORT)
        self.drain()
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def _largest_prefill_step(self) -> int:
        chunk = self.config.scheduler.chunked_prefill_size
        room = min(self.max_model_len, self.kv_pool.num_tokens) - 2  # (+ the decode step's token)
        return max(1, min(chunk if chunk > 0 else room, room))

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
        if params.grammar is not None:
            parse_grammar(params.grammar)

    def step(self, kv_sends=None, on_layer=None) -> tuple[SchedulerOutput, list[Request]]:
        """One batch. Returns what was scheduled and the requests that got a new token from it
        (appended): this step's, or under the overlap schedule the step before's (module
        docstring).

        kv_sends(scheduled) -> list[KVSend]: the prompts whose KV the step completes, and where
        it goes (prefill); on_layer(kv_sends, layer) is then called on every rank as the forward
        finishes each layer. A step with KV sends runs synchronously."""
        if kv_sends is not None and self._launched is not None:
            raise RuntimeError("step(kv_sends) needs the synchronous schedule: a step is in flight")
        if not self.overlap or kv_sends is not None:
            out = self.scheduler.schedule()
            plan = self.plans.build(out, kv_sends(out) if kv_sends is not None and out.chunks else None)
            if plan is None:
                self._wait_for_grammars()
            sampled = self._execute(plan, on_layer) if plan is not None else StepResult([], [])
            self.scheduler.update(out, sampled.token_ids)
            _add_prompt_logprobs(out, sampled)
            return out, _with_logprobs([c.request for c in out.chunks if c.sample], sampled.logprobs)
        done = None
        if self._launched is not None and needs_penalties(self._launched.requests):
            done = self._settle(self._launched)  # penalties read the tokens: wait for them
            self._launched = None
        out = self.scheduler.schedule()
        plan = self.plans.build(out)
        previous, self._launched = self._launched, None
        if plan is not None:
            if self.tp is not None:
                tp_group.send(self.tp, ["plan", plan.to_wire()])
            sample = self.executor.launch(plan, prev=previous.sample if previous else None)
            self.scheduler.update(out, None)
            self._launched = LaunchedStep(out, sample, self.scheduler.launched())
        if previous is not None:
            done = self._settle(previous)
        if plan is None:  # nothing launched: what scheduling ended is reported now
            if done is None:
                self._wait_for_grammars()
            return _merged(done, out), done[1] if done else []
        return done or (SchedulerOutput(), [])

    def apply_stops(self, requests: list[Request], stop_reason=None) -> list[tuple[Request, FinishReason | None]]:
        """The stop rules on each request's newest token; the requests it ends are finished
        (their pages freed). stop_reason(request) says why the token ends it; by default
        token_stop_reason (EOS, stop ids, max_tokens, context); the Engine adds stop strings."""
        ended = []
        for request in requests:
            reason = (stop_reason(request) if stop_reason is not None
                      else token_stop_reason(request, self.eos_token_ids, self.max_model_len))
            if reason is not None:
                self.scheduler.finish(request, reason)
            ended.append((request, reason))
        return ended

    def grammar_ready(self, request: Request) -> bool:
        """Whether the request may run: it has no grammar, or its grammar is compiled (the
        first call starts the compile, on the grammar thread)."""
        grammar = request.sampling_params.grammar
        return grammar is None or self.executor.grammar_ready(grammar)

    def _wait_for_grammars(self) -> None:
        """Nothing to run: if requests wait for their grammars' compiles, wait a little for
        one (rather than spin the caller's loop against the compile thread)."""
        if self.scheduler.waiting:
            self.executor.wait_for_grammars(GRAMMAR_POLL_S)

    def _execute(self, plan: StepPlan, on_layer) -> StepResult:
        """Run a plan on every rank (rank 0 sends it to the followers first) and wait for it."""
        if self.tp is not None:
            tp_group.send(self.tp, ["plan", plan.to_wire()])
        return self.executor.execute(plan, on_layer)

    def drain(self) -> None:
        """Wait for the step in flight and settle it (its tokens are appended, not returned):
        for callers that stop stepping with work launched (warm-up, benchmarks)."""
        if self._launched is not None:
            step, self._launched = self._launched, None
            self._settle(step)

    def _settle(self, step: LaunchedStep) -> tuple[SchedulerOutput, list[Request]]:
        """Wait for a launched step; append its tokens to its requests that are still live."""
        sampled = step.sample.result()
        self.scheduler.completed(step.number)
        _add_prompt_logprobs(step.plan, sampled)
        live = []
        for request, token, logprob in zip(step.requests, sampled.token_ids, sampled.logprobs):
            request.num_pending -= 1
            if not request.finished:
                request.output_token_ids.append(token)
                live.append((request, logprob))
        return step.plan, _with_logprobs([r for r, _ in live], [lp for _, lp in live])


def _with_logprobs(requests: list[Request], logprobs: list) -> list[Request]:
    """Append the logprobs that came with the sampled tokens; returns the requests."""
    for request, logprob in zip(requests, logprobs):
        if logprob is not None:
            request.output_logprobs.append(logprob)
    return requests


def _add_prompt_logprobs(plan: SchedulerOutput, sampled: StepResult) -> None:
    """Give the step's prompt logprobs (requests that asked for them) to their requests."""
    if sampled.prompt_logprobs:
        for chunk in plan.chunks:
            if (scored := sampled.prompt_logprobs.get(chunk.request.request_id)) is not None:
                chunk.request.add_prompt_logprobs(*scored)


@dataclass
class LaunchedStep:
    """A step launched on the device whose tokens are not yet known."""

    plan: SchedulerOutput
    sample: PendingSample | DeferredSample
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
    num_output = len(request.output_token_ids)
    if stop_token_ends(params, token_id, num_output, eos_token_ids):
        return FinishReason.STOP
    if num_output >= params.max_tokens or request.num_known_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def resolve_model(config: EngineConfig) -> tuple[Path, ModelConfig, int]:
    """--model's folder (checked), its config and the context length (--context-length, checked
    against the model's limit)."""
    model_dir = _model_dir_for(config.model)
    if model_dir.is_file():
        raise ValueError(f"--model {model_dir}: a file, not a model folder or a .gguf file")
    if not model_dir.is_dir():
        raise ValueError(f"--model {model_dir}: no such directory")
    model_config = ModelConfig.from_dir(model_dir)
    limit = model_config.max_position_embeddings
    if config.context_length and config.context_length > limit:
        raise ValueError(f"--context-length {config.context_length} exceeds the model's "
                         f"max_position_embeddings ({limit}) in {model_dir}/config.json")
    return model_dir, model_config, config.context_length or limit


def follow(config: EngineConfig, rank: int, port: int, reports, tp_follower_io=None) -> None:
    """A TP follower's process: join the group, build this rank's executor (which does not
    sample) and its KV hand-off part, then run the plans and calls rank 0 sends until it sends
    None."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    model_dir, _, max_model_len = resolve_model(config)
    device = resolve_device(config.device)
    tp = tp_group.join(config, rank, port)
    executor = Executor(config, model_dir, max_model_len, _rank_device(device, rank), tp, samples=False)
    io = tp_follower_io(executor, rank, reports) if tp_follower_io is not None else None
    try:
        while (msg := tp_group.receive(tp)) is not None:
            if msg[0] == "plan":
                executor.launch(StepPlan.from_wire(msg[1]), io.send_layers if io is not None else None)
            else:  # ["call", name, *args]: then meet rank 0 at the barrier
                if io is not None:
                    io.call(*msg[1:])
                dist.barrier(group=tp.control)
    finally:
        if io is not None:
            io.close()
    dist.destroy_process_group()


def _rank_device(device: torch.device, rank: int) -> torch.device:
    """On GPU, TP rank r runs on cuda:r."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _model_dir_for(model: str | None) -> Path:
    from pd_serve.model.gguf_default import model_dir_for
    return model_dir_for(model)
