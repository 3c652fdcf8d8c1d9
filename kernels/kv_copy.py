"""Copy whole KV pages between pools and contiguous staging tensors (the transfer path).

A pool `buffer` is [L, 2 (K, V), P, S, H, D], contiguous (or [L, 1, ...]: a latent pool, one
plane per layer; every "2" below is then 1). For pages `page_ids` (n of them) and layers
[a, b), the staging tensor is [b - a, 2, n, S, H, D], contiguous:

    gather:  staging[l, kv, i] = buffer[a + l, kv, page_ids[i]]
    scatter: buffer[a + l, kv, page_ids[i]] = staging[l, kv, i]
    copy:    dst[a + l, kv, dst_ids[i]] = src[a + l, kv, src_ids[i]]   (pool to pool, one pass)

One page of one layer's K (or V) is a contiguous chunk of S*H*D elements in every tensor, so
one Triton kernel serves all three as a flat copy: program (row, block) copies `block` of chunk
`row`, where a row is (layer, kv, i) in staging order and each side either looks its page up in
its id list or is a staging tensor (page i). One launch covers every layer, K and V, and page.

Head ranges (`heads=(h0, h1)`; a tensor-parallel hand-off moves part of a rank's KV heads):
staging then holds heads [h0, h1) only ([b - a, 2, n, S, h1 - h0, D]), and `copy_pages` may
take heads [h0, h1) of src into [g0, g0 + h1 - h0) of dst, pools of different head counts. A
row is then S runs of (h1 - h0) * D elements, one per token, strided on each side; the same
kernel copies it (each element finds its token's run), so this too is one launch.
`copy_pages` runs on the destination's device and may read a source pool that lives on a peer
GPU (mapped over CUDA IPC, or peer access enabled): gather, peer copy and scatter in one pass.
Offsets are 64-bit (a pool can pass 2**31 elements), and all tensors are viewed as a same-size
integer dtype, so the copy is bit-exact for any dtype (fp8 included).

The functions run the kernel when the destination is on CUDA, or on CPU tensors when
PD_SERVE_TRITON_CPU=1 (Triton's interpreter; how the tests exercise the kernel); otherwise they
run the torch references (`*_ref`). Triton is imported lazily, so importing this module never
imports it.
"""

from __future__ import annotations

import contextlib

import torch

from kernels._triton import lazy_kernel

# Kernel launches so far; the tests read it to confirm the Triton path really ran.
triton_launches = 0

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # itemsize -> dtype
_MAX_BLOCK = 8192  # elements per program; a 16 KiB page row is one program of 8 warps
tl = None  # triton.language, bound when _kernel is first built


# ----------------------------------------------------------------------------- references

def gather_pages_ref(buffer: torch.Tensor, page_ids: torch.Tensor, layer_start: int,
                     layer_end: int, heads: tuple[int, int] | None = None) -> torch.Tensor:
    """Torch reference: `buffer[layer_start:layer_end, ..., h0:h1, :].index_select(2, page_ids)`.

    Copies through integer views, so it is bit-exact and works for fp8 on CPU too. Returns a
    new contiguous [layer_end - layer_start, 2, n, S, h1 - h0, D] tensor (every head: None).
    """
    _check_pool(buffer, page_ids, layer_start, layer_end)
    return _as_int(_heads_view(buffer[layer_start:layer_end], heads)).index_select(
        2, page_ids).view(buffer.dtype)


def scatter_pages_ref(buffer: torch.Tensor, page_ids: torch.Tensor, staging: torch.Tensor,
                      layer_start: int, layer_end: int, heads: tuple[int, int] | None = None) -> None:
    """Torch reference: `buffer[layer_start:layer_end, :, page_ids, :, h0:h1] = staging`."""
    _check_pool(buffer, page_ids, layer_start, layer_end, unique=True)
    _check_staging(staging, buffer, page_ids, layer_start, layer_end, "staging", heads)
    _as_int(_heads_view(buffer[layer_start:layer_end], heads)).index_copy_(
        2, page_ids.long(), _as_int(staging))


