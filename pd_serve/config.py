"""Frozen configuration per role. CLI flags map one to one onto these fields (dashes for underscores)."""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULE_POLICIES = ("fcfs", "priority")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "flashinfer", "triton", "torch")
QUANTIZATIONS = ("fp8", "gptq")  # --quantization; None: as the checkpoint says
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # auto: the model dtype


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    max_total_tokens: int | None = None  # KV capacity in tokens; None: from memory
    mem_fraction_static: float = 0.88  # GPU: share of total memory for weights + KV pool
    cpu_kv_cache_gb: float = 1.0  # CPU: KV pool size when max_total_tokens is not given
    kv_cache_dtype: str = "auto"  # auto = the model dtype; fp8_e4m3 / fp8_e5m2 store scaled FP8

    def __post_init__(self) -> None:
        _check(self.page_size >= 1, "--page-size", self.page_size, "must be >= 1")
        _check(self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
               "--max-total-tokens", self.max_total_tokens, "must be >= --page-size")
        _check(0.0 < self.mem_fraction_static < 1.0, "--mem-fraction-static",
               self.mem_fraction_static, "must be in (0, 1)")
        _check(self.cpu_kv_cache_gb > 0, "--cpu-kv-cache-gb", self.cpu_kv_cache_gb, "must be > 0")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "--kv-cache-dtype", self.kv_cache_dtype,
               f"must be one of {', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 256
    chunked_prefill_size: int = 2048  # prefill tokens per step; -1 takes every prompt whole
    schedule_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _check(self.max_running_requests >= 1, "--max-running-requests",
               self.max_running_requests, "must be >= 1")
        _check(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
               "--chunked-prefill-size", self.chunked_prefill_size, "must be >= 1, or -1 to disable")
        _check(self.schedule_policy in SCHEDULE_POLICIES, "--schedule-policy",
               self.schedule_policy, f"must be one of {', '.join(SCHEDULE_POLICIES)}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # Hugging Face folder; None: the embedded SmolLM2-135M-Instruct
    device: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    context_length: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0
    load_format: str = "auto"  # dummy: random weights of config.json's shape (benchmarks)
    attention_backend: str = "auto"  # auto: flashinfer on GPU if installed, else triton; torch on CPU
    cuda_graph_max_bs: int = 256  # decode batches up to this size replay CUDA graphs
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False  # GPU: plan step N+1 while step N runs unless set
    # GPU: one-row decode steps run Triton GEMVs and Triton attention (faster; rounds differently
    # from batched steps, so greedy output may depend on the batch: off by default)
    enable_batch1_kernels: bool = False
    tp: int = 1  # tensor parallel size: ranks (processes, one GPU each) of this engine
    quantization: str | None = None  # fp8 / gptq; None: the checkpoint's (pd_serve/model/quant.py)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _check(self.device in DEVICES or self.device.startswith("cuda:"), "--device", self.device,
               f"must be one of {', '.join(DEVICES)} or cuda:N")
        _check(self.context_length is None or self.context_length >= 2, "--context-length",
               self.context_length, "must be >= 2")
        _check(self.load_format in LOAD_FORMATS, "--load-format", self.load_format,
               f"must be one of {', '.join(LOAD_FORMATS)}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "--attention-backend",
               self.attention_backend, f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        _check(self.tp >= 1, "--tp", self.tp, "must be >= 1")
        _check(self.cuda_graph_max_bs >= 1, "--cuda-graph-max-bs", self.cuda_graph_max_bs,
               "must be >= 1 (use --disable-cuda-graph to turn graphs off)")
        _check(self.quantization is None or self.quantization in QUANTIZATIONS, "--quantization",
               self.quantization, f"must be one of {', '.join(QUANTIZATIONS)}")

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
    port: int = 0  # decode: rank 0's receiver port (0: any free port; followers: any)
    layer_groups: int = 1  # prefill: --transfer-layer-groups
    cluster_key: bytes = b""  # HMAC key of every KV message (b"": none)

    def __post_init__(self) -> None:
        _check(self.role in ("prefill", "decode"), "role", self.role, "must be prefill or decode")
        _check(self.layer_groups >= 1, "--transfer-layer-groups", self.layer_groups, "must be >= 1")
