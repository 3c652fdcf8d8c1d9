"""What every kernels/*.py module shares: when to run Triton, and a kernel built on first use.

A module runs its kernel on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1
(Triton's interpreter; how the tests exercise the kernels); otherwise its torch reference.
Triton is imported when a kernel is first needed, so importing a kernels module never imports it.

    @lazy_kernel("CUDA RoPE")
    def _kernel(triton):
        @triton.jit
        def rope_kernel(...): ...   # uses the module global `tl`
        return rope_kernel

    if not _kernel.runs_on(q): ...  # torch reference
    kernel = _kernel.load()         # the jitted kernel, or a RuntimeError

Programmatic dependent launch (PDL, Hopper and later), on by default (PD_SERVE_PDL=0 turns it
off): the GEMV, FP8 GEMM and activation quantization, RMSNorm, RoPE + KV store,
paged-attention, MoE routing and batch-1 MoE kernels
launch with `launch_pdl` where `pdl(x)` says so (the batch-1 decode path is made of them). Such
a kernel may be scheduled while the kernel before it in the stream is finishing; it calls
`gdc_wait()` (the previous kernel done and its writes visible) before it reads what that kernel
may write, then `gdc_launch_dependents()` so the next one may be scheduled early in turn: the
gap between kernels shrinks. CUDA graphs keep it. Before the wait a kernel reads only what no
kernel of the forward writes (weights and their scales, RoPE's cos / sin tables) or what the
host staged for the batch before it (positions, KV slots, attention's page lists): RMSNorm's
weight, the RoPE + KV store's rows, attention's bounds and first pages and the FP8 GEMV's first
weight tile and scales load there, under the tail of the kernel before.
tests/kernels/test_pdl_prewait.py holds each kernel to its list of such reads. On one H200
(Llama-3.1-8B shape, --enable-batch1-kernels) PDL takes a decode step at 1k context from 4.42
to 4.26 ms at batch 1 and from 7.59 to 7.33 ms at batch 64.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch


def pdl(x: torch.Tensor) -> bool:
    """Launch x's kernel with programmatic dependent launch: x on a GPU of compute capability 9
    or more, unless PD_SERVE_PDL=0."""
    return x.is_cuda and pdl_enabled() and _capability(x.device.index) >= 9


def pdl_enabled() -> bool:
    """PD_SERVE_PDL: 1 (the default) or 0."""
    value = os.environ.get("PD_SERVE_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PD_SERVE_PDL must be 0 or 1, got {value!r}")
    return value == "1"


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def launch_options(use_pdl: bool) -> dict:
    """Launch keywords for a kernel with a PDL constexpr: launch_pdl only when it is on."""
    return {"PDL": use_pdl, **({"launch_pdl": True} if use_pdl else {})}


def device_counters(counters: dict, device: torch.device, size: int, what: str) -> torch.Tensor:
    """counters[device]: a zeroed int32 [size] buffer that a kernel's last program resets after
    counting (split merges, route_one_row, the batch-1 down sum). Made on first use and never
    replaced, as a captured CUDA graph keeps its address; so it must be made outside any
    capture (the engine runs each graph's forward eagerly before capturing it)."""
    if device not in counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what} must exist before a CUDA graph capture: "
                               "call the kernel eagerly first")
        counters[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counters[device]


def interpret_requested() -> bool:
    """PD_SERVE_TRITON_CPU=1: run the kernels on CPU tensors in Triton's interpreter (tests).

    Triton's interpreter itself needs TRITON_INTERPRET=1 set before triton is first imported
    (its tl.sum, tl.cdiv, ... are built for one mode at import); tests/conftest.py sets it for
    the whole test process on machines without a GPU."""
    return os.environ.get("PD_SERVE_TRITON_CPU", "0").lower() in ("1", "true", "on", "yes")


class LazyKernel:
    """A module's @triton.jit kernel(s), made by `build(triton)` on first use.

    Built once per mode, as Triton decides at @triton.jit time whether a function is
    interpreted. Before `build` runs, triton.language is bound to the global `tl` of build's
    module: kernel bodies must find `tl` there (a module global, not a closure: Triton before
    3.4 resolves only globals).
    """

    def __init__(self, build: Callable[[Any], Any], purpose: str):
        self._build = build
        self._purpose = purpose  # "Triton is needed for {purpose} but does not import"
        self._built: dict[bool, Any] = {}

    def get(self, interpret: bool) -> Any:
        """What `build` returned for this mode, or None when Triton does not import."""
        if interpret not in self._built:
            try:
                import triton
                import triton.language as tl
            except ImportError:
                self._built[interpret] = None
                return None
            self._build.__globals__["tl"] = tl
            self._built[interpret] = self._build(triton)
        return self._built[interpret]

    def runs_on(self, x: torch.Tensor) -> bool:
        """Whether the kernel serves tensors like x: always on CUDA; on CPU only when
        PD_SERVE_TRITON_CPU=1 and Triton imports."""
        if x.is_cuda:
            return True
        return interpret_requested() and self.get(True) is not None

    def load(self) -> Any:
        """The kernel(s) for the current mode; a RuntimeError when Triton does not import."""
        kernel = self.get(interpret_requested())
        if kernel is None:
            raise RuntimeError(f"Triton is needed for {self._purpose} but does not import")
        return kernel


def lazy_kernel(purpose: str) -> Callable[[Callable[[Any], Any]], LazyKernel]:
    """Decorator: `build(triton)` -> a `LazyKernel`; purpose names it in the import error."""
    return lambda build: LazyKernel(build, purpose)
