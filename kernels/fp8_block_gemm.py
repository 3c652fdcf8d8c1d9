"""Block-scaled FP8 GEMM: DeepSeek-V3 / Qwen3-FP8 style `weight_block_size` [128, 128] layers.

    weight            float8_e4m3fn [N, K]
    weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)]   W[n, k] = weight[n, k] * s[n // bn, k // bk]

Activations are quantized on the fly per token and per group of bk columns (the weight's K
block): x[t, k] ~ q[t, k] * a[t, k // bk], a = max |group| / 448. The GEMM walks K one block at
a time, takes the FP8 dot product of the tile in float32 and multiplies it by the token's group
scale and the weight block's scale before adding it to the accumulator:

    y[t, n] = sum_b a[t, b] * s[n // bn, b] * sum_{k in block b} q[t, k] * weight[n, k]

N and K need not be multiples of the block (ragged edges are masked). The scales may also come
per row, [N, ceil(K / bk)] (`row_scales`: each row its block's scales): a layer that fuses
parts not aligned to bn (q/k/v of a small model) or is sharded by rows keeps them so. The Triton kernel runs on
CUDA tensors (and on CPU in Triton's interpreter under PD_SERVE_TRITON_CPU=1, the tests); the
torch reference `block_linear_ref` (dequantize both and matmul) runs everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import lazy_kernel

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12

triton_launches = 0  # the tests read it to confirm the Triton path ran


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q float8_e4m3fn [T, K], scale float32 [T, ceil(K / group)]), each token's
    group of `group` columns scaled by its own max |x| / 448 (the last group may be short)."""
    num_tokens, k = x.shape
    num_groups = -(-k // group)
    xf = F.pad(x.float(), (0, num_groups * group - k)).view(num_tokens, num_groups, group)
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [T, G]
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(num_tokens, -1)[:, :k].contiguous(), scale


def row_scales(scale_inv: torch.Tensor, n: int, block: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N / bn), Kb] -> per-row scales float32 [N, Kb] (already per row: as is)."""
    if scale_inv.shape[0] == n:
        return scale_inv.float()
    return scale_inv.float().repeat_interleave(block[0], 0)[:n].contiguous()


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight [N, K] of a block-scaled FP8 weight (block or row scales; float32 math)."""
    n, k = weight.shape
    s = row_scales(scale_inv, n, block).repeat_interleave(block[1], 1)[:, :k]
    return (weight.float() * s).to(dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 quantization of a dense weight [N, K] -> (float8_e4m3fn [N, K],
    weight_scale_inv float32 [ceil(N / bn), ceil(K / bk)]): how the checkpoints were made."""
    n, k = weight.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    w = F.pad(weight.detach().float(), (0, gk * bk - k, 0, gn * bn - n)).view(gn, bn, gk, bk)
    scale = (w.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)  # [gn, gk]
    q = (w / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale


def block_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None = None, *,
                     dense: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: x [T, K] quantized per group and dequantized, times the dequantized
    weight (or `dense`, the caller's copy of it in x's dtype), in x's dtype -> [T, N]."""
    q, a = quantize_per_group(x, block[1])
    xq = (q.float().view(q.shape[0], -1)
          * a.repeat_interleave(block[1], 1)[:, :x.shape[1]]).to(x.dtype)
    w = dense if dense is not None else dequantize_blocks(weight, scale_inv, block, x.dtype)
    return F.linear(xq, w, bias)


def block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block: tuple[int, int], bias: torch.Tensor | None = None, *,
                 dense: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for a block-scaled FP8 layer. x [..., K] -> [..., N] in x's dtype.

    The Triton kernel where it runs (and no `dense` copy is kept), else `block_linear_ref`."""
    x2 = x.reshape(-1, x.shape[-1])  # [T, K]
    if dense is None and _kernel.runs_on(x2):
        out = block_gemm(*quantize_per_group(x2, block[1]), weight, scale_inv, block, x.dtype)
        out = out if bias is None else out + bias
    else:
        out = block_linear_ref(x2, weight, scale_inv, block, bias, dense=dense)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def block_gemm(q: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
               scale_inv: torch.Tensor, block: tuple[int, int],
               out_dtype: torch.dtype) -> torch.Tensor:
    """The Triton GEMM: q float8 [T, K] with group scales a_scale [T, ceil(K / bk)], weight
    float8 [N, K] with block scales scale_inv [ceil(N / bn), ceil(K / bk)] (or row scales
    [N, ceil(K / bk)]) -> [T, N]."""
    global triton_launches
    (t, k), n = q.shape, weight.shape[0]
    bk = block[1]
    num_k_blocks = -(-k // bk)
    if weight.shape[1] != k or scale_inv.shape not in ((-(-n // block[0]), num_k_blocks),
                                                       (n, num_k_blocks)):
        raise ValueError(f"block GEMM shapes: x {tuple(q.shape)}, weight {tuple(weight.shape)}, "
                         f"scales {tuple(scale_inv.shape)} for blocks {block}")
    if bk not in (32, 64, 128, 256):
        raise ValueError(f"block {block}: the kernel takes K blocks of 32, 64, 128 or 256")
    kernel = _kernel.load()
    out = torch.empty(t, n, dtype=out_dtype, device=q.device)
    block_m, block_n = (16 if t <= 16 else 64), 128
    grid = (-(-t // block_m), -(-n // block_n))
    a_scale = a_scale.float().contiguous()
    scale_inv = row_scales(scale_inv, n, block).contiguous()  # [N, Kb]
    kernel[grid](q, a_scale, weight, scale_inv, out, t, n, k, q.stride(0), weight.stride(0),
                 a_scale.stride(0), scale_inv.stride(0), out.stride(0),
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
                 UPCAST=not q.is_cuda, num_warps=4, num_stages=3 if q.is_cuda else 1)
    triton_launches += 1
    return out


@lazy_kernel("the block-scaled FP8 GEMM")
def _kernel(triton):
    @triton.jit
    def fp8_block_gemm_kernel(q_ptr, a_ptr, w_ptr, s_ptr, out_ptr, M, N, K, q_stride, w_stride,
                              a_stride, s_stride, out_stride, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              UPCAST: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = kb * BLOCK_K + ks < K
            a = tl.load(q_ptr + rows[:, None] * q_stride + kb * BLOCK_K + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK] fp8
            w = tl.load(w_ptr + cols[None, :] * w_stride + kb * BLOCK_K + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BK, BN] fp8
            if UPCAST:  # the interpreter has no FP8 dot
                part = tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:
                part = tl.dot(a, w)
            a_s = tl.load(a_ptr + rows * a_stride + kb, mask=row_ok, other=0.0)  # [BM]
            w_s = tl.load(s_ptr + cols * s_stride + kb, mask=col_ok, other=0.0)  # [BN]
            acc += part * a_s[:, None] * w_s[None, :]
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return fp8_block_gemm_kernel