def copy_pages_ref(src: torch.Tensor, src_page_ids: torch.Tensor, dst: torch.Tensor,
                   dst_page_ids: torch.Tensor, layer_start: int, layer_end: int,
                   src_heads: tuple[int, int] | None = None,
                   dst_heads: tuple[int, int] | None = None) -> None:
    """Torch reference of `copy_pages`: a gather on src's device, a copy, a scatter on dst's."""
    _check_copy(src, src_page_ids, dst, dst_page_ids, layer_start, layer_end, src_heads, dst_heads)
    staging = gather_pages_ref(src, src_page_ids.to(src.device), layer_start, layer_end, src_heads)
    scatter_pages_ref(dst, dst_page_ids, staging.to(dst.device), layer_start, layer_end, dst_heads)


def _heads_view(t: torch.Tensor, heads: tuple[int, int] | None) -> torch.Tensor:
    """[.., S, H, D] -> heads [h0, h1) (a strided view); None: t."""
    return t if heads is None else t[:, :, :, :, heads[0]:heads[1]]


# ----------------------------------------------------------------------------- dispatch

def gather_pages(buffer: torch.Tensor, page_ids: torch.Tensor, layer_start: int, layer_end: int,
                 out: torch.Tensor | None = None, heads: tuple[int, int] | None = None) -> torch.Tensor:
    """Copy pages `page_ids` of layers [layer_start, layer_end) out of the pool.

    Parameters
    ----------
    buffer : [L, 2, P, S, H, D], contiguous, any dtype.
    page_ids : [n] int64 or int32, on buffer's device; ids in [0, P) (checked on CPU only).
    out : optional [layer_end - layer_start, 2, n, S, h, D] contiguous tensor to fill.
    heads : (h0, h1): only KV heads [h0, h1) (h = h1 - h0); None: all H.

    Returns
    -------
    The staging tensor (`out` when given).
    """
    _check_pool(buffer, page_ids, layer_start, layer_end)
    if out is None:
        out = buffer.new_empty(_staging_shape(buffer, page_ids, layer_start, layer_end, heads))
    else:
        _check_staging(out, buffer, page_ids, layer_start, layer_end, "out", heads)
    if _kernel.runs_on(buffer):
        _launch(buffer[layer_start:layer_end], page_ids, out, None, page_ids.numel(), src_heads=heads)
    else:
        torch.index_select(_as_int(_heads_view(buffer[layer_start:layer_end], heads)), 2, page_ids,
                           out=_as_int(out))
    return out


def scatter_pages(buffer: torch.Tensor, page_ids: torch.Tensor, staging: torch.Tensor,
                  layer_start: int, layer_end: int, heads: tuple[int, int] | None = None) -> None:
    """Write `staging` into pages `page_ids` of layers [layer_start, layer_end) (KV heads
    [h0, h1) of them, the others untouched; None: all), in place.

    Shapes as in `gather_pages`. Page ids must be distinct (checked on CPU only; on the GPU a
    repeated id leaves that page holding one of its staging copies, unspecified which).
    """
    if not _kernel.runs_on(buffer):
        scatter_pages_ref(buffer, page_ids, staging, layer_start, layer_end, heads)
        return
    _check_pool(buffer, page_ids, layer_start, layer_end, unique=True)
    _check_staging(staging, buffer, page_ids, layer_start, layer_end, "staging", heads)
    _launch(staging, None, buffer[layer_start:layer_end], page_ids, page_ids.numel(), dst_heads=heads)


def copy_pages(src: torch.Tensor, src_page_ids: torch.Tensor, dst: torch.Tensor,
               dst_page_ids: torch.Tensor, layer_start: int, layer_end: int,
               src_heads: tuple[int, int] | None = None,
               dst_heads: tuple[int, int] | None = None) -> None:
    """Copy pages `src_page_ids` of pool `src` into pages `dst_page_ids` of pool `dst`, layers
    [layer_start, layer_end), in one pass with no staging tensor.

    Parameters
    ----------
    src, dst : [L, 2, P_src, S, H_src, D] and [L, 2, P_dst, S, H_dst, D], contiguous, same
        dtype. The kernel runs on dst's device (the current stream there); src may be memory of
        a peer GPU that dst's device can read (IPC-mapped into it, or peer access enabled).
    src_page_ids, dst_page_ids : [n] int64 or int32, both on dst's device; dst ids distinct
        (checked on CPU only).
    src_heads, dst_heads : KV heads [h0, h1) of each side (None: all), as many on both.
    """
    _check_copy(src, src_page_ids, dst, dst_page_ids, layer_start, layer_end, src_heads, dst_heads)
    if not _kernel.runs_on(dst):
        copy_pages_ref(src, src_page_ids, dst, dst_page_ids, layer_start, layer_end, src_heads,
                       dst_heads)
        return
    _launch(src[layer_start:layer_end], src_page_ids, dst[layer_start:layer_end], dst_page_ids,
            src_page_ids.numel(), src_heads, dst_heads)


