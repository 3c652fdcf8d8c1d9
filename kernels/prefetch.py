"""L2 prefetch: start reading weights into the GPU's L2 cache before the kernel that needs them.

At decode batch 1 a step alternates kernels that stream weights from HBM (the GEMVs) with
kernels bound by latency that leave HBM nearly idle (RMSNorm, RoPE + KV store, the attention:
about 14 us a layer of Llama-3.1-8B on an H200). `l2_prefetch(*views)` issues Hopper's bulk L2
prefetch (`cp.async.bulk.prefetch.L2.global`: a hint, no data returned, nothing to wait for)
for the bytes of each view, so weights read later in the step already sit in L2 (50 MB on an
H100/H200) when their GEMV runs, and their HBM time moves into a gap where HBM had nothing to do.

One launch, THREADS threads a program (one warp); each thread prefetches one CHUNK-byte
(or shorter, last) piece of one view. Under PDL (kernels/_triton.py) the kernel lets the next
one be scheduled at once, issues its prefetches without waiting (weights are not written by the
kernel before), and only then waits for the kernel before it, so that the next kernel's own
wait still covers everything before this one. It changes no memory: where it is left out,
nothing computes differently.

`l2_prefetch` runs on CUDA tensors of compute capability 9 or more and does nothing elsewhere
(the CPU, older GPUs, Triton's interpreter, which cannot run PTX). Triton is imported lazily,
so importing this module never imports it.
"""

from __future__ import annotations

import torch

from kernels._triton import _capability, launch_options, lazy_kernel, pdl

# Kernel launches so far; the tests read it to confirm the kernel really ran.
triton_launches = 0

_MAX_VIEWS = 3  # views one launch takes
_CHUNK = 16384  # bytes one thread prefetches (one bulk prefetch instruction)
_THREADS = 32  # threads (chunks) a program: one warp
tl = None  # triton.language, bound when _kernel is first built


def l2_prefetch(*views: torch.Tensor) -> None:
    """Start loading the bytes of up to three contiguous CUDA tensors into L2; returns at once.

    Each view's bytes must start 16-byte aligned and be a multiple of 16 long (a slice of whole
    rows of a 2-D weight with a row of 16 bytes or more is). On anything but a Hopper-or-later
    GPU this does nothing."""
    views = [v for v in views if v.numel() > 0]
    _check(views)
    if views and views[0].is_cuda and _capability(views[0].device.index) >= 9:
        _launch(views)


def _launch(views: list[torch.Tensor]) -> None:
    """One launch over the views' chunks, in order (the compile test calls this on CPU)."""
    global triton_launches
    kernel = _kernel.load()
    sizes = [v.numel() * v.element_size() for v in views]
    chunks = [-(-n // _CHUNK) for n in sizes]
    ends = [sum(chunks[:i + 1]) for i in range(len(chunks))]  # cumulative chunk counts
    padded = [v.view(torch.uint8) if v.dim() > 0 else v for v in views]
    while len(padded) < _MAX_VIEWS:
        padded.append(padded[0])
        sizes.append(0)
        ends.append(ends[-1])
    grid = (-(-ends[-1] // _THREADS),)
    kernel[grid](padded[0], padded[1], padded[2], sizes[0], sizes[1], sizes[2], ends[0], ends[1],
                 CHUNK=_CHUNK, THREADS=_THREADS, num_warps=1,
                 **launch_options(pdl(views[0])))
    triton_launches += 1


@lazy_kernel("the L2 prefetch")
def _kernel(triton):
    """The jitted prefetch kernel."""
    @triton.jit
    def l2_prefetch_kernel(p0, p1, p2, n0, n1, n2, end0, end1, CHUNK: tl.constexpr,
                           THREADS: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # the next kernel may be scheduled now (see the module docstring)
            tl.extra.cuda.gdc_launch_dependents()
        c = tl.program_id(0) * THREADS + tl.arange(0, THREADS)  # [THREADS] chunk ids
        in0 = c < end0
        in1 = (c >= end0) & (c < end1)
        offset = tl.where(in0, c, tl.where(in1, c - end0, c - end1)).to(tl.int64) * CHUNK
        size = tl.where(in0, n0, tl.where(in1, n1, n2)) - offset  # bytes left in the view
        size = tl.minimum(tl.maximum(size, 0), CHUNK).to(tl.int32)
        ptr = tl.where(in0, p0, tl.where(in1, p1, p2)) + offset
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
        if PDL:  # done only once the kernel before is: the next kernel's wait covers it
            tl.extra.cuda.gdc_wait()

    return l2_prefetch_kernel


def _check(views: list[torch.Tensor]) -> None:
    if len(views) > _MAX_VIEWS:
        raise ValueError(f"l2_prefetch takes at most {_MAX_VIEWS} tensors, got {len(views)}")
    for v in views:
        nbytes = v.numel() * v.element_size()
        if not v.is_contiguous() or v.data_ptr() % 16 or nbytes % 16:
            raise ValueError(f"l2_prefetch needs contiguous tensors starting 16-byte aligned and a "
                             f"multiple of 16 bytes long, got {v.dtype} {tuple(v.shape)} at "
                             f"{v.data_ptr():#x}")
        if v.device != views[0].device:
            raise ValueError(f"all tensors must share a device, got {v.device} and "
                             f"{views[0].device}")
