"""W4A16 GEMM: `x @ W.T` for a GPTQ INT4 weight, dequantized in registers.

The weight stays packed in the GPTQ layout (pd_serve/model/gptq.py): qweight int32
[K / 8, N], qzeros int32 [G, N / 8], scales [G, N], g_idx [K], with K = in_features and
N = out_features. A program owns a [BLOCK_M, BLOCK_N] tile of the output and walks its K
range in BLOCK_K steps; each step loads the x tile, the [BLOCK_K / 8, BLOCK_N] packed words
of the weight tile (each word once, unpacked to its 8 rows in registers), the scales and zero
points of the rows' groups, and feeds `tl.dot`:

    g_idx given       g = g_idx[k] per row: w = ((q - zero[g]) * scale[g]) in x's dtype
    g_idx None        g = k // group_size, computed; when BLOCK_K divides group_size a step
                      lies in one group, and the scale leaves the dot: acc += (x @ (q - zero))
                      * scale[g], the small integers q - zero exact in x's dtype (fast path)

Act-order layers reach the fast path too once `gptq.sort_act_order` has sorted their rows at
load time: `w4a16_matmul` then takes `perm` and gathers x's columns into that order first
(one small index_select; gathering them inside the kernel read x uncoalesced, far slower).

Split-K: when the output has too few tiles to fill the GPU (decode, M of 1-16), the K range
is cut into `split_k` slices whose float32 partials [split_k, M, N] are summed by torch
afterwards. From `DEQUANT_MIN_M` rows up (prefill) the weight is read by more tiles than it
pays to dequantize in each, so the same kernel writes the dense W.T [K, N] in x's dtype once
(a program per tile, the per-row path) and cuBLAS multiplies (vLLM's AWQ layer makes the same
switch). No host syncs either way, so a call can be captured in a CUDA graph. Block sizes are
a fixed choice by M (no autotuning), from timings on an H200.

One row of x (decode at batch 1) on a trivially grouped layer takes a kernel of its own,
`_gemv_kernel`: a program owns BLOCK_N output channels of one K slice and walks it a group-
aligned step at a time, with no tensor cores. A nibble v of a packed word becomes a float
without an int-to-float conversion: masked in place and OR-ed into the mantissa of 2^23
(0x4B000000), it reads as 2^23 + v * 2^s (s its bit offset, 0-16 after one shift for the top
three), so (that - 2^23) * (x * 2^-s) is v * x exactly. Per step, sum_k x_k * q_kn is
accumulated and the group's zero point and scale are applied once per channel:
scale_n * (sum_k x_k q_kn - zero_n * sum_k x_k).

On an H200 under CUDA graphs (bf16 x, group 128, Llama-3.1-8B's layers at batch 1) the one-row
kernel is as fast as a bf16 GEMM of the dequantized weight on q/k/v, 0.89x on o and 1.24x /
1.49x on gate/up / down, yet reads only 0.75-1.45 TB/s of packed weight against bf16's 3.3-4.2:
still far from the memory rate. The tiled kernel runs at 0.55-0.77x at batch 16; the float
trick does not help it (the int-to-float conversion is not what bounds it there), so it
converts plainly. Marlin and exllama unpack two nibbles at a time into half2; neither kernel
here does.

`w4a16_matmul` runs the kernel on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1
(Triton's interpreter; how the tests exercise the kernel); otherwise `w4a16_matmul_ref`.
Triton is imported lazily, so importing this module never imports it.
"""

from __future__ import annotations

import functools

import torch

from kernels._triton import lazy_kernel
from pd_serve.model.gptq import zero_offset, check_layout, dequantize_t

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

