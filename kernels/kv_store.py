"""Write the new tokens' K and V into one layer of the paged KV pool.

A layer's cache is [P, S, H, D], contiguous: slot `page_id * S + offset` is the [H, D] chunk
at flat row `slot`. For token t with slot_mapping[t] >= 0:

    k_cache.view(P * S, H, D)[slot_mapping[t]] = k[t]      (and the same for v)

Rows with a negative slot are skipped: CUDA-graph padding tokens carry -1. Values are cast to
the cache's dtype; an FP8 cache stores k / k_scale and v / v_scale (default 1.0), clamped to the
format's largest finite value first, so out-of-range values saturate instead of turning into
inf or NaN (`quantize_ref` is the rule; the kernel multiplies by the float32 reciprocal, as
the reference does). One program per token writes its K and V rows ([H, D] tiles, head stride
arbitrary, so k and v may be views into the fused qkv output). Offsets are 64-bit: a pool may
pass 2**31 elements.

`rope_store_kv` is the same store with kernels/rope.py's rotation (its arithmetic) in front, in
one launch: it rotates q (in place, or into a given q_out: flashinfer wants q contiguous, and
this spares a copy) and stores the rotated k (k itself is left as it was) and v. Rounding as the
two kernels in turn: the rotation rounds to k's dtype, then the store casts (or scales) that.
Its grid is tokens x (1 + q head blocks): block 0 takes the token's K and V, the others its
query heads, BLOCK_H at a time. With `qk_norm` (Qwen3's per-head RMSNorm of q and k) each head
is normalised before it is rotated, as kernels/norm.py's `rms_norm_ref` rounds it: two launches
of a decode layer fewer (the head's mean square sums its two halves, so it may differ from
`rms_norm`'s in the last bit).

`store_kv` and `rope_store_kv` run the kernels on CUDA tensors, or on CPU tensors when
PD_SERVE_TRITON_CPU=1 (Triton's interpreter; how the tests exercise the kernels); otherwise
`store_kv_ref` (and `rope.apply_rope_ref_`). Triton is imported lazily, so importing this
module never imports it.
"""

from __future__ import annotations

import torch

from kernels import rope as _rope
from kernels._triton import launch_options, lazy_kernel, pdl
from kernels.norm import rms_norm_ref

# Qwen3's per-head norms to apply before RoPE: (q weight [D], k weight [D], eps).
QKNorm = tuple[torch.Tensor, torch.Tensor, float]

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_ROPE_BLOCK_ELEMENTS = 1024  # elements of q per program of rope_store_kv (heads x head_dim)
tl = None  # triton.language, bound when _kernel is first built


# ----------------------------------------------------------------------------- reference

