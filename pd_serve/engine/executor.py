"""Runs StepPlans on one rank: this rank's model (its shard under TP), KV pool and runner.

The executor is the engine less the scheduler. It keeps what it needs of each request the
plans have named (token ids, page ids, sampling fields, the seeded generator) and builds the
runner's batch from a plan and that cache; it never sees a scheduler's Request. Every rank of a
tensor-parallel group runs the same executor on the same plans (rank 0 sends them: core.py);
only the one built with `samples=True` (rank 0) samples, the others compute the logits (the
all-gather needs every rank) and stop there.

A token of the step still in flight (overlap schedule, engine/core.py) is not in the cache
yet: the runner reads it on the device, from row `pending_row` of that step's samples, which
the executor recorded when it launched the step. The plans bring it once it is known. Under TP
only rank 0 has those samples: a plan with pending tokens starts with a broadcast of the step
before's sampled tokens from rank 0 over the model's group (on the device under NCCL: stream
ordered, no wait on the host), which every rank decides from the same plan.

Structured outputs (engine/grammar.py): the sampling rank keeps a grammar matcher per request
that has a grammar. The sampler masks a grammar row's logits and queues the matcher's work on
the token it samples to the grammar thread, which runs while the next step is planned and its
forward runs; tokens sampled elsewhere (prefill's token 1) are replayed when the plan brings
them. Steps without grammar rows never wait for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from kernels._triton import interpret_requested
from pd_serve.cache.kv_quant import kv_cache_dtype, load_kv_scales
from pd_serve.cache.pool import KVLayout, KVPool, pages_for
from pd_serve.config import CacheConfig, EngineConfig
from pd_serve.engine.attention import create_backend, resolve_backend_name
from pd_serve.engine.grammar import GrammarCompiler, GrammarState
from pd_serve.engine.plan import NewRequest, StepPlan, StepResult, sampling_from_wire
from pd_serve.engine.runner import Batch, BatchChunk, ModelRunner
from pd_serve.engine.sampler import PendingSample, Sampler, advance_generator, seeded_generator
from pd_serve.model.config import ModelConfig, resolve_dtype
from pd_serve.model.llama import pack_cpu_weights, use_batch1_kernels
from pd_serve.model.loader import load_model
from pd_serve.model.moe import resolve_moe_backend, set_moe_backend
from pd_serve.model.parallel import TPGroup, shard_model

logger = logging.getLogger(__name__)


class CachedRequest:
    """What an executor knows of a request: what the runner and the sampler read."""

    def __init__(self, new: NewRequest, vocab_size: int):
        self.request_id = new.request_id
        self.token_ids = list(new.token_ids)  # prompt + known outputs
        self.num_prompt_tokens = new.num_prompt_tokens
        self.page_ids = list(new.page_ids)
        self.sampling_params = sampling_from_wire(new.sampling)
        self.pending_row = -1  # its row in the samples of the step in flight
        self.grammar: GrammarState | None = None  # set by a sampling executor (structured output)
        seed = self.sampling_params.seed
        self.generator = None if seed is None else seeded_generator(seed)
        for _ in range(len(self.token_ids) - self.num_prompt_tokens):
            advance_generator(self, vocab_size)  # sampled elsewhere: skip their draws

    def token_at(self, pos: int) -> int:
        """The token id at pos; past the known ones, -(1 + its row in the step in flight)."""
        return self.token_ids[pos] if pos < len(self.token_ids) else -1 - self.pending_row

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class Executor:
    def __init__(self, config: EngineConfig, model_dir: Path, max_model_len: int, device: torch.device,
                 tp: TPGroup | None = None, samples: bool = True):
        """device: this rank's; tp: its tensor-parallel group (joined); samples: rank 0's."""
        self.config, self.device, self.tp = config, device, tp
        self.dtype = resolve_dtype(config.dtype, device.type)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.requests: dict[str, CachedRequest] = {}
        self.model_dir, self.samples = model_dir, samples
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first grammar
        self._sampled_rows = 0  # rows the last launched plan sampled (a follower's pending)
        self._scoring: set[str] = set()  # requests that asked for prompt logprobs
        self._build(model_dir, max_model_len, samples)

    def _build(self, model_dir: Path, max_model_len: int, samples: bool) -> None:
        cfg = self.config
        if self.tp is None:
            self.model = load_model(model_dir, self.dtype, self.device, cfg.load_format, cfg.seed,
                                    cfg.quantization)
        else:  # every rank loads the whole model on the host and keeps its shard
            full = load_model(model_dir, self.dtype, "cpu", cfg.load_format, cfg.seed, cfg.quantization)
            self.model = shard_model(full, self.tp, cfg.ep_size, cfg.tp).to(self.device)
            del full
        self.moe_backend = resolve_moe_backend(cfg.moe_runner_backend, self.device)
        # the torch MoE syncs with the host: no CUDA graphs around it
        graphs_ok = not (set_moe_backend(self.model, self.moe_backend) and self.moe_backend == "torch")
        mc = self.model.config  # this rank's shape (its heads) under TP
        kv_dtype = kv_cache_dtype(cfg.cache.kv_cache_dtype, self.dtype)
        k_scales, v_scales = load_kv_scales(model_dir, mc.num_layers, kv_dtype,
                                            f"--kv-cache-dtype {cfg.cache.kv_cache_dtype}")
        if mc.is_mla and k_scales:
            raise ValueError(f"--kv-cache-dtype {cfg.cache.kv_cache_dtype}: an FP8 latent cache "
                             f"({mc.architecture}) is not supported yet; use auto")
        # MLA (model/mla.py): one plane of one "head", the latent and rope key, per token
        layout = KVLayout(mc.num_layers, cfg.cache.page_size, mc.num_kv_heads, mc.head_dim,
                          str(kv_dtype).removeprefix("torch."), k_scales, v_scales,
                          num_planes=1 if mc.is_mla else 2)
        num_pages = _num_kv_pages(cfg.cache, layout, self.device)
        if self.tp is not None:  # the same page ids on every rank: the smallest pool
            smallest = torch.tensor([num_pages])
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=self.tp.control)
            num_pages = int(smallest)
        self.kv_pool = KVPool(layout, num_pages, self.device)
        logger.info("KV cache: %d pages x %d tokens = %d tokens, %s, %d bytes per token, %.2f GiB",
                    num_pages, layout.page_size, self.kv_pool.num_tokens, layout.dtype,
                    layout.bytes_per_token, self.kv_pool.num_bytes / 2**30)
        attn = self._mla_backend(mc) if mc.is_mla else None
        if attn is None:
            self.attention_backend = resolve_backend_name(cfg.attention_backend, self.device,
                                                          self.dtype, mc.head_dim, mc.layer_windows)
            attn = create_backend(self.attention_backend, self.kv_pool, mc.num_heads, mc.head_dim,
                                  mc.head_dim ** -0.5, self.dtype,
                                  batch1_kernels=cfg.enable_batch1_kernels,
                                  layer_windows=mc.layer_windows)
        if cfg.enable_batch1_kernels:
            use_batch1_kernels(self.model)
            if self.device.type != "cuda" and not interpret_requested():
                logger.warning("--enable-batch1-kernels has no effect on %s: its kernels run on "
                               "GPUs", self.device)
        if self.device.type == "cpu" and (packed := pack_cpu_weights(self.model)):
            logger.info("CPU: linear weights packed for oneDNN as well, %.2f GiB more", packed / 2**30)
        sampler = Sampler(cfg.seed, _eos_token_ids(model_dir)) if samples else None
        self.runner = ModelRunner(self.model, attn, sampler, layout.page_size)
        # Every rank captures the same sizes in the same order, so their collectives pair up in
        # the warm-up forwards and the replays; expert parallelism's all-to-all reads its split
        # sizes on the host, so it runs eagerly.
        if self.device.type == "cuda" and not cfg.disable_cuda_graph and attn.supports_cuda_graph \
                and cfg.ep_size == 1 and graphs_ok:
            max_bs = min(cfg.cuda_graph_max_bs, cfg.scheduler.max_running_requests)
            if cfg.scheduler.max_running_requests > cfg.cuda_graph_max_bs:
                logger.warning("decode batches above %d run without CUDA graphs (eagerly, several "
                               "times slower): --max-running-requests %d > --cuda-graph-max-bs %d; "
                               "raise --cuda-graph-max-bs to capture them", max_bs,
                               cfg.scheduler.max_running_requests, cfg.cuda_graph_max_bs)
            self.runner.capture_cuda_graphs(max_bs, pages_for(max_model_len, layout.page_size))

    def _mla_backend(self, mc: ModelConfig):
        """MLA models (engine/attention/mla.py): the Triton MLA backend where the Triton backend
        runs (auto on CUDA), else the torch one. flashinfer has no MLA path here: triton."""
        from pd_serve.engine.attention.mla import TorchMLABackend, TritonMLABackend
        from pd_serve.model.mla import mla_softmax_scale
        name = self.config.attention_backend
        if name == "flashinfer":
            logger.warning("--attention-backend flashinfer: %s runs multi-head latent attention "
                           "on the triton backend", mc.architecture)
            name = "triton"
        name = resolve_backend_name(name, self.device, self.dtype, mc.head_dim)
        if name == "flashinfer":  # auto on CUDA
            name = "triton"
        self.attention_backend = name
        backend = TritonMLABackend if name == "triton" else TorchMLABackend
        return backend(self.kv_pool, mc.num_heads, mc.kv_lora_rank, mla_softmax_scale(mc),
                       self.dtype)

    # ---- plans ----------------------------------------------------------------------------------
    def update(self, plan: StepPlan) -> None:
        """Apply what the plan says changed (its docstring gives the order)."""
        for request_id in plan.finished_ids:
            self.requests.pop(request_id, None)
            self._scoring.discard(request_id)
        for request_id in plan.preempted_ids:
            if request_id in self.requests:
                self.requests[request_id].page_ids = []
        for new in plan.new_requests:
            cached = self.requests[new.request_id] = CachedRequest(new, self.model_config.vocab_size)
            if cached.sampling_params.prompt_logprobs is not None:
                self._scoring.add(new.request_id)
            if cached.sampling_params.grammar is not None and self.samples:
                cached.grammar = self.grammars().matcher(cached.sampling_params.grammar)
                cached.grammar.accept(cached.output_token_ids)  # sampled elsewhere: replayed
        for diff in plan.request_diffs:
            cached = self.requests[diff.request_id]
            cached.token_ids.extend(diff.new_token_ids)
            cached.page_ids.extend(diff.new_page_ids)
            if cached.grammar is not None:
                cached.grammar.accept(cached.output_token_ids)

    def grammar_ready(self, grammar) -> bool:
        """Whether a request with this Grammar can be planned without waiting for its compile
        (engine/grammar.py: it starts here, on its own thread)."""
        return not self.samples or self.grammars().ready(grammar)

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Until a grammar compile under way ends, or timeout_s (at once when none is)."""
        if self._grammar_compiler is not None:
            self._grammar_compiler.wait(timeout_s)

    def grammars(self) -> GrammarCompiler:
        """The compiler for this model's tokenizer (built, importing xgrammar, on first use)."""
        if self._grammar_compiler is None:
            stop_ids = sorted(_eos_token_ids(self.model_dir))
            self._grammar_compiler = GrammarCompiler(self.model_dir, self.model_config.vocab_size,
                                                     stop_ids)
        return self._grammar_compiler

    def launch(self, plan: StepPlan, on_layer=None,
               prev: PendingSample | None = None) -> PendingSample:
        """Apply the plan and queue its step without waiting for the device (no rows when it
        samples nothing or this rank does not sample). prev: the step still in flight, where
        this plan's pending tokens are. on_layer(kv_sends, layer), for a plan with KV sends, is
        called as the forward finishes each layer (prefill's layer-wise KV send)."""
        self.update(plan)
        batch = self._batch(plan)
        prev_tokens = prev.tokens if prev is not None else None
        if self.tp is not None and any(c.request.token_at(c.start + c.num_tokens - 1) < 0
                                       for c in batch.chunks):
            prev_tokens = self._shared_tokens(prev_tokens)
        pending = self.runner.launch(batch, _after_layer(plan, on_layer), prev_tokens=prev_tokens)
        self._sampled_rows = sum(c.sample for c in plan.chunks)
        row = 0
        for chunk in plan.chunks:
            if chunk.sample:
                self.requests[chunk.request_id].pending_row = row
                row += 1
        return pending

    def _shared_tokens(self, tokens: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's sampled tokens of the step before, on every rank (module docstring)."""
        if self.samples:
            if tokens is None:
                raise RuntimeError("a planned token is pending but no step is in flight")
            tokens = tokens.to(torch.int64).contiguous()
        else:
            tokens = torch.empty(self._sampled_rows, dtype=torch.int64, device=self.device)
        dist.broadcast(tokens, src=0, group=self.tp.group)
        return tokens

    def execute(self, plan: StepPlan, on_layer=None) -> StepResult:
        """Run the plan and wait for its tokens (the synchronous schedule)."""
        self.update(plan)
        return self.runner.execute(self._batch(plan), _after_layer(plan, on_layer))

    def _batch(self, plan: StepPlan) -> Batch:
        return Batch([BatchChunk(self.requests[c.request_id], c.start, c.num_tokens, c.sample)
                      for c in plan.chunks], may_score=bool(self._scoring))


def _eos_token_ids(model_dir: Path) -> frozenset[int]:
    """The model's EOS ids (none for a dummy-weight model without a tokenizer)."""
    from pd_serve.model.tokenizer import Tokenizer
    has_tokenizer = (model_dir / "tokenizer.json").is_file()
    return Tokenizer.from_dir(model_dir).eos_token_ids if has_tokenizer else frozenset()


def _after_layer(plan: StepPlan, on_layer):
    """The forward's per-layer hook for a plan with KV sends (None: no hook, the graph path)."""
    if on_layer is None or not plan.kv_sends:
        return None
    return lambda layer: on_layer(plan.kv_sends, layer)


def resolve_device(name: str) -> torch.device:
    """--device: auto is cuda when there is a GPU, else cpu."""
    device = name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available; use --device cpu")
    return torch.device(device)


def _num_kv_pages(cache: CacheConfig, layout: KVLayout, device: torch.device) -> int:
    """Pool size in pages: --max-total-tokens if given, else from free memory (CPU:
    --cpu-kv-cache-gb). A CPU pool larger than the memory this process may have at all (the
    host's, or its cgroup's limit) is an error naming the flag (the allocation failed with a
    traceback); one larger than what is free now is a warning (CPU pages are committed as
    they are first written, so it may still fit)."""
    if device.type == "cpu" or cache.max_total_tokens is not None:
        if cache.max_total_tokens is not None:
            flag, pages = (f"--max-total-tokens {cache.max_total_tokens}",
                           pages_for(cache.max_total_tokens, layout.page_size))
        else:
            flag, pages = (f"--cpu-kv-cache-gb {cache.cpu_kv_cache_gb}",
                           int(cache.cpu_kv_cache_gb * 2**30 // layout.bytes_per_page))
        if pages < 1:
            raise ValueError(f"{flag}: not one {layout.page_size}-token KV page "
                             f"({layout.bytes_per_page} bytes); give more")
        if device.type == "cpu":
            total, available = _host_memory()
            size = pages * layout.bytes_per_page
            if total is not None and size > total:
                raise ValueError(f"{flag}: a KV cache of {size / 2**30:.1f} GiB, and this "
                                 f"machine has {total / 2**30:.1f} GiB in all")
            if available is not None and size > available:
                logger.warning("%s: a KV cache of %.1f GiB, more than the %.1f GiB free now",
                               flag, size / 2**30, available / 2**30)
        return pages
    # What the weights' load left cached (a model quantized at load frees its dense copy)
    # goes back to the driver first, and the budget subtracts all the allocator reserves,
    # so the rest of the memory is really free for graph capture, cuBLAS and activations.
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = total * cache.mem_fraction_static - torch.cuda.memory_reserved(device)
    if budget < layout.bytes_per_page:
        raise ValueError(f"--mem-fraction-static {cache.mem_fraction_static} leaves no room "
                         "for the KV cache after the weights; raise it")
    return int(budget // layout.bytes_per_page)


def _host_memory() -> tuple[int | None, int | None]:
    """(bytes this process may have at all, bytes free now): /proc/meminfo's MemTotal and
    MemAvailable, each capped by the cgroup v2 limit where one is set; None where unknown."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            total = min(total or int(limit), int(limit))
            available = min(available or int(limit) - used, int(limit) - used)
    except (OSError, ValueError):
        pass
    return total, available
