"""Reference checks shared by tests: transformers' greedy decoding, the near-tie rule, and the
shipped evaluation text."""

from __future__ import annotations

import os
from pathlib import Path

import torch

NEAR_TIE = 1e-3
# The device the end-to-end tests serve on: cpu in CI; the GPU machine sets cuda.
TEST_DEVICE = os.environ.get("PD_SERVE_TEST_DEVICE", "cpu")
# The model workers serve when a test names none: the embedded default, unless PD_SERVE_TEST_MODEL
# names a folder (the GPU machine cannot carry the default's GGUF file).
TEST_MODEL = os.environ.get("PD_SERVE_TEST_MODEL") or None
# On the GPU machine every worker shares one GPU, where NCCL (the torch backend) cannot pair.
TEST_TRANSFER = ["--transfer-backend", "ipc"] if TEST_DEVICE.startswith("cuda") else []


@torch.no_grad()
def hf_greedy(hf_model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of a transformers model (full forward each step) and the logits behind each."""
    ids = list(prompt_ids)
    tokens, logits = [], []
    for _ in range(num_tokens):
        step_logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
        token = int(step_logits.argmax())
        tokens.append(token)
        logits.append(step_logits)
        ids.append(token)
    return tokens, logits


def assert_greedy_matches(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor]) -> int:
    """Equal token for token, or parted at a near-tie of the reference (top two within 1e-3).

    Returns how many tokens matched before the sequences parted (len(ref) when they never did).
    """
    assert len(ours) == len(ref), f"lengths differ: ours {len(ours)}, reference {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        top2 = ref_logits[i].topk(2)
        gap = float(top2.values[0] - top2.values[1])
        assert gap < NEAR_TIE and a in top2.indices.tolist(), (
            f"token {i}: ours {a}, reference {b}; reference top-2 gap {gap:.2e} is not a near-tie")
        return i
    return len(ref)


# An original English passage (about 2,200 SmolLM2 tokens) for teacher-forced evaluations of
# quantisation: pd_serve.eval.score_tokens / compare on eval_token_ids(tokenizer).
EVAL_TEXT = Path(__file__).parent / "data" / "eval_text.txt"


def eval_token_ids(tokenizer) -> list[int]:
    return tokenizer.encode(EVAL_TEXT.read_text())


def pages_settled(core) -> bool:
    """Every KV page free or held by the prefix cache alone (no request holds one)."""
    alloc, cache = core.allocator, core.prefix_cache
    return alloc.num_free_pages + (0 if cache is None else cache.num_evictable_pages()) == alloc.num_pages


def assert_pages_settled(core) -> None:
    """pages_settled, then every page free once the prefix cache is flushed."""
    alloc, cache = core.allocator, core.prefix_cache
    assert pages_settled(core), f"{alloc.num_used_pages} pages in use with no request running"
    if cache is not None:  # the allocator's count of evictable pages against a walk of the tree
        assert alloc.num_evictable_pages == sum(alloc.refcount(n.page_id) == 1 for n in cache.nodes())
        cache.flush()
        assert cache.num_pages == 0 and alloc.num_evictable_pages == 0
    assert alloc.num_free_pages == alloc.num_pages