DEQUANT_MIN_M = 256  # rows of x from which the weight is dequantized once and cuBLAS runs
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MIN_K_STEPS_PER_SPLIT = 4  # split-K never leaves a slice fewer BLOCK_K steps than this
_DEQUANT_BLOCKS = (64, 128, 4)  # (BLOCK_K, BLOCK_N, num_warps) of the dequantize-only launch
_GEMV_CONFIG = (64, 16, 1)  # (BLOCK_N, packed rows a step, num_warps) of the one-row kernel
_GEMV_PROGRAMS_PER_SM = 8  # split-K of the one-row kernel aims at this many programs an SM
tl = None  # triton.language, bound when _kernel is first built


# ----------------------------------------------------------------------------- reference

def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor | None,
                     scales: torch.Tensor, g_idx: torch.Tensor | None = None, *,
                     perm: torch.Tensor | None = None,
                     checkpoint_format: str = "gptq") -> torch.Tensor:
    """Torch reference of `w4a16_matmul`: x[..., perm] @ dequantize(...).T in float32, cast
    to x's dtype."""
    _check(x, qweight, qzeros, scales, g_idx, perm)
    w = dequantize_t(qweight, qzeros, scales, g_idx, checkpoint_format=checkpoint_format)
    xf = x.float() if perm is None else x.float()[..., perm.long()]
    return (xf @ w).to(x.dtype)  # [..., N]


# ----------------------------------------------------------------------------- dispatch

def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor | None,
                 scales: torch.Tensor, g_idx: torch.Tensor | None = None, *,
                 perm: torch.Tensor | None = None, checkpoint_format: str = "gptq",
                 split_k: int | None = None) -> torch.Tensor:
    """`x @ W.T` for the GPTQ weight W, dequantizing it tile by tile in registers.

    Parameters
    ----------
    x : [..., K] float16 / bfloat16 (float32 too; the dot then runs in IEEE float32). Any
        strides on a 2-D x; leading dims are flattened.
    qweight : int32 [K / 8, N], GPTQ-packed along K.
    qzeros : int32 [G, N / 8], or None for a symmetric checkpoint (zero 8).
    scales : [G, N], float16 (any float dtype; read as float32).
    g_idx : int32 / int64 [K], the group of each weight row (act-order checkpoints permute
        it), or None for the trivial grouping k // (K / G): the fast path, which load-time
        code should choose by dropping a trivial g_idx (or sorting with `sort_act_order`).
    perm : optional int32 / int64 [K]: weight row j multiplies x[..., perm[j]] (a layer
        sorted by `gptq.sort_act_order`).
    checkpoint_format : "gptq" (stored zeros are zero - 1, AutoGPTQ's v1) or "gptq_v2".
    split_k : K slices of the in-register path; default a choice from the tile count and the
        GPU's SM count.

    Returns
    -------
    [..., N] in x's dtype, a new contiguous tensor.
    """
    offset = zero_offset(checkpoint_format)
    in_features, out_features, num_groups = _check(x, qweight, qzeros, scales, g_idx, perm)
    if not _kernel.runs_on(x):
        return w4a16_matmul_ref(x, qweight, qzeros, scales, g_idx, perm=perm,
                                checkpoint_format=checkpoint_format)
    x2 = x.reshape(-1, in_features)  # [M, K]
    if perm is not None:
        x2 = x2.index_select(1, perm)  # [M, K]: coalesced reads for the kernel
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.reshape(*x.shape[:-1], out_features)
    group_size = in_features // num_groups if g_idx is None else 0
    layer = (qweight, qzeros, scales, g_idx, group_size, offset)
    gemv_rows = _gemv_block_rows(in_features, num_groups, group_size)
    if (x2.shape[0] == 1 and gemv_rows and qweight.stride(1) == 1 and scales.stride(1) == 1
            and (qzeros is None or qzeros.stride(1) == 1)):
        _launch_gemv(x2, qweight, qzeros, scales, in_features // num_groups, offset, out,
                     gemv_rows, split_k=split_k)
    elif x2.shape[0] >= DEQUANT_MIN_M:
        w = torch.empty(in_features, out_features, dtype=x.dtype, device=x.device)  # [K, N]
        _launch(x2, *layer, w, dequant_only=True)
        torch.mm(x2, w, out=out)
    else:
        _launch(x2, *layer, out, split_k=split_k)
    return out.reshape(*x.shape[:-1], out_features)


