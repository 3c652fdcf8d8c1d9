"""--kv-cache-dtype fp8_e4m3 / fp8_e5m2 on the embedded SmolLM2 (float32 weights) against the
float32 KV cache: teacher-forced through the engine's own forward (pd_serve.eval) on
tests/data/eval_text.txt, in chunks of 512 tokens, each attending to the FP8 pages of those
before it and of itself, as decode does.

Measured (2225 positions; e5m2 on the first 767, as scoring is causal):

    fp8_e4m3: top-1 agreement 93.84 % (99.86 % over the 63 % of positions where the reference's
              top two tokens are >= 0.5 nats apart); perplexity 29.81 vs 29.38 (+1.46 %)
    fp8_e5m2: first 767 positions: 90.35 % (98.57 %); perplexity +1.30 %
              (whole text, measured once: 87.82 %, perplexity +3.33 %)

The issue's 98 % top-1 bar is not met, and scaling cannot meet it: FP8 keeps 3 (e4m3) or 2
(e5m2) mantissa bits, a relative rounding error (of values in the normal range) that no
per-tensor or per-head scale changes (a scale moves the range; SmolLM2's K and V stay within
+-22, far inside e4m3's +-448,
and per-layer amax scales gave 94.3 % on the first 1024 tokens, against 94.1 % with 1.0). The
flips are near-ties: at all 137 the reference's top two tokens were within 0.8 nats, at 135
within 0.5. For scale, on the first 1024 tokens: the same model in bfloat16 (weights and KV)
agrees with float32 on 97.0 % of positions, an FP8 V alone (K in float32) on 98.8 %, an FP8 K
alone on 95.2 %: K's rounding is what flips near-ties. So the tests hold the perplexity bar
(5 %), agreement where the reference is confident, and the measured raw agreement as a floor.
(Rotating q, K and V by a Hadamard matrix per head before the rounding, which the engine does
not do, reaches 95.7-96.5 %: docs/performance.md.)
"""

from __future__ import annotations

import pytest
import torch

from helpers import eval_token_ids
from pd_serve import Engine
from pd_serve.eval import compare, score_tokens


def engine(model_dir, kv_cache_dtype: str) -> Engine:
    return Engine(model_dir, device="cpu", max_total_tokens=2304, kv_cache_dtype=kv_cache_dtype)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """The float32 KV cache's scores, and the largest |K| and |V| it stored."""
    core = engine(default_model_dir, "auto")
    ids = eval_token_ids(core.tokenizer)
    scores = score_tokens(core, ids)
    pool = core.kv_pool.buffer  # [L, 2, P, S, H, D]; zero but for this text's K/V
    return ids, scores, float(pool[:, 0].abs().max()), float(pool[:, 1].abs().max())


def test_smollm2_kv_fits_e4m3_range(reference):
    _, _, max_k, max_v = reference
    assert max_k < 448 / 10 and max_v < 448 / 10, "scale 1.0 would saturate or come close"


def test_fp8_e4m3_follows_the_float32_cache(default_model_dir, reference, record_property):
    ids, ref, _, _ = reference
    core = engine(default_model_dir, "fp8_e4m3")
    assert core.kv_pool.buffer.dtype == torch.float8_e4m3fn
    result = compare(score_tokens(core, ids), ref)
    print(f"fp8_e4m3: {result}")
    record_property("fp8_e4m3", str(result))
    assert result.num_positions == len(ids) - 1 > 2000
    assert abs(result.perplexity_ratio - 1) <= 0.05
    assert result.confident_agreement >= 0.99
    assert result.top1_agreement >= 0.92


def test_fp8_e5m2_follows_the_float32_cache(default_model_dir, reference, record_property):
    ids, ref, _, _ = reference
    num_tokens = 768  # a prefix: one more full pass would double the cost of this module
    core = engine(default_model_dir, "fp8_e5m2")
    result = compare(score_tokens(core, ids[:num_tokens]), ref.head(num_tokens - 1))
    print(f"fp8_e5m2: {result}")
    record_property("fp8_e5m2", str(result))
    assert abs(result.perplexity_ratio - 1) <= 0.05
    assert result.confident_agreement >= 0.98
    assert result.top1_agreement >= 0.85
