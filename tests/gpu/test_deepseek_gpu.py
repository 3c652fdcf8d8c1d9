"""DeepSeek-V2/V3 on a GPU (skipped without CUDA): tiny random checkpoints in float32 through
the Triton MLA backend with CUDA graphs (decode batches padded to their bucket) give
transformers' greedy tokens (fp32 on CPU, the near-tie rule), as on the CPU's torch backend."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import assert_greedy_matches, assert_pages_settled, hf_greedy
from kernels import mla_decode
from pd_serve import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind,seed", [("deepseek_v2", 12), ("deepseek_v3", 13)])
def test_triton_mla_with_graphs_matches_transformers(tmp_path, tiny_checkpoint_writer,
                                                     default_model_dir, kind, seed):
    model_dir = tiny_checkpoint_writer(kind, tmp_path / kind, default_model_dir, seed=seed)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 23, 70)]
    launches = mla_decode.triton_launches
    engine = Engine(model_dir, device="cuda", dtype="float32", max_total_tokens=4096)
    assert engine.attention_backend == "triton" and engine.runner.graphs
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert mla_decode.triton_launches > launches
    assert_pages_settled(engine)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    matched = [assert_greedy_matches(out.token_ids, *hf_greedy(hf, prompt, 24))
               for prompt, out in zip(prompts, outs)]
    assert max(matched) >= 16, f"every sequence parted early: {matched}"