def copy_pages_counted(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, layer_start: int,
                       layer_end: int, src_heads: tuple[int, int] | None = None,
                       dst_heads: tuple[int, int] | None = None, programs: int = 0) -> None:
    """`copy_pages` with the page ids and their count in one int32 tensor on dst's device:
    [n, src ids (n), dst ids (n), anything]. The launch does not depend on n, so a CUDA graph
    can hold it and be replayed for any n up to (len(ids) - 1) // 2 (`CopyGraph`). `programs`
    stride over the rows (default: 8 per SM of dst's GPU). The ids are not checked.
    """
    _check_pool(src, None, layer_start, layer_end)
    _check_pool(dst, None, layer_start, layer_end)
    _check_pools(src, dst, layer_start, layer_end, src_heads, dst_heads)
    if ids.dim() != 1 or ids.dtype != torch.int32 or ids.device != dst.device or not len(ids):
        raise ValueError(f"ids must be a non-empty 1-D int32 tensor on {dst.device}, got "
                         f"{ids.dtype} of shape {tuple(ids.shape)} on {ids.device}")
    if not _kernel.runs_on(dst):
        n = int(ids[0])
        copy_pages_ref(src, ids[1:1 + n].long(), dst, ids[1 + n:1 + 2 * n].long(), layer_start,
                       layer_end, src_heads, dst_heads)
        return
    if not programs:  # 8 a streaming multiprocessor (4 in the interpreter)
        programs = (8 * torch.cuda.get_device_properties(dst.device).multi_processor_count
                    if dst.is_cuda else 4)
    _launch(src[layer_start:layer_end], ids, dst[layer_start:layer_end], ids, 0, src_heads,
            dst_heads, programs)