# ----------------------------------------------------------------------------- config

def _block_config(m: int, group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows of x.

    Small M (decode) is bound by reading the weight: narrow M tiles, long K steps. BLOCK_K
    is shrunk to divide a trivial group size when it can (16 at least, tl.dot's minimum), so
    the fast path applies.
    """
    if m <= 16:
        config = [16, 32, 128, 4, 3]
    elif m <= 32:
        config = [32, 64, 128, 4, 4]
    else:
        config = [64, 64, 64, 4, 4]
    fits = group_size & -group_size  # the largest power of 2 dividing group_size (0 if none)
    if fits >= 16:
        config[2] = min(config[2], fits)
    return tuple(config)


def _gemv_block_rows(in_features: int, num_groups: int, group_size: int) -> int:
    """Packed rows (of 8 weight rows) per step of the one-row kernel, so that a step lies in
    one group: _GEMV_CONFIG's, halved until 8 x it divides the group size; 0 when the layer
    has no trivial grouping (g_idx) or a group size that is not a multiple of 8."""
    if not group_size:
        return 0
    rows = _GEMV_CONFIG[1]
    if num_groups == 1:
        return rows
    while rows and group_size % (8 * rows):
        rows //= 2
    return rows


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_split_k(num_tiles: int, k_steps: int, device: torch.device) -> int:
    """Enough K slices to give every SM a tile, each slice a few BLOCK_K steps long."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    wanted = -(-sms // num_tiles)
    return max(1, min(wanted, k_steps // _MIN_K_STEPS_PER_SPLIT))


# ----------------------------------------------------------------------------- Triton kernel

@lazy_kernel("the CUDA W4A16 GEMM")
def _kernel(triton):
    """The jitted W4A16 kernel."""
    @triton.jit
    def w4a16_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, out_ptr, M, N, K,
                     k_per_split, group_size, stride_xm, stride_xk, stride_qwk, stride_qwn,
                     stride_qzg, stride_qzn, stride_sg, stride_sn, stride_os, stride_om,
                     stride_on, ZERO_OFFSET: tl.constexpr, HAS_ZEROS: tl.constexpr,
                     HAS_G_IDX: tl.constexpr, GROUP_PER_STEP: tl.constexpr, DEQUANT_ONLY: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STEPS_PER_SPLIT: tl.constexpr, GROUP_M: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
        # Program (tile, split): output tile `tile` (grouped GROUP_M tiles down M, so the
        # programs running together share weight tiles in L2), K slice `split`. With
        # DEQUANT_ONLY a slice is one BLOCK_K step, and the program writes its dequantized
        # [BLOCK_K, BLOCK_N] tile of W.T to out.
        tile = tl.program_id(0)
        split = tl.program_id(1)
        # No tl.cdiv / tl.zeros: they are @jit helpers, and Triton 3.6's interpreter leaves
        # them patched, which breaks later compiles in the same process (the tests' order).
        tiles_m = (M + BLOCK_M - 1) // BLOCK_M
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        band = tile // (GROUP_M * tiles_n)
        band_m = tl.minimum(tiles_m - band * GROUP_M, GROUP_M)
        pid_m = band * GROUP_M + (tile % (GROUP_M * tiles_n)) % band_m
        pid_n = (tile % (GROUP_M * tiles_n)) // band_m

        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        mask_m = offs_m < M
        mask_n = offs_n < N
        zero_shift = (offs_n % 8) * 4  # [BN], the nibble of column n in its qzeros word
        shifts = tl.arange(0, 8) * 4  # [8], nibble j of a qweight word
        dtype = x_ptr.dtype.element_ty
        k_start = split * k_per_split
        k_end = tl.minimum(K, k_start + k_per_split)  # a multiple of 8, as K and BLOCK_K are

        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for step in range(STEPS_PER_SPLIT):  # a fixed trip count; the tail is masked
            k0 = k_start + step * BLOCK_K
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
            mask_k = offs_k < k_end
            mask_kn = mask_k[:, None] & mask_n[None, :]
            # Each packed word once: [BK / 8, BN] words -> [BK / 8, 8, BN] -> [BK, BN].
            rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK / 8]
            packed = tl.load(qw_ptr + rows[:, None] * stride_qwk + offs_n[None, :] * stride_qwn,
                             mask=(rows < k_end // 8)[:, None] & mask_n[None, :], other=0)
            q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF,
                           (BLOCK_K, BLOCK_N))  # [BK, BN] int32
            if GROUP_PER_STEP:
                # The whole step is in group k0 // group_size: one scale row, factored out.
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
                # (A masked tail step past K reads the last group; its x is all zeros.)
                g = tl.minimum(k0, K - 1) // group_size
                scale = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n,
                                other=0.0).to(tl.float32)  # [BN]
                if HAS_ZEROS:
                    zword = tl.load(qz_ptr + g * stride_qzg + (offs_n // 8) * stride_qzn,
                                    mask=mask_n, other=0)
                    zero = ((zword >> zero_shift) & 0xF) + ZERO_OFFSET  # [BN]
                    w = (q - zero[None, :]).to(dtype)
                else:
                    w = (q - 8).to(dtype)
                acc += tl.dot(x, w, input_precision=DOT_PRECISION) * scale[None, :]
            else:
                if HAS_G_IDX:
                    g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)  # [BK]
                else:
                    g = offs_k // group_size
                scale = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                                mask=mask_kn, other=0.0).to(tl.float32)  # [BK, BN]
                if HAS_ZEROS:
                    zword = tl.load(qz_ptr + g[:, None] * stride_qzg
                                    + (offs_n // 8)[None, :] * stride_qzn, mask=mask_kn,
                                    other=0)
                    zero = ((zword >> zero_shift[None, :]) & 0xF) + ZERO_OFFSET  # [BK, BN]
                else:
                    zero = 8
                w = ((q - zero).to(tl.float32) * scale).to(dtype)
                if DEQUANT_ONLY:
                    tl.store(out_ptr + offs_k[:, None] * stride_om
                             + offs_n[None, :] * stride_on, w, mask=mask_kn)
                else:
                    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
                                * stride_xk, mask=mask_m[:, None] & mask_k[None, :],
                                other=0.0)  # [BM, BK]
                    acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)

        if not DEQUANT_ONLY:
            tl.store(out_ptr + split * stride_os + offs_m[:, None] * stride_om
                     + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & mask_n[None, :])

    return w4a16_kernel


def _launch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor | None,
            scales: torch.Tensor, g_idx: torch.Tensor | None, group_size: int, zero_offset: int, out: torch.Tensor, *, split_k: int | None = None,
            dequant_only: bool = False) -> None:
    """out [M, N] = x [M, K] @ W.T, or with dequant_only out [K, N] = W.T in x's dtype.
    group_size is the trivial grouping's (g_idx None) or 0."""
    global triton_launches
    kernel = _kernel.load()
    (m, k), n = x.shape, out.shape[1]
    if dequant_only:
        block_k, block_n, num_warps = _DEQUANT_BLOCKS
        block_m, num_stages, m = 16, 1, 1  # one tile down M; x is not read
        split_k, k_per_split = -(-k // block_k), block_k
    else:
        block_m, block_n, block_k, num_warps, num_stages = _block_config(m, group_size)
        k_steps = -(-k // block_k)
        if split_k is None:
            split_k = _choose_split_k(-(-m // block_m) * -(-n // block_n), k_steps, x.device)
        k_per_split = -(-k_steps // max(1, min(split_k, k_steps))) * block_k
        split_k = -(-k // k_per_split)  # no empty slices
    # Partial sums of several K slices are kept in float32 and summed below.
    partial = split_k > 1 and not dequant_only
    dest = out if not partial else torch.empty(split_k, m, n, dtype=torch.float32,
                                               device=x.device)  # [S, M, N]
    zeros = qzeros if qzeros is not None else qweight  # a placeholder pointer when unused
    kernel[(-(-m // block_m) * -(-n // block_n), split_k)](
        x, qweight, zeros, scales, g_idx if g_idx is not None else qweight, dest, m, n, k,
        k_per_split, max(group_size, 1),
        *x.stride(), *qweight.stride(), *(zeros.stride() if qzeros is not None else (0, 0)),
        *scales.stride(), *(dest.stride() if partial else (0, *dest.stride())),
        ZERO_OFFSET=zero_offset, HAS_ZEROS=qzeros is not None, HAS_G_IDX=g_idx is not None,
        GROUP_PER_STEP=not dequant_only and g_idx is None and group_size % block_k == 0,
        DEQUANT_ONLY=dequant_only, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        STEPS_PER_SPLIT=k_per_split // block_k, GROUP_M=8,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    triton_launches += 1
    if partial:
        out.copy_(dest.sum(0))


@lazy_kernel("the CUDA W4A16 GEMV")
def _gemv_kernel(triton):
    """The jitted one-row W4A16 kernel."""
    @triton.jit
    def w4a16_gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, k_per_split, group_size,
                          stride_x, stride_qwk, stride_qzg, stride_sg, stride_os,
                          ZERO_OFFSET: tl.constexpr, HAS_ZEROS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
                          STEPS_PER_SPLIT: tl.constexpr):
        # Program (column block, split): BLOCK_N output channels over K slice `split`, a step
        # being BLOCK_KP packed rows (8 x BLOCK_KP weight rows, all in one group).
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        mask_n = offs_n < N
        k_start = tl.program_id(1) * k_per_split
        k_end = tl.minimum(K, k_start + k_per_split)
        zero_shift = (offs_n % 8) * 4  # [BN], the nibble of column n in its qzeros word
        y = tl.full((BLOCK_N,), 0.0, tl.float32)
        for step in range(STEPS_PER_SPLIT):  # a fixed trip count; the tail is masked
            k0 = k_start + step * BLOCK_KP * 8
            rows = k0 // 8 + tl.arange(0, BLOCK_KP)  # [KP] packed rows
            row_ok = rows < k_end // 8
            packed = tl.load(qw_ptr + rows[:, None] * stride_qwk + offs_n[None, :],
                             mask=row_ok[:, None] & mask_n[None, :], other=0)  # [KP, BN]
            high = packed >> 12  # nibbles 5-7 at bits 8-19
            acc = tl.full((BLOCK_KP, BLOCK_N), 0.0, tl.float32)
            x_sum = tl.full((BLOCK_KP,), 0.0, tl.float32)
            for j in tl.static_range(8):  # weight row 8 * row + j is nibble j of the word
                xj = tl.load(x_ptr + (rows * 8 + j) * stride_x, mask=row_ok,
                             other=0.0).to(tl.float32)  # [KP]
                x_sum += xj
                # Nibble v in the low mantissa bits of 2^23 (bits 0x4B000000) under a shift s:
                # the float is 2^23 + v * 2^s exactly, and minus 2^23, times x * 2^-s, is v * x.
                # No int-to-float conversion (Hopper runs those at a fraction of the FMA rate).
                if j < 5:  # (j is a compile-time constant)
                    bits = (packed & (15 << (4 * j))) | 0x4B000000
                    xs = xj * (1.0 / (1 << (4 * j)))
                else:
                    bits = (high & (15 << (4 * j - 12))) | 0x4B000000
                    xs = xj * (1.0 / (1 << (4 * j - 12)))
                acc += (bits.to(tl.float32, bitcast=True) - 8388608.0) * xs[:, None]
            # sum_k x_k * (q_kn - zero_n) * scale_n over the step's rows, with q - zero split
            dot = tl.reduce(acc, 0, tl.standard._sum_combine)  # [BN]
            x_total = tl.reduce(x_sum, 0, tl.standard._sum_combine)
            g = tl.minimum(k0, K - 1) // group_size
            scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n,
                            other=0.0).to(tl.float32)  # [BN]
            if HAS_ZEROS:
                zword = tl.load(qz_ptr + g * stride_qzg + offs_n // 8, mask=mask_n, other=0)
                zero = (((zword >> zero_shift) & 0xF) + ZERO_OFFSET).to(tl.float32)
            else:
                zero = tl.full((BLOCK_N,), 8.0, tl.float32)
            y += scale * (dot - zero * x_total)
        tl.store(out_ptr + tl.program_id(1) * stride_os + offs_n, y, mask=mask_n)

    return w4a16_gemv_kernel


def _launch_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor | None,
                 scales: torch.Tensor, group_size: int, zero_offset: int, out: torch.Tensor,
                 block_rows: int, *, split_k: int | None = None) -> None:
    """out [1, N] = x [1, K] @ W.T for a trivially grouped layer (g_idx None), whose groups
    hold whole steps of block_rows packed rows; qweight and scales contiguous along N."""
    global triton_launches
    kernel = _gemv_kernel.load()
    k, n = x.shape[1], out.shape[1]
    block_n, _, num_warps = _GEMV_CONFIG
    block_k = 8 * block_rows
    k_steps = -(-k // block_k)
    if split_k is None:
        split_k = 1
        if x.is_cuda:
            sms = _num_sms(x.device.index if x.device.index is not None
                           else torch.cuda.current_device())
            wanted = -(-_GEMV_PROGRAMS_PER_SM * sms // -(-n // block_n))
            split_k = max(1, min(wanted, k_steps // _MIN_K_STEPS_PER_SPLIT))
    k_per_split = -(-k_steps // max(1, min(split_k, k_steps))) * block_k
    split_k = -(-k // k_per_split)  # no empty slices
    partial = torch.empty(split_k, n, dtype=torch.float32, device=x.device)  # [S, N]
    zeros = qzeros if qzeros is not None else qweight  # a placeholder pointer when unused
    kernel[(-(-n // block_n), split_k)](
        x, qweight, zeros, scales, partial, n, k, k_per_split, group_size,
        x.stride(1), qweight.stride(0), zeros.stride(0) if qzeros is not None else 0,
        scales.stride(0), partial.stride(0), ZERO_OFFSET=zero_offset,
        HAS_ZEROS=qzeros is not None, BLOCK_N=block_n, BLOCK_KP=block_rows,
        STEPS_PER_SPLIT=k_per_split // block_k, num_warps=num_warps)
    triton_launches += 1
    out.copy_(partial.sum(0, keepdim=True))


# ----------------------------------------------------------------------------- validation

def _check(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor | None,
           scales: torch.Tensor, g_idx: torch.Tensor | None,
           perm: torch.Tensor | None) -> tuple[int, int, int]:
    in_features, out_features, num_groups = check_layout(qweight, qzeros, scales, g_idx)
    if x.dim() == 0 or x.shape[-1] != in_features or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [..., {in_features}] float16/bfloat16/float32, got "
                         f"{x.dtype} {tuple(x.shape)}")
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device}, the weight on {qweight.device}")
    if perm is not None and (perm.shape != (in_features,) or perm.is_floating_point()
                             or perm.device != qweight.device):
        raise ValueError(f"perm must be int [{in_features}] on {qweight.device}, got "
                         f"{perm.dtype} {tuple(perm.shape)} on {perm.device}")
    return in_features, out_features, num_groups