def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_ref(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x / scale in `dtype`: float32 x times float32(1 / scale), clamped to +-max for FP8.
    A plain cast when dtype is not FP8 and scale is 1."""
    if not _is_fp8(dtype) and scale == 1.0:
        return x.to(dtype)
    y = x.float() * (1.0 / scale)
    if _is_fp8(dtype):
        fmax = torch.finfo(dtype).max
        y = y.clamp(-fmax, fmax)
    return y.to(dtype)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Torch reference of `store_kv`: an index_copy_ of the rows with a slot (host sync)."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    store_rows_ref(k, v, k_cache, v_cache, *slotted_rows(slot_mapping), k_scale, v_scale)


def slotted_rows(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the tokens that have a slot, as a [T] mask, or None when all do; their slots, int64):
    what `store_rows_ref` takes, so every layer of one forward can share them (host sync)."""
    valid = slot_mapping >= 0  # [T]
    slots = slot_mapping[valid].long()
    return (None if slots.shape[0] == slot_mapping.shape[0] else valid), slots


def store_rows_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, valid: torch.Tensor | None, slots: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`store_kv_ref` given `slotted_rows(slot_mapping)`."""
    for new, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = quantize_ref(new if valid is None else new[valid], cache.dtype, scale)  # [n, H, D]
        flat = cache.view(-1, *cache.shape[2:])  # [P * S, H, D]
        if cache.element_size() == 1:  # index_copy_ has no fp8 CPU kernel; copy the bits
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slots, rows)


# ----------------------------------------------------------------------------- dispatch

def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store each token's K and V at its slot of one layer's paged cache, in place.

    Parameters
    ----------
    k, v : [T, H, D], same shape, float dtypes, on the caches' device; last dim contiguous,
        token and head strides arbitrary (views into a fused qkv output are fine).
    k_cache, v_cache : [P, S, H, D], contiguous, same shape and dtype (fp8 included).
    slot_mapping : [T] int64 or int32, on the caches' device; slot = page_id * S + offset in
        [0, P * S), or negative to skip the token (checked on CPU only). Slots written must be
        distinct (on the GPU a repeated slot holds one of its rows, unspecified which).
    k_scale, v_scale : the cache holds k / k_scale and v / v_scale (host floats, > 0; FP8
        caches clamp to the format's range). A CUDA graph keeps the values it was captured with.
    """
    _check(k, v, k_cache, v_cache, slot_mapping)
    _check_scales(k_scale, v_scale)
    if not _kernel.runs_on(k_cache):
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if k.shape[0] > 0:
        _launch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rope_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                  v_scale: float = 1.0, q_out: torch.Tensor | None = None,
                  qk_norm: QKNorm | None = None) -> torch.Tensor:
    """RoPE on q and k, then `store_kv` of the rotated k and v; one launch.

    positions, q, k, cos, sin as kernels/rope.py's `apply_rope_ref_` takes them; k, v, the caches,
    slot_mapping and the scales as `store_kv` takes them. k is not modified. q_out: where the
    rotated q goes (q's shape and dtype, last dim contiguous); default q itself, in place.
    qk_norm: (q weight [D], k weight [D], eps): RMSNorm each q and k head before the rotation.
    Returns the rotated q (q_out, or q).
    """
    _rope.check(positions, q, k, cos, sin)
    _check(k, v, k_cache, v_cache, slot_mapping)
    _check_scales(k_scale, v_scale)
    if q_out is None:
        q_out = q
    elif q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.stride(2) != 1:
        raise ValueError(f"q_out must be {q.dtype} {tuple(q.shape)} with a contiguous last dim, "
                         f"got {q_out.dtype} {tuple(q_out.shape)} strides {q_out.stride()}")
    if qk_norm is not None:
        for weight in qk_norm[:2]:
            if weight.shape != (q.shape[2],) or weight.device != q.device:
                raise ValueError(f"qk_norm weights must be [{q.shape[2]}] on {q.device}, got "
                                 f"{tuple(weight.shape)} on {weight.device}")
    if not _rope_kernel.runs_on(k_cache):
        if qk_norm is not None:
            q, k = rms_norm_ref(q, qk_norm[0], qk_norm[2]), rms_norm_ref(k, qk_norm[1], qk_norm[2])
        rotated = k.clone()
        if q_out is not q:
            q_out.copy_(q)
        _rope.apply_rope_ref_(positions, q_out, rotated, cos, sin)
        store_kv_ref(rotated, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return q_out
    if k.shape[0] > 0:
        _launch_rope(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale,
                     v_scale, q_out, qk_norm)
    return q_out


# ----------------------------------------------------------------------------- Triton kernels

@lazy_kernel("CUDA KV stores")
def _kernel(triton):
    """The jitted KV-store kernel."""
    @triton.jit
    def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_token_stride,
                        k_head_stride, v_token_stride, v_head_stride, num_heads, k_inv_scale,
                        v_inv_scale, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        # A negative slot (a padding token) leaves no heads to copy: nothing read or written.
        # (Folded into the head bound: the interpreter rejects a scalar & a tensor mask.)
        live_heads = tl.where(slot >= 0, num_heads, 0)
        mask = (heads < live_heads) & (dims < HEAD_DIM)
        dst = slot * num_heads * HEAD_DIM + heads * HEAD_DIM + dims  # int64
        dtype = k_cache_ptr.dtype.element_ty
        k = tl.load(k_ptr + token * k_token_stride + heads * k_head_stride + dims, mask=mask)
        v = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + dims, mask=mask)
        if QUANT:  # x * (1 / scale) in float32, clamped to the FP8 range (FP8_MAX 0: no clamp)
            k = k.to(tl.float32) * k_inv_scale
            v = v.to(tl.float32) * v_inv_scale
            if FP8_MAX > 0:
                k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)
                v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
        tl.store(k_cache_ptr + dst, k.to(dtype), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(dtype), mask=mask)

    return store_kv_kernel


def _launch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    global triton_launches
    kernel = _kernel.load()
    num_tokens, num_heads, head_dim = k.shape
    block_h = 1 << (num_heads - 1).bit_length()
    block_d = 1 << (head_dim - 1).bit_length()
    num_warps = min(max(block_h * block_d // 256, 1), 8)  # 8+ elements per thread
    fp8 = _is_fp8(k_cache.dtype)
    kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1),
                          v.stride(0), v.stride(1), num_heads, 1.0 / k_scale, 1.0 / v_scale,
                          HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
                          QUANT=fp8 or k_scale != 1.0 or v_scale != 1.0,
                          FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0,
                          num_warps=num_warps)
    triton_launches += 1


