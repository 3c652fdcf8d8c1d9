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

`store_kv` runs the kernel on CUDA tensors, or on CPU tensors when PD_SERVE_TRITON_CPU=1 (Triton's
interpreter; how the tests exercise the kernel); otherwise `store_kv_ref`. Triton is imported
lazily, so importing this module never imports it.
"""

from __future__ import annotations

import torch

from kernels._triton import lazy_kernel

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

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
    valid = slot_mapping >= 0  # [T]
    slots = slot_mapping[valid].long()
    for new, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = quantize_ref(new[valid], cache.dtype, scale)  # [n, H, D]
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
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"k_scale and v_scale must be > 0, got {k_scale} and {v_scale}")
    if not _kernel.runs_on(k_cache):
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if k.shape[0] > 0:
        _launch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# ----------------------------------------------------------------------------- Triton kernel

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


# ----------------------------------------------------------------------------- validation

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
