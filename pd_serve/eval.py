"""Teacher-forced evaluation through the engine's own forward: how closely a model (quantised
weights, an FP8 KV cache, another attention backend, ...) follows a reference model on a text.

    ref = score_tokens(EngineCore(EngineConfig(device="cpu")), ids)
    fp8 = score_tokens(EngineCore(EngineConfig(device="cpu", cache=CacheConfig(
        kv_cache_dtype="fp8_e4m3"))), ids)
    print(compare(fp8, ref))   # top-1 agreement 93.84 % over 2225 positions (...); perplexity ...

score_tokens() feeds the token ids through the engine's model, attention backend and KV pool,
`chunk_size` tokens a forward, as chunked prefill does: every chunk stores its K/V in the pool
(quantised, for an FP8 cache) and attends to the chunks before it from there. At each position
t it keeps the argmax prediction, the negative log-likelihood of token t + 1 and the margin
between its two likeliest tokens, nothing more, so two long evaluations can be compared without
holding logits [T, vocab] in memory. Scoring is causal: the first n positions of a text's
scores are the scores of its first n + 1 tokens (TokenScores.head).

compare() turns two scorings of the same ids into top-1 agreement and perplexities. On a small
model many positions are near-ties (SmolLM2-135M's top two tokens lie within 0.25 nats of each
other at a fifth of the positions of tests/data/eval_text.txt), and any perturbation flips
some of them, so compare() also reports the agreement where the reference is confident (top-1
ahead of top-2 by CONFIDENT_MARGIN or more), which separates harmless flips from real damage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pd_serve.cache.pool import pages_for
from pd_serve.engine.attention.base import AttentionMetadata
from pd_serve.engine.core import EngineCore

CONFIDENT_MARGIN = 0.5  # nats between the reference's top-1 and top-2 log-probabilities


@dataclass
class TokenScores:
    """One model on one text: for each position t < T - 1, what it predicts for t + 1."""

    top1: torch.Tensor  # [T - 1] int64, argmax of the logits at t
    nll: torch.Tensor  # [T - 1] float64, -log p(token t + 1 | tokens <= t)
    margin: torch.Tensor  # [T - 1] float64, log p(top-1) - log p(top-2) at t

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))

    def head(self, num_positions: int) -> "TokenScores":
        """The first num_positions scores: those of the text's first num_positions + 1 tokens."""
        return TokenScores(self.top1[:num_positions], self.nll[:num_positions],
                           self.margin[:num_positions])


@dataclass
class Comparison:
    num_positions: int
    top1_agreement: float  # fraction of positions where both models' argmax agree
    perplexity: float
    ref_perplexity: float
    confident_fraction: float  # of positions where the reference's margin >= CONFIDENT_MARGIN
    confident_agreement: float  # top-1 agreement over those positions

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.ref_perplexity

    def __str__(self) -> str:
        return (f"top-1 agreement {100 * self.top1_agreement:.2f} % over {self.num_positions} "
                f"positions ({100 * self.confident_agreement:.2f} % over the "
                f"{100 * self.confident_fraction:.0f} % where the reference's margin is >= "
                f"{CONFIDENT_MARGIN} nats); perplexity {self.perplexity:.4f} vs reference "
                f"{self.ref_perplexity:.4f} ({100 * (self.perplexity_ratio - 1):+.2f} %)")


@torch.inference_mode()
def score_tokens(core: EngineCore, token_ids: list[int], chunk_size: int = 512) -> TokenScores:
    """Teacher-forced argmax and NLL of `core`'s model over token_ids (see the module doc).

    Takes ceil(T / page_size) pages from the core's allocator for the duration and frees them;
    raises ValueError when they are not free or T exceeds the context length. Do not call it
    while another thread steps the same core.
    """
    num_tokens = len(token_ids)
    if num_tokens < 2:
        raise ValueError("need at least 2 tokens to score")
    if num_tokens > core.max_model_len:
        raise ValueError(f"{num_tokens} tokens exceed the context length {core.max_model_len}")
    page_size = core.kv_pool.layout.page_size
    page_ids = core.allocator.allocate(pages_for(num_tokens, page_size))
    if page_ids is None:
        raise ValueError(f"{num_tokens} tokens do not fit in the free KV pages; raise "
                         "--max-total-tokens")
    device, attn = core.device, core.runner.attn
    ids = torch.tensor(token_ids, dtype=torch.int64)
    pages = torch.tensor(page_ids, dtype=torch.int64)
    top1, nll, margin = [], [], []
    try:
        for start in range(0, num_tokens - 1, chunk_size):
            end = min(start + chunk_size, num_tokens - 1)  # the last token only serves as target
            positions = torch.arange(start, end)
            slots = pages[positions // page_size] * page_size + positions % page_size  # [n]
            attn.plan(AttentionMetadata(query_lens=[end - start], seq_lens=[end],
                                        page_tables=[page_ids], slot_mapping=slots.to(device)))
            hidden = core.model(ids[start:end].to(device), positions.to(device), attn)  # [n, H]
            log_probs = core.model.compute_logits(hidden).double().log_softmax(-1)  # [n, V]
            targets = ids[start + 1:end + 1].to(device)
            best = log_probs.topk(2, dim=-1)
            top1.append(best.indices[:, 0].cpu())
            margin.append((best.values[:, 0] - best.values[:, 1]).cpu())
            nll.append(-log_probs.gather(1, targets[:, None])[:, 0].cpu())
    finally:
        core.allocator.free(page_ids)
    return TokenScores(torch.cat(top1), torch.cat(nll), torch.cat(margin))


def compare(scores: TokenScores, ref: TokenScores) -> Comparison:
    """Top-1 agreement and perplexities of two scorings of the same token ids."""
    if scores.top1.shape != ref.top1.shape:
        raise ValueError(f"scored {scores.top1.numel()} and {ref.top1.numel()} positions: not "
                         "the same text")
    agree = scores.top1 == ref.top1
    confident = ref.margin >= CONFIDENT_MARGIN
    return Comparison(
        num_positions=agree.numel(), top1_agreement=float(agree.double().mean()),
        perplexity=scores.perplexity, ref_perplexity=ref.perplexity,
        confident_fraction=float(confident.double().mean()),
        confident_agreement=float(agree[confident].double().mean()) if confident.any() else 1.0)


def evaluate(core: EngineCore, ref_core: EngineCore, token_ids: list[int],
             chunk_size: int = 512) -> Comparison:
    """compare(score_tokens(core, ...), score_tokens(ref_core, ...))."""
    return compare(score_tokens(core, token_ids, chunk_size),
                   score_tokens(ref_core, token_ids, chunk_size))
