"""Frozen configuration per role. CLI flags map one to one onto these fields (dashes for underscores)."""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULE_POLICIES = ("fcfs", "priority")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    max_total_tokens: int | None = None  # KV capacity in tokens; None: from memory
    mem_fraction_static: float = 0.88  # GPU: share of total memory for weights + KV pool
    cpu_kv_cache_gb: float = 1.0  # CPU: KV pool size when max_total_tokens is not given
    kv_cache_dtype: str = "auto"  # auto = the model dtype

    def __post_init__(self) -> None:
        _check(self.page_size >= 1, "--page-size", self.page_size, "must be >= 1")
        _check(self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
               "--max-total-tokens", self.max_total_tokens, "must be >= --page-size")
        _check(0.0 < self.mem_fraction_static < 1.0, "--mem-fraction-static",
               self.mem_fraction_static, "must be in (0, 1)")
        _check(self.cpu_kv_cache_gb > 0, "--cpu-kv-cache-gb", self.cpu_kv_cache_gb, "must be > 0")
        _check(self.kv_cache_dtype == "auto", "--kv-cache-dtype", self.kv_cache_dtype,
               "is not supported yet; use auto (the model dtype)")


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
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _check(self.device in DEVICES or self.device.startswith("cuda:"), "--device", self.device,
               f"must be one of {', '.join(DEVICES)} or cuda:N")
        _check(self.context_length is None or self.context_length >= 2, "--context-length",
               self.context_length, "must be >= 2")


def _check(ok: bool, flag: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"{flag} {value!r} {rule}")
