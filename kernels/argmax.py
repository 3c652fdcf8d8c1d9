"""Argmax over the vocabulary: a row's greedy token, as `torch.argmax(logits, dim=-1)` gives it.

torch's argmax takes about 27 us a decode step at batch 1 on an H200 to read Llama-3.1-8B's
128,256 float32 logits (0.5 MB), about 1 % of the step. Here the row is split over many
programs, in two launches, which makes an FP8 batch-1 step about 0.02 ms shorter:

1. program (b, s) reads BLOCK logits of row b and writes the best of them as one int64 key;
2. program b takes the largest of its row's keys and writes the token id.

The key orders the way torch.argmax chooses: a larger value wins, NaN is larger than any value
(torch returns the first NaN), and of equal values the lower index wins. The float32 value's bits
are mapped to an unsigned 32-bit number that sorts as the floats do (-0.0 made +0.0 first, as
they compare equal; NaN mapped to the top), times 2^31, plus (2^31 - 1 - index):

    key = ordered(value) * 2^31 + (2^31 - 1 - index)      (< 2^63: a non-negative int64)

so one integer max is the whole comparison, ties included, and the index is read back from the
low 31 bits. float16 / bfloat16 logits are widened to float32 first (exact).

`argmax` runs the kernels on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1
(Triton's interpreter; how the tests exercise them); otherwise torch.argmax. Triton is imported
lazily, so importing this module never imports it.
"""

from __future__ import annotations

import torch

from kernels._triton import lazy_kernel

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 4096  # logits per first-stage program: 32 programs a row for a 128k vocabulary
_LOW = 1 << 31  # the key's index field
tl = None  # triton.language, bound when _kernel is first built


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The index of each row's largest logit, as `torch.argmax(logits, dim=-1)`.

    Parameters
    ----------
    logits : [B, V] float32 / float16 / bfloat16, 0 < V < 2^31 (a last dim that is not
        contiguous is copied first).
    out : int64 [B], contiguous, to write into (a CUDA graph's fixed buffer); else a new one.

    Returns
    -------
    out, or a new int64 [B] tensor.
    """
    _check(logits, out)
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if not _kernel.runs_on(logits):
        return torch.argmax(logits, dim=-1, out=out)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if logits.shape[0] > 0:
        _launch(logits, out)
    return out


@lazy_kernel("the argmax")
def _kernel(triton):
    """The jitted (partial keys, row max) kernels."""
    @triton.jit
    def argmax_partial_kernel(logits_ptr, keys_ptr, row_stride, V, num_blocks,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < V
        v = tl.load(logits_ptr + row * row_stride + idx, mask=mask, other=float("-inf"))
        v = v.to(tl.float32)
        v = tl.where(v == 0.0, 0.0, v)  # -0.0 -> +0.0: they compare equal
        bits = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        ordered = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
        ordered = tl.where(v != v, 0xFFFFFFFF, ordered)  # NaN above everything
        # masked lanes carry -inf at indices past V: a real -inf at a lower index wins
        key = ordered * 0x80000000 + (0x7FFFFFFF - idx.to(tl.int64))
        best = tl.reduce(key, 0, tl.standard._elementwise_max)  # not tl.max: see kernels/norm.py
        tl.store(keys_ptr + row * num_blocks + tl.program_id(1), best)

    @triton.jit
    def argmax_final_kernel(keys_ptr, out_ptr, num_blocks, BLOCK_S: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        keys = tl.load(keys_ptr + row * num_blocks + s, mask=s < num_blocks, other=-1)
        best = tl.reduce(keys, 0, tl.standard._elementwise_max)
        tl.store(out_ptr + row, 0x7FFFFFFF - (best & 0x7FFFFFFF))

    return argmax_partial_kernel, argmax_final_kernel


def _launch(logits: torch.Tensor, out: torch.Tensor) -> None:
    global triton_launches
    partial_kernel, final_kernel = _kernel.load()
    rows, vocab = logits.shape
    blocks = -(-vocab // _BLOCK)
    keys = torch.empty(rows, blocks, dtype=torch.int64, device=logits.device)
    partial_kernel[(rows, blocks)](logits, keys, logits.stride(0), vocab, blocks, BLOCK=_BLOCK,
                                   num_warps=8)
    final_kernel[(rows,)](keys, out, blocks, BLOCK_S=max(2, 1 << (blocks - 1).bit_length()),
                          num_warps=1)
    triton_launches += 1


def _check(logits: torch.Tensor, out: torch.Tensor | None) -> None:
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be [B, V] float32/float16/bfloat16, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if not 0 < logits.shape[1] < _LOW:
        raise ValueError(f"the vocabulary must hold 1 to 2^31 - 1 entries, got {logits.shape[1]}")
    if out is not None and (out.dtype != torch.int64 or tuple(out.shape) != logits.shape[:1]
                            or not out.is_contiguous() or out.device != logits.device):
        raise ValueError(f"out must be a contiguous int64 [{logits.shape[0]}] on "
                         f"{logits.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
