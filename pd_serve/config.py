"""Frozen configuration per role: engine (with its cache and scheduler), worker, gateway.

The CLI's flags are generated from these fields (pd_serve/cli.py): `--page-size` sets
`page_size`; a field's metadata gives its help text, its choices (the tuples below), and a flag
name where it differs (`transfer_timeout_s` is `--transfer-timeout`; None: no flag). Bool fields
are store_true flags. Nothing writes a config after start-up.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import MISSING, dataclass, field, fields

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "random", "priority")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "flashinfer", "triton", "torch")
MOE_RUNNER_BACKENDS = ("auto", "triton", "torch")
QUANTIZATIONS = ("fp8", "gptq")  # --quantization; None: as the checkpoint says
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # auto: the model dtype
TRANSFER_BACKENDS = ("auto", "torch", "ipc", "tcp", "nixl")
PREFILL_POLICIES = ("cache_aware", "round_robin", "least_load", "prefix")
DECODE_POLICIES = ("cache_aware", "round_robin", "least_load")
TOOL_CALL_PARSERS = ("llama3_json", "hermes", "mistral")  # gateway/tool_parsers.py
REASONING_PARSERS = ("deepseek-r1", "qwen3")  # gateway/reasoning.py
MAX_WORKER_TIMEOUT_S = 86400.0  # --worker-timeout's bound: a gateway ping carries it


def _opt(default=MISSING, help: str | None = None, **meta):
    """A config field with its CLI metadata: help, choices, flag (another name; None: none)."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = _opt(16, "tokens per KV page")
    max_total_tokens: int | None = _opt(None, "KV cache capacity in tokens (default: from memory)")
    mem_fraction_static: float = _opt(0.88, "GPU: fraction of memory for weights and KV cache")
    cpu_kv_cache_gb: float = _opt(1.0, "CPU: KV cache size when --max-total-tokens is not given")
    kv_cache_dtype: str = _opt(
        "auto", "auto: the model dtype; fp8_e4m3 / fp8_e5m2: FP8 pages, half the bytes of bf16, "
        "scaled by the checkpoint's k_scale/v_scale (else 1.0); prefill and decode workers must "
        "use the same", choices=KV_CACHE_DTYPES)
    disable_radix_cache: bool = _opt(
        False, "do not keep finished requests' KV pages for later prompts that share their prefix "
        "(the prefix cache; on a decode worker it also holds finished conversations, so a follow-up "
        "turn receives only its new pages)")

    def __post_init__(self) -> None:
        _check(self.page_size >= 1, "--page-size", self.page_size, "must be >= 1")
        _check(self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
               "--max-total-tokens", self.max_total_tokens, "must be >= --page-size")
        _check(0.0 < self.mem_fraction_static < 1.0, "--mem-fraction-static",
               self.mem_fraction_static, "must be in (0, 1)")
        _check(0 < self.cpu_kv_cache_gb < math.inf, "--cpu-kv-cache-gb", self.cpu_kv_cache_gb,
               "must be > 0 and finite")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "--kv-cache-dtype", self.kv_cache_dtype,
               f"must be one of {', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = _opt(256)
    chunked_prefill_size: int = _opt(2048, "max prefill tokens per step; -1 disables chunking")
    long_prefill_token_threshold: int = _opt(
        0, "a prompt's chunk takes at most this many tokens of a step while other prompts wait "
        "to be admitted (they get the rest of the step's budget first; what is left goes back "
        "to the long prompt); 0: off")
    schedule_policy: str = _opt(
        "fcfs", "admission order: fcfs; lpm (longest cached prefix first); dfs-weight (requests "
        "that share a cached prefix together); random; priority (smaller first)",
        choices=SCHEDULE_POLICIES)

    def __post_init__(self) -> None:
        _check(self.max_running_requests >= 1, "--max-running-requests",
               self.max_running_requests, "must be >= 1")
        _check(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
               "--chunked-prefill-size", self.chunked_prefill_size, "must be >= 1, or -1 to disable")
        _check(self.long_prefill_token_threshold >= 0, "--long-prefill-token-threshold",
               self.long_prefill_token_threshold, "must be >= 0 (0: off)")
        _check(self.schedule_policy in SCHEDULE_POLICIES, "--schedule-policy",
               self.schedule_policy, f"must be one of {', '.join(SCHEDULE_POLICIES)}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _opt(None, "Hugging Face model folder (config.json, safetensors, "
                             "tokenizer.json) or a llama-architecture .gguf file (converted once "
                             "into the cache); default: the embedded SmolLM2-135M-Instruct")
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = _opt("auto", "auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    context_length: int | None = _opt(
        None, "max prompt + output tokens (default: the model's max_position_embeddings)")
    seed: int = _opt(0)
    load_format: str = _opt("auto", "dummy: random weights of config.json's shape (for benchmarks)",
                            choices=LOAD_FORMATS)
    attention_backend: str = _opt(
        "auto", "auto: flashinfer on GPU when installed, else triton; torch on CPU",
        choices=ATTENTION_BACKENDS)
    moe_runner_backend: str = _opt(
        "auto", "MoE models' experts: triton (kernels/fused_moe.py) or torch (its reference; "
        "no CUDA graphs); auto: triton on GPU, torch on CPU", choices=MOE_RUNNER_BACKENDS)
    cuda_graph_max_bs: int = _opt(256, "largest decode batch replayed through a CUDA graph")
    disable_cuda_graph: bool = _opt(False, "run decode eagerly")
    enable_batch1_kernels: bool = _opt(
        False, "GPU: decode steps of one request run a Triton GEMV for each linear layer, "
        "Triton paged attention and, in MoE models, one-token expert kernels (faster at batch "
        "1, but such a step rounds differently from a "
        "batched one, so a request's greedy output can depend on whether it decoded alone)")
    tp: int = _opt(1, "tensor parallel size: this engine's ranks, one process and one GPU each "
                   "(cuda:0..tp-1 of the visible ones)")
    ep_size: int = _opt(1, "expert parallel size: an MoE model's experts partitioned over N "
                        "ranks, tokens dispatched to them by all-to-all; equal to --tp "
                        "(attention under --tp), or with --tp 1 (attention replicated: "
                        "N ranks, one process and one GPU each)")
    disable_overlap_schedule: bool = _opt(
        False, "on GPU, wait for each step's tokens before planning the next (by default step "
        "N+1 is planned while step N runs)")
    quantization: str | None = _opt(
        None, "weights: fp8 quantizes a 16/32-bit checkpoint at load (or names an FP8 "
        "checkpoint's), gptq names a GPTQ INT4 checkpoint's; default: as the checkpoint's "
        "config.json says", choices=QUANTIZATIONS)
    cache: CacheConfig = field(default_factory=CacheConfig, metadata={"flag": None})
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig, metadata={"flag": None})

    def __post_init__(self) -> None:
        _check(self.device in DEVICES or re.fullmatch(r"cuda:\d+", self.device), "--device",
               self.device, f"must be one of {', '.join(DEVICES)} or cuda:N")
        _check(self.context_length is None or self.context_length >= 2, "--context-length",
               self.context_length, "must be >= 2")
        _check(self.load_format in LOAD_FORMATS, "--load-format", self.load_format,
               f"must be one of {', '.join(LOAD_FORMATS)}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "--attention-backend",
               self.attention_backend, f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        _check(self.moe_runner_backend in MOE_RUNNER_BACKENDS, "--moe-runner-backend",
               self.moe_runner_backend, f"must be one of {', '.join(MOE_RUNNER_BACKENDS)}")
        _check(self.tp >= 1, "--tp", self.tp, "must be >= 1")
        _check(self.ep_size >= 1 and (self.ep_size in (1, self.tp) or self.tp == 1), "--ep-size",
               self.ep_size, "must be 1, equal to --tp, or any size with --tp 1")
        _check(self.cuda_graph_max_bs >= 1, "--cuda-graph-max-bs", self.cuda_graph_max_bs,
               "must be >= 1 (use --disable-cuda-graph to turn graphs off)")
        _check(self.quantization is None or self.quantization in QUANTIZATIONS, "--quantization",
               self.quantization, f"must be one of {', '.join(QUANTIZATIONS)}")

    @property
    def world_size(self) -> int:
        """The engine's ranks (processes): --tp, or --ep-size when attention is replicated."""
        return max(self.tp, self.ep_size)

    @classmethod
    def from_flat(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments named as the CLI flags (page_size=..., seed=...)."""
        parts = {}
        for name, sub in (("cache", CacheConfig), ("scheduler", SchedulerConfig)):
            keys = [k for k in kwargs if k in sub.__dataclass_fields__]
            parts[name] = sub(**{k: kwargs.pop(k) for k in keys})
        unknown = [k for k in kwargs if k not in cls.__dataclass_fields__]
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs, **parts)


@dataclass(frozen=True)
class WorkerConfig:
    """A prefill, decode or colocated worker: its engine, and how it reaches the gateway and
    its peers."""

    engine: EngineConfig = field(metadata={"flag": None})
    gateway: str = _opt(help="the gateway's control address, tcp://HOST:PORT")
    worker_id: str = _opt("", "default: ROLE-HOSTNAME-PID")
    host: str = _opt("127.0.0.1", "decode: address the KV receivers bind (0.0.0.0: every interface)")
    advertise_host: str | None = _opt(
        None, "address other hosts reach this worker at, as peers are told (default: --host; "
        "needed with --host 0.0.0.0)")
    port: int = _opt(0, "decode: KV receiver port (0 = any free port)")
    transfer_backend: str = _opt("auto", "auto: tcp on CPU, torch (NCCL) on GPU",
                                 choices=TRANSFER_BACKENDS)
    transfer_timeout_s: float = _opt(
        30.0, "seconds a KV transfer may go without a chunk (prefill sends a prompt's layer "
        "groups as it computes them) or, after its last, without the acknowledgement",
        flag="--transfer-timeout")
    transfer_layer_groups: int = _opt(
        1, "prefill: send each prompt's KV in this many layer groups, each as soon as the "
        "forward has computed it, overlapping transfer with compute (1: after the last layer)")
    drain_timeout_s: float = _opt(
        30.0, "on SIGTERM: take no new requests (the gateway routes around the worker), finish "
        "the ones held for at most this many seconds, then fail the rest and exit; 0: exit at "
        "once; a second SIGTERM exits at once", flag="--drain-timeout")
    heartbeat_s: float = _opt(1.0, flag=None)
    cluster_key: bytes = _opt(b"", flag=None)  # HMAC key of every control and KV message (empty: none)

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0:  # (NaN is not)
            raise ValueError(f"--drain-timeout {self.drain_timeout_s} must be >= 0")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"--transfer-timeout {self.transfer_timeout_s} must be > 0")
        check_port("--port", self.port)
        if self.transfer_layer_groups < 1:
            raise ValueError(f"--transfer-layer-groups {self.transfer_layer_groups} must be >= 1")
        host, _, port = self.gateway.removeprefix("tcp://").rpartition(":")
        if not self.gateway.startswith("tcp://") or not host or not port.isdigit() \
                or not 1 <= int(port) <= 65535:
            raise ValueError(f"--gateway {self.gateway!r} must look like tcp://HOST:PORT "
                             "(PORT 1-65535)")
        if self.reachable_host in ("0.0.0.0", "::", ""):
            raise ValueError(f"--host {self.host!r} binds every interface: give --advertise-host, "
                             "the address peers reach this worker at")

    @property
    def reachable_host(self) -> str:
        """The address peers reach this worker at: --advertise-host, else --host."""
        return self.advertise_host or self.host


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's cluster: where workers register, routing, limits and timeouts."""

    control_host: str = _opt("127.0.0.1", "address workers register on")
    control_port: int = _opt(0, "port workers register on")  # 0: any free port
    served_model_name: str = _opt("default", "the id clients name (default: --model's folder or "
                                  "file name; SmolLM2-135M-Instruct for the default model)")
    prefill_policy: str = _opt(
        "cache_aware", "which prefill (and colocated) worker computes a prompt: cache_aware (the "
        "longest cached prefix, unless the load is out of balance), round_robin, least_load, "
        "prefix (a hash of the first 64 tokens)", choices=PREFILL_POLICIES)
    balance_abs_threshold: int = _opt(
        64, "cache_aware: route by load, not cache, once the busiest and the idlest worker's "
        "requests differ by more than this ...")
    balance_rel_threshold: float = _opt(1.5, "... and the busiest has more than this times the idlest's")
    decode_policy: str = _opt(
        "cache_aware", "which decode worker takes a request: cache_aware (the one whose prefix "
        "cache holds the longest prefix, e.g. the conversation's earlier turns, so only the new "
        "KV crosses; by load past the balance thresholds), round_robin, least_load",
        choices=DECODE_POLICIES)
    worker_timeout_s: float = _opt(10.0, "seconds without a heartbeat before a worker is dropped",
                                   flag="--worker-timeout")
    admit_timeout_s: float = _opt(
        600.0, "seconds a request may wait in the gateway's queue for a prefill+decode pair "
        "with room (then 503)", flag="--admit-timeout")
    step_timeout_s: float = _opt(120.0, "longest silence from a worker on a live request",
                                 flag="--step-timeout")
    max_queued_requests: int = _opt(
        4096, "requests waiting in the gateway's queue; beyond this, 429 with Retry-After")
    max_outstanding_requests: int = _opt(
        8192, "requests queued or running; beyond this, 429 with Retry-After")
    retry_max_retries: int = _opt(
        2, "times a request whose worker was lost (died, unreachable, restarted) before its "
        "client saw output (its first token; a non-streamed request's whole answer) goes back "
        "to the queue for another pair (0: it fails at once)")
    api_key: str = _opt("", "clients must send 'Authorization: Bearer KEY' on every route but "
                        "/health and /metrics, which stay open (default: $PD_SERVE_API_KEY; "
                        "none: open)")
    body_timeout_s: float = _opt(30.0, "seconds to read a request body (then 408)",
                                 flag="--body-timeout")
    send_timeout_s: float = _opt(
        30.0, "seconds a response (a stream, a whole answer, an error) waits for its client to "
        "read (then the connection closes and the request is aborted, as when the client "
        "leaves)", flag="--send-timeout")
    timeout_keep_alive_s: float = _opt(
        5.0, "seconds a client connection stays open with no request running: after it opens "
        "or its last response (a request's headers must arrive within them)",
        flag="--timeout-keep-alive")
    tool_call_parser: str | None = _opt(
        None, "read tool calls out of chat output for tool_choice auto, in the model's format: "
        "llama3_json (Llama 3.x), hermes (Hermes, Qwen2.5/3 <tool_call>), mistral ([TOOL_CALLS]); "
        "without it, auto is refused (required and named choices need none)",
        choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = _opt(
        None, "split a reasoning model's <think>...</think> out of chat output as "
        "reasoning_content: deepseek-r1 (the opening tag may be missing), qwen3",
        choices=REASONING_PARSERS)
    allowed_origins: str = _opt(
        "", "browser origins that may call the API (CORS), comma-separated, e.g. "
        "https://app.example.com, or * for any (default: none, no CORS headers)")
    disable_access_log_for_endpoints: str = _opt(
        "", "paths whose requests the access log leaves out, comma-separated, e.g. /health,/metrics "
        "(probes and scrapers; `launch` leaves out /health, which it polls while workers start)")
    cluster_key: bytes = _opt(b"", flag=None)  # HMAC key of every control message (empty: none)

    def __post_init__(self) -> None:
        check_port("--control-port", self.control_port)
        for name in ("worker_timeout_s", "admit_timeout_s", "step_timeout_s", "body_timeout_s",
                     "send_timeout_s", "timeout_keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name[:-2].replace('_', '-')} must be > 0")
        if self.worker_timeout_s > MAX_WORKER_TIMEOUT_S:  # (pings carry it; workers check)
            raise ValueError(f"--worker-timeout must be <= {MAX_WORKER_TIMEOUT_S:g} (a day)")
        for name in ("max_queued_requests", "max_outstanding_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.retry_max_retries < 0:
            raise ValueError("--retry-max-retries must be >= 0")
        if self.balance_abs_threshold < 0 or not 0 <= self.balance_rel_threshold < math.inf:
            raise ValueError(f"--balance-abs-threshold {self.balance_abs_threshold} and "
                             f"--balance-rel-threshold {self.balance_rel_threshold} must be >= 0 "
                             "and finite")
        bad = [p for p in self.quiet_paths if not p.startswith("/")]
        if bad:
            raise ValueError(f"--disable-access-log-for-endpoints {bad[0]!r}: a path starts with /")
        bad = [o for o in self.origins if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o)]
        if bad:
            raise ValueError(f"--allowed-origins {bad[0]!r} is not an origin: scheme://host[:port] "
                             "(no path), or *")

    @property
    def quiet_paths(self) -> tuple[str, ...]:
        """--disable-access-log-for-endpoints as a tuple."""
        return tuple(p.strip() for p in self.disable_access_log_for_endpoints.split(",") if p.strip())

    @property
    def origins(self) -> tuple[str, ...]:
        """--allowed-origins as a tuple."""
        return tuple(o.strip() for o in self.allowed_origins.split(",") if o.strip())


# ---- CLI flags from the fields ----------------------------------------------------------------
_TYPES = {"int": int, "float": float, "str": str}


def config_flag(f) -> str | None:
    """The CLI flag of a config field (None: it has none)."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def add_config_args(group, cls, skip: tuple[str, ...] = (), **defaults) -> None:
    """One flag per field of `cls` that has one, but those named in `skip`; `defaults` overrides
    a field's default on the CLI (the flag's value still lands under the field's name)."""
    for f in fields(cls):
        flag = config_flag(f)
        if flag is None or f.name in skip:
            continue
        kind = f.type.removesuffix(" | None")
        help_text = f.metadata.get("help")
        if kind == "bool":
            group.add_argument(flag, dest=f.name, action="store_true", help=help_text)
            continue
        default = defaults.get(f.name, f.default)
        group.add_argument(flag, dest=f.name, type=_TYPES[kind], help=help_text,
                           metavar=None if "choices" in f.metadata else flag[2:].replace("-", "_").upper(),
                           choices=f.metadata.get("choices"), required=default is MISSING,
                           default=None if default is MISSING else default)


def config_kwargs(cls, args: argparse.Namespace) -> dict:
    """The fields of `cls` that have a flag, read from parsed arguments."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if f.metadata.get("flag", "") is not None}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed CLI flags (those of EngineConfig, CacheConfig, SchedulerConfig)."""
    return EngineConfig(**config_kwargs(EngineConfig, args),
                        cache=CacheConfig(**config_kwargs(CacheConfig, args)),
                        scheduler=SchedulerConfig(**config_kwargs(SchedulerConfig, args)))


def check_port(flag: str, port: int) -> None:
    """A TCP port flag's value: 0 (any free port) to 65535."""
    _check(0 <= port <= 65535, flag, port, "must be a port, 0-65535 (0: any free one)")


def _check(ok: bool, flag: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"{flag} {value!r} {rule}")


@dataclass(frozen=True)
class TransferConfig:
    """A prefill or decode worker's KV hand-off (transfer/connector.py), the same on every TP
    rank (it travels to the followers' processes)."""

    role: str  # "prefill" | "decode"
    backend: str  # tcp / torch / ipc / nixl (resolved: not auto)
    timeout_s: float = 30.0
    worker_id: str = ""
    host: str = "127.0.0.1"  # decode: where the receivers bind
    advertise_host: str | None = None  # decode: where senders reach them (None: host)
    port: int = 0  # decode: rank 0's receiver port (0: any free port; followers: any)
    layer_groups: int = 1  # prefill: --transfer-layer-groups
    cluster_key: bytes = b""  # HMAC key of every KV message (b"": none)

    def __post_init__(self) -> None:
        _check(self.role in ("prefill", "decode"), "role", self.role, "must be prefill or decode")
        _check(self.layer_groups >= 1, "--transfer-layer-groups", self.layer_groups, "must be >= 1")