class CopyGraph:
    """`copy_pages_counted` between two pools for fixed layers and heads, held in a CUDA graph.

    A copy is then one host-to-device copy of the ids into the graph's buffer and one graph
    launch, both on the current stream (so copies queued on one stream run in order): on the
    H200 host a Triton launch costs 52-77 us of host time, a replay a fraction of it.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, layer_start: int, layer_end: int,
                 src_heads: tuple[int, int] | None = None,
                 dst_heads: tuple[int, int] | None = None):
        self.capacity = dst.shape[2]  # destination ids are distinct: no copy moves more pages
        self.ids = torch.zeros(1 + 2 * self.capacity, dtype=torch.int32, device=dst.device)

        def copy():
            copy_pages_counted(src, dst, self.ids, layer_start, layer_end, src_heads, dst_heads)

        with torch.cuda.device(dst.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy()  # compiles the kernel outside the capture (n = 0: moves nothing)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: other threads of the process (an engine) may use CUDA meanwhile.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                copy()

    def __call__(self, host_ids: torch.Tensor) -> None:
        """Copy the pages `host_ids` names, [n, src ids (n), dst ids (n)] int32 in page-locked
        memory, which must stay unchanged until the current stream has read it."""
        if host_ids.numel() > self.ids.numel():
            raise ValueError(f"{(host_ids.numel() - 1) // 2} pages in one copy; the destination "
                             f"pool has {self.capacity}")
        self.ids[:host_ids.numel()].copy_(host_ids, non_blocking=True)
        self.graph.replay()


# ----------------------------------------------------------------------------- Triton kernel

@lazy_kernel("CUDA KV page copies")
def _kernel(triton):
    """The jitted copy kernel."""
    @triton.jit
    def copy_pages_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, src_pages, dst_pages,
                          num_ids, num_groups, chunk, src_row_len, dst_row_len, src_tok, dst_tok,
                          src_off, dst_off, BLOCK: tl.constexpr, SEG: tl.constexpr,
                          SRC_IDS: tl.constexpr, DST_IDS: tl.constexpr, COUNTED: tl.constexpr):
        # Both pointers start at layer a. Row = ((layer - a) * 2 + kv) * n + i; a side with
        # ids reads page ids[i] of its `pages`, a staging side is page i of n. A row's `chunk`
        # elements are runs of SEG (one per token), `tok` apart on each side, from `off` (the
        # first head's) on: whole pages are one run of the whole row. Programs stride over the
        # rows. COUNTED: src_ids_ptr holds [n, src ids (n), dst ids (n)], so the launch does not
        # depend on n and a CUDA graph can replay it; otherwise n = num_ids, one row a program.
        if COUNTED:
            n = tl.load(src_ids_ptr).to(tl.int64)
            src_ids = src_ids_ptr + 1
            dst_ids = src_ids_ptr + 1 + n
        else:
            n = num_ids
            src_ids = src_ids_ptr
            dst_ids = dst_ids_ptr
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < chunk
        tok = cols // SEG
        col = cols - tok * SEG
        for row in range(tl.program_id(0).to(tl.int64), num_groups * n, tl.num_programs(0)):
            group = row // n
            i = row % n
            if SRC_IDS:
                src_row = group * src_pages + tl.load(src_ids + i).to(tl.int64)
            else:
                src_row = row
            if DST_IDS:
                dst_row = group * dst_pages + tl.load(dst_ids + i).to(tl.int64)
            else:
                dst_row = row
            vals = tl.load(src_ptr + src_row * src_row_len + tok * src_tok + src_off + col,
                           mask=mask)
            tl.store(dst_ptr + dst_row * dst_row_len + tok * dst_tok + dst_off + col, vals,
                     mask=mask)

    return copy_pages_kernel


def _launch(src: torch.Tensor, src_ids: torch.Tensor | None, dst: torch.Tensor,
            dst_ids: torch.Tensor | None, num_ids: int, src_heads: tuple[int, int] | None = None,
            dst_heads: tuple[int, int] | None = None, programs: int = 0) -> None:
    """Copy on dst's device. src and dst start at the first layer copied; a side without ids
    is a staging tensor (all its heads). programs > 0: src_ids is [n, src ids, dst ids] and
    that many programs stride over the rows (the counted form; num_ids unused)."""
    global triton_launches
    num_groups = dst.shape[0] * dst.shape[1]  # (layer, kv) pairs
    page_size, head_dim = dst.shape[3], dst.shape[5]
    src_h0, src_h1 = src_heads or (0, src.shape[4])
    dst_h0 = (dst_heads or (0, dst.shape[4]))[0]
    seg = (src_h1 - src_h0) * head_dim  # elements per token copied
    chunk = page_size * seg
    if (num_ids == 0 and not programs) or chunk == 0:
        return
    whole = src.shape[4] == dst.shape[4] == src_h1 - src_h0
    kernel = _kernel.load()
    ids = src_ids if src_ids is not None else dst_ids
    block = min(_MAX_BLOCK, 1 << (chunk - 1).bit_length())
    grid = (programs or num_groups * num_ids, -(-chunk // block))
    # 8 warps for a 16 KiB row: 64 MiB of pages pulled over NVLink between two H200s run at
    # 284 GB/s, against 233 GB/s with 4096-element blocks of 4 warps.
    num_warps = 8 if block >= 8192 else 4
    elsewhere = dst.is_cuda and dst.device.index != torch.cuda.current_device()
    with torch.cuda.device(dst.device) if elsewhere else contextlib.nullcontext():
        kernel[grid](_as_int(src), _as_int(dst), ids if src_ids is None else src_ids,
                     ids if dst_ids is None else dst_ids, src.shape[2], dst.shape[2], num_ids,
                     num_groups, chunk, page_size * src.shape[4] * head_dim,
                     page_size * dst.shape[4] * head_dim, src.shape[4] * head_dim,
                     dst.shape[4] * head_dim, src_h0 * head_dim, dst_h0 * head_dim, BLOCK=block,
                     SEG=chunk if whole else seg, SRC_IDS=src_ids is not None,
                     DST_IDS=dst_ids is not None, COUNTED=programs > 0, num_warps=num_warps)
    triton_launches += 1


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as the integer dtype of its element size: copies stay bit-exact, and torch
    has index kernels for it where it lacks them for the dtype itself (fp8 on CPU)."""
    return t.view(_INT_VIEW[t.element_size()])


# ----------------------------------------------------------------------------- validation

def _staging_shape(buffer: torch.Tensor, page_ids: torch.Tensor, layer_start: int,
                   layer_end: int, heads: tuple[int, int] | None = None) -> tuple[int, ...]:
    _, _, _, page_size, num_heads, head_dim = buffer.shape
    return (layer_end - layer_start, buffer.shape[1], page_ids.numel(), page_size,
            _num_heads(buffer, heads), head_dim)


