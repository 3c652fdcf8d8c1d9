"""--dtype bfloat16 on the CPU (the fast CPU mode on cores with AVX512-BF16 or AMX:
docs/performance.md) against transformers in bfloat16 on the same weights: teacher-forced
through the engine's own forward, paged KV and chunks (pd_serve.eval) on the first 1024 tokens
of tests/data/eval_text.txt.

bfloat16 keeps 8 mantissa bits, so two correct implementations that round in another order
part at near-ties: the tests hold agreement where transformers is confident (top-1 ahead by
0.5 nats or more), perplexity, and raw agreement at a floor. Measured: top-1 agreement
96.29 % (100 % where confident), perplexity +0.12 %; transformers' own float32 against its
bfloat16 agrees on 95.99 % (+0.25 %): bfloat16 rounding, not the engine, sets the raw figure.
"""

from __future__ import annotations

import pytest
import torch

from helpers import eval_token_ids
from pd_serve import Engine
from pd_serve.eval import TokenScores, compare, score_tokens

NUM_TOKENS = 1024


@torch.inference_mode()
def hf_scores(model_dir, ids: list[int], dtype: torch.dtype) -> TokenScores:
    """transformers' teacher-forced scores of ids, one forward, as score_tokens keeps them."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    log_probs = hf(torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)
    best = log_probs.topk(2, dim=-1)
    targets = torch.tensor(ids[1:])
    return TokenScores(best.indices[:, 0], -log_probs.gather(1, targets[:, None])[:, 0],
                       best.values[:, 0] - best.values[:, 1])


@pytest.fixture(scope="module")
def text(default_model_dir):
    engine = Engine(default_model_dir, device="cpu", dtype="bfloat16", max_total_tokens=1280)
    assert engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert engine.kv_pool.buffer.dtype == torch.bfloat16
    ids = eval_token_ids(engine.tokenizer)[:NUM_TOKENS]
    return ids, score_tokens(engine, ids), hf_scores(default_model_dir, ids, torch.bfloat16)


def test_bfloat16_engine_follows_transformers_in_bfloat16(text, record_property):
    ids, ours, ref = text
    result = compare(ours, ref)
    print(f"bfloat16 engine vs transformers bfloat16: {result}")
    record_property("bf16_vs_hf_bf16", str(result))
    assert result.num_positions == NUM_TOKENS - 1
    assert abs(result.perplexity_ratio - 1) <= 0.02
    assert result.confident_agreement >= 0.99
    assert result.top1_agreement >= 0.93
