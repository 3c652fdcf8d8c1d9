"""Expert parallelism over gloo: Engine(tp=N, ep_size=N), or Engine(ep_size=N) over replicated
attention (tp 1), partitions each MoE block's experts over its ranks (follower processes),
dispatches tokens to them by all-to-all, and generates the one-process engine's greedy tokens:
Qwen2-MoE (shared expert and a dense layer split by TP) at TP 2 EP 2, Mixtral at TP 4 EP 4,
Qwen3-MoE (sparse and dense layers) at EP 2 and Mixtral at EP 4 with attention replicated.
Qwen3-MoE at EP 2 runs once more under the overlap schedule (switched on by hand on CPU): the
follower reads each step's pending tokens from rank 0's samples."""

from __future__ import annotations

import pytest
import torch

from pd_serve import Engine, SamplingParams
from pd_serve.model.loader import load_model
from pd_serve.model.parallel import TPGroup, shard_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (6, 21, 40)]


@pytest.mark.parametrize("kind,tp,ep,overlap", [
    ("qwen2_moe", 2, 2, False), ("mixtral", 4, 4, False), ("qwen3_moe", 1, 2, False),
    ("mixtral", 1, 4, False), ("qwen3_moe", 1, 2, True)])
def test_ep_engine_equals_ep1(tiny_moe_checkpoints, kind, tp, ep, overlap):
    model_dir, prompts = tiny_moe_checkpoints[kind], _prompts(ep + tp)
    options = dict(device="cpu", max_total_tokens=512, chunked_prefill_size=32)
    want = [o.token_ids for o in Engine(model_dir, **options).generate(prompts, PARAMS)]
    engine = Engine(model_dir, tp=tp, ep_size=ep, **options)
    engine.overlap = overlap
    try:
        got = [o.token_ids for o in engine.generate(prompts, PARAMS)]
    finally:
        engine.close()
    assert got == want


def test_shard_holds_its_experts_and_refusals(tiny_moe_checkpoints):
    full = load_model(tiny_moe_checkpoints["mixtral"], torch.float32, "cpu")
    shard = shard_model(full, TPGroup(1, 4), ep_size=4)
    block, whole = shard.model.layers[0].mlp, full.model.layers[0].mlp
    assert block.expert_offset == 2 and block.experts.gate_up_proj.shape[0] == 2
    assert torch.equal(block.experts.down_proj, whole.experts.down_proj[2:4])
    with pytest.raises(ValueError, match="--ep-size equal to --tp"):
        shard_model(full, TPGroup(0, 2))
    with pytest.raises(ValueError, match="does not divide the 6 experts"):
        shard_model(load_model(tiny_moe_checkpoints["qwen2_moe"], torch.float32, "cpu"),
                    TPGroup(0, 4), ep_size=4)
    with pytest.raises(ValueError, match="ep-size"):
        Engine(tiny_moe_checkpoints["mixtral"], device="cpu", tp=2, ep_size=4)