def _num_heads(buffer: torch.Tensor, heads: tuple[int, int] | None) -> int:
    """How many KV heads `heads` selects of the pool's (checked: a non-empty range inside)."""
    if heads is None:
        return buffer.shape[4]
    h0, h1 = heads
    if not 0 <= h0 < h1 <= buffer.shape[4]:
        raise ValueError(f"head range [{h0}, {h1}) is not a non-empty range inside the pool's "
                         f"{buffer.shape[4]} KV heads")
    return h1 - h0


def _check_pool(buffer: torch.Tensor, page_ids: torch.Tensor | None, layer_start: int,
                layer_end: int, unique: bool = False, ids_device: torch.device | None = None) -> None:
    if buffer.dim() != 6 or buffer.shape[1] not in (1, 2):
        raise ValueError(f"buffer must be [L, 2 (or 1), P, S, H, D], got shape {tuple(buffer.shape)}")
    if not buffer.is_contiguous():
        raise ValueError("buffer must be contiguous")
    if buffer.element_size() not in _INT_VIEW:
        raise ValueError(f"unsupported buffer dtype {buffer.dtype}")
    num_layers, _, num_pages = buffer.shape[:3]
    if not 0 <= layer_start < layer_end <= num_layers:
        raise ValueError(f"layer range [{layer_start}, {layer_end}) is not a non-empty range "
                         f"inside [0, {num_layers})")
    if page_ids is None:
        return
    if page_ids.dim() != 1 or page_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"page_ids must be a 1-D int64 or int32 tensor, got "
                         f"{page_ids.dtype} of shape {tuple(page_ids.shape)}")
    ids_device = buffer.device if ids_device is None else ids_device
    if page_ids.device != ids_device:
        raise ValueError(f"page_ids are on {page_ids.device}, expected on {ids_device}")
    if page_ids.is_cuda or page_ids.numel() == 0:
        return  # range checks on the GPU would cost a host sync
    low, high = int(page_ids.min()), int(page_ids.max())
    if low < 0 or high >= num_pages:
        raise ValueError(f"page ids must lie in [0, {num_pages}), got min {low} max {high}")
    if unique and torch.unique(page_ids).numel() != page_ids.numel():
        raise ValueError("page ids written to must be distinct")


def _check_copy(src: torch.Tensor, src_page_ids: torch.Tensor, dst: torch.Tensor,
                dst_page_ids: torch.Tensor, layer_start: int, layer_end: int,
                src_heads: tuple[int, int] | None = None,
                dst_heads: tuple[int, int] | None = None) -> None:
    _check_pool(src, src_page_ids, layer_start, layer_end, ids_device=dst.device)
    _check_pool(dst, dst_page_ids, layer_start, layer_end, unique=True)
    _check_pools(src, dst, layer_start, layer_end, src_heads, dst_heads)
    if src_page_ids.numel() != dst_page_ids.numel():
        raise ValueError(f"{src_page_ids.numel()} source pages but {dst_page_ids.numel()} "
                         f"destination pages")


def _check_pools(src: torch.Tensor, dst: torch.Tensor, layer_start: int, layer_end: int,
                 src_heads: tuple[int, int] | None, dst_heads: tuple[int, int] | None) -> None:
    if (src.dtype != dst.dtype or src.shape[:2] != dst.shape[:2] or src.shape[3] != dst.shape[3]
            or src.shape[5] != dst.shape[5]
            or _num_heads(src, src_heads) != _num_heads(dst, dst_heads)):
        raise ValueError(f"pools differ: src {src.dtype} {tuple(src.shape)} heads {src_heads}, "
                         f"dst {dst.dtype} {tuple(dst.shape)} heads {dst_heads} (only the page "
                         "count and the head count outside the ranges may differ)")


def _check_staging(staging: torch.Tensor, buffer: torch.Tensor, page_ids: torch.Tensor,
                   layer_start: int, layer_end: int, name: str,
                   heads: tuple[int, int] | None = None) -> None:
    expected = _staging_shape(buffer, page_ids, layer_start, layer_end, heads)
    if tuple(staging.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(staging.shape)}")
    if staging.dtype != buffer.dtype or staging.device != buffer.device:
        raise ValueError(f"{name} is {staging.dtype} on {staging.device}; buffer is "
                         f"{buffer.dtype} on {buffer.device}")
    if not staging.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
