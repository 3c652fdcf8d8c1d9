"""The flashinfer backend against the torch backend on the same pool (skipped without CUDA or
flashinfer): batches that mix decode rows with prompt chunks run flashinfer's FA2 prefill
kernels, prompt-only batches its default ones, decode batches its decode wrapper, and a single
decode row our Triton kernel under --enable-batch1-kernels (flashinfer_backend.py says why);
each with full attention and with a sliding window."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pd_serve.cache.pool import KVLayout, KVPool
from pd_serve.engine.attention import create_backend
from pd_serve.engine.attention.base import AttentionMetadata

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
                                reason="needs a CUDA GPU and flashinfer")

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 8, 2, 128, 16
MAX_REL_ERROR = 1e-2  # bf16 outputs of two attention implementations


def batch(rows: list[tuple[int, int]], num_pages: int, seed: int) -> AttentionMetadata:
    """rows: (new tokens, context incl. them) per sequence; pages drawn at random, disjoint."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_pages, generator=gen).tolist()
    tables, slots = [], []
    for query_len, seq_len in rows:
        pages = [free.pop() for _ in range(-(-seq_len // PAGE))]
        tables.append(pages)
        slots += [pages[pos // PAGE] * PAGE + pos % PAGE for pos in range(seq_len - query_len, seq_len)]
    return AttentionMetadata([q for q, _ in rows], [s for _, s in rows], tables,
                             torch.tensor(slots, dtype=torch.int64, device="cuda"))


@pytest.mark.parametrize("rows, wrapper", [
    ([(1, 700), (300, 500), (1, 1500), (50, 50), (1, 17)], "mixed_wrapper"),  # decodes + prompts
    ([(300, 500), (50, 50), (16, 16)], "prefill_wrapper"),                     # prompts only
    ([(1, 700), (1, 17)], "decode_wrapper"),
    ([(1, 700)], "one_row"),                                                    # Triton's decode
])
@pytest.mark.parametrize("window", [0, 64], ids=["full", "window64"])  # window_left 63
def test_flashinfer_matches_torch_on_mixed_batches(rows, wrapper, window):
    layout = KVLayout(1, PAGE, NUM_KV_HEADS, HEAD_DIM, "bfloat16")
    pool = KVPool(layout, 256, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool.buffer.normal_(generator=gen)  # the cached prefixes: random, read by both backends
    meta = batch(rows, pool.num_pages, seed=1)
    t = meta.num_tokens
    q = torch.randn(t, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(t, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    outs = {}
    for name in ("torch", "flashinfer"):  # both store the same new K/V, then attend
        backend = create_backend(name, pool, NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5,
                                 batch1_kernels=wrapper == "one_row", layer_windows=(window,))
        backend.plan(meta)
        outs[name] = backend.run(0, q, k, v).float()
        if name == "flashinfer" and wrapper == "one_row":
            assert backend.delegate is backend.one_row
        elif name == "flashinfer":
            assert backend.delegate is None and backend.wrapper is getattr(backend, wrapper)
    ref, ours = outs["torch"], outs["flashinfer"]
    assert torch.isfinite(ours).all()
    rel_error = ((ours - ref).norm() / ref.norm()).item()
    per_row = [((o - r).norm() / r.norm()).item()
               for o, r in zip(ours.split(meta.query_lens), ref.split(meta.query_lens))]
    assert rel_error < MAX_REL_ERROR and max(per_row) < MAX_REL_ERROR, per_row