@lazy_kernel("CUDA RoPE + KV stores")
def _rope_kernel(triton):
    """The jitted RoPE-then-store kernel."""
    @triton.jit
    def rope_store_kv_kernel(
            pos_ptr, q_ptr, q_out_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
            slot_ptr, q_norm_ptr, k_norm_ptr, q_token_stride, q_head_stride, qo_token_stride,
            qo_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride,
            table_stride, num_q_heads, num_kv_heads, k_inv_scale, v_inv_scale, eps,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
            BLOCK_D: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
            QK_NORM: tl.constexpr, PDL: tl.constexpr):
        # Grid: (tokens, 1 + q head blocks). The two arms of the `if` below share no names:
        # compiled Triton requires a name set in both arms of a runtime `if` to keep one type.
        token = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        dims = tl.arange(0, BLOCK_D)  # within one half
        dim_mask = dims < HALF
        # Position, slot and the cos / sin rows before the PDL wait (kernels/_triton.py): the
        # kernel before (q/k/v's projection, or Qwen3's k norm) writes none of them, and after
        # the wait they were two loads from memory, one behind the other, ahead of the rotation.
        pos = tl.load(pos_ptr + token).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        cos1 = tl.load(cos_ptr + pos * table_stride + dims, mask=dim_mask, other=0.0)[None, :]
        cos2 = tl.load(cos_ptr + pos * table_stride + HALF + dims, mask=dim_mask,
                       other=0.0)[None, :]
        sin1 = tl.load(sin_ptr + pos * table_stride + dims, mask=dim_mask, other=0.0)[None, :]
        sin2 = tl.load(sin_ptr + pos * table_stride + HALF + dims, mask=dim_mask,
                       other=0.0)[None, :]
        if QK_NORM:  # the norms' weight halves, rounded to the activations' dtype
            dtype = q_out_ptr.dtype.element_ty
            q_w1 = tl.load(q_norm_ptr + dims, mask=dim_mask, other=0.0).to(dtype)[None, :]
            q_w2 = tl.load(q_norm_ptr + HALF + dims, mask=dim_mask, other=0.0).to(dtype)[None, :]
            k_w1 = tl.load(k_norm_ptr + dims, mask=dim_mask, other=0.0).to(dtype)[None, :]
            k_w2 = tl.load(k_norm_ptr + HALF + dims, mask=dim_mask, other=0.0).to(dtype)[None, :]
        if PDL:  # see kernels/_triton.py: the kernel before done, then let the next start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if block == 0:  # this token's K (rotated) and V into its slot; none for slot < 0
            kv_heads = tl.arange(0, BLOCK_KV)
            kv_mask = ((kv_heads < tl.where(slot >= 0, num_kv_heads, 0))[:, None]
                       & dim_mask[None, :])
            k_first = (k_ptr + token * k_token_stride + kv_heads[:, None] * k_head_stride
                       + dims[None, :])
            k_x1 = tl.load(k_first, mask=kv_mask, other=0.0)
            k_x2 = tl.load(k_first + HALF, mask=kv_mask, other=0.0)
            if QK_NORM:  # rms_norm_ref per head: the row rounded, then times the weight
                k_f1, k_f2 = k_x1.to(tl.float32), k_x2.to(tl.float32)
                k_inv = tl.math.rsqrt((tl.reduce(k_f1 * k_f1, 1, tl.standard._sum_combine)
                                      + tl.reduce(k_f2 * k_f2, 1, tl.standard._sum_combine))
                                     / (2 * HALF) + eps)[:, None]
                k_x1 = ((k_f1 * k_inv).to(k_x1.dtype).to(tl.float32)
                         * k_w1.to(tl.float32)).to(k_x1.dtype)
                k_x2 = ((k_f2 * k_inv).to(k_x1.dtype).to(tl.float32)
                         * k_w2.to(tl.float32)).to(k_x1.dtype)
            # rotated and rounded to k's dtype, as the reference rounds it before the store
            k1 = (k_x1.to(tl.float32) * cos1 - k_x2.to(tl.float32) * sin1).to(k_x1.dtype)
            k2 = (k_x2.to(tl.float32) * cos2 + k_x1.to(tl.float32) * sin2).to(k_x1.dtype)
            k1 = k1.to(tl.float32)
            k2 = k2.to(tl.float32)
            v_first = (v_ptr + token * v_token_stride + kv_heads[:, None] * v_head_stride
                       + dims[None, :])
            v1 = tl.load(v_first, mask=kv_mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_first + HALF, mask=kv_mask, other=0.0).to(tl.float32)
            if QUANT:  # as store_kv_kernel: x * (1 / scale) in float32, clamped for FP8
                k1 = k1 * k_inv_scale
                k2 = k2 * k_inv_scale
                v1 = v1 * v_inv_scale
                v2 = v2 * v_inv_scale
                if FP8_MAX > 0:
                    k1 = tl.minimum(tl.maximum(k1, -FP8_MAX), FP8_MAX)
                    k2 = tl.minimum(tl.maximum(k2, -FP8_MAX), FP8_MAX)
                    v1 = tl.minimum(tl.maximum(v1, -FP8_MAX), FP8_MAX)
                    v2 = tl.minimum(tl.maximum(v2, -FP8_MAX), FP8_MAX)
            dst = (slot * num_kv_heads + kv_heads[:, None]) * (2 * HALF) + dims[None, :]  # int64
            tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(k_cache_ptr + dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
        else:  # query heads [(block - 1) * BLOCK_H, block * BLOCK_H), rotated into q_out
            q_heads = ((block - 1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
            q_mask = (q_heads < num_q_heads)[:, None] & dim_mask[None, :]
            q_first = (q_ptr + token * q_token_stride + q_heads[:, None] * q_head_stride
                       + dims[None, :])
            q_x1 = tl.load(q_first, mask=q_mask, other=0.0)
            q_x2 = tl.load(q_first + HALF, mask=q_mask, other=0.0)
            if QK_NORM:  # rms_norm_ref per head: the row rounded, then times the weight
                q_f1, q_f2 = q_x1.to(tl.float32), q_x2.to(tl.float32)
                q_inv = tl.math.rsqrt((tl.reduce(q_f1 * q_f1, 1, tl.standard._sum_combine)
                                      + tl.reduce(q_f2 * q_f2, 1, tl.standard._sum_combine))
                                     / (2 * HALF) + eps)[:, None]
                q_x1 = ((q_f1 * q_inv).to(q_x1.dtype).to(tl.float32)
                         * q_w1.to(tl.float32)).to(q_x1.dtype)
                q_x2 = ((q_f2 * q_inv).to(q_x1.dtype).to(tl.float32)
                         * q_w2.to(tl.float32)).to(q_x1.dtype)
            out = (q_out_ptr + token * qo_token_stride + q_heads[:, None] * qo_head_stride
                   + dims[None, :])
            tl.store(out, (q_x1.to(tl.float32) * cos1 - q_x2.to(tl.float32) * sin1)
                     .to(q_x1.dtype), mask=q_mask)
            tl.store(out + HALF, (q_x2.to(tl.float32) * cos2 + q_x1.to(tl.float32) * sin2)
                     .to(q_x1.dtype), mask=q_mask)

    return rope_store_kv_kernel


def _launch_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float,
                 v_scale: float, q_out: torch.Tensor, qk_norm: QKNorm | None) -> None:
    global triton_launches
    kernel = _rope_kernel.load()
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    block_d = 1 << (half - 1).bit_length()
    block_h = min(1 << (num_q_heads - 1).bit_length(),
                  max(1, _ROPE_BLOCK_ELEMENTS // (2 * block_d)))
    fp8 = _is_fp8(k_cache.dtype)
    grid = (num_tokens, 1 + -(-num_q_heads // block_h))
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)  # (unread)
    kernel[grid](positions, q, q_out, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                 q_norm.contiguous(), k_norm.contiguous(), q.stride(0), q.stride(1),
                 q_out.stride(0), q_out.stride(1), k.stride(0), k.stride(1), v.stride(0),
                 v.stride(1), cos.stride(0), num_q_heads, num_kv_heads, 1.0 / k_scale,
                 1.0 / v_scale, eps, HALF=half, BLOCK_H=block_h,
                 BLOCK_KV=1 << (num_kv_heads - 1).bit_length(), BLOCK_D=block_d,
                 QUANT=fp8 or k_scale != 1.0 or v_scale != 1.0,
                 FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0,
                 QK_NORM=qk_norm is not None, num_warps=4, **launch_options(pdl(k_cache)))
    triton_launches += 1


# ----------------------------------------------------------------------------- validation

def _check_scales(k_scale: float, v_scale: float) -> None:
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"k_scale and v_scale must be > 0, got {k_scale} and {v_scale}")


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"caches must be [P, S, H, D] of one shape and dtype, got "
                         f"{k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} "
                         f"{tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    num_pages, page_size, num_heads, head_dim = k_cache.shape
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != (num_heads, head_dim):
        raise ValueError(f"k, v must be [T, {num_heads}, {head_dim}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if not (k.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"k, v must be floating point, got {k.dtype} and {v.dtype}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"k's and v's last dims must be contiguous, got strides {k.stride()} "
                         f"and {v.stride()}")
    devices = {k.device, v.device, k_cache.device, v_cache.device, slot_mapping.device}
    if len(devices) != 1:
        raise ValueError(f"k, v, caches and slot_mapping must share a device, got {devices}")
    if slot_mapping.shape != k.shape[:1] or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}] int64/int32, got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if not slot_mapping.is_cuda and slot_mapping.numel() > 0:
        if slot_mapping.max() >= num_pages * page_size:
            raise ValueError(f"slots must lie below {num_pages * page_size} (P * S)")
        written = slot_mapping[slot_mapping >= 0]
        if torch.unique(written).numel() != written.numel():
            raise ValueError("slots written must be distinct")
