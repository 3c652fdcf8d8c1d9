"""Prompt logprobs (SamplingParams.prompt_logprobs; the API's echo with logprobs) equal
transformers' log-softmax over the same prompt (fp32, CPU), whatever the chunking, batching,
prefix cache, preemption or schedule; and they leave every page free."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import assert_pages_settled
from pd_serve import Engine, SamplingParams

TEXTS = ["The capital of France is Paris, and the capital of Germany is Berlin.",
         "List the planets of the solar system in order from the sun, starting with Mercury "
         "and ending with Neptune, and say one fact about each of them, briefly:",
         "def add(a, b):\n    return a + b\n", "Hi"]


@pytest.fixture(scope="module")
def hf(default_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(default_model_dir) -> Engine:
    """Chunks of 10 tokens: every prompt but the shortest is scored over several steps."""
    return Engine(default_model_dir, device="cpu", max_total_tokens=4096, chunked_prefill_size=10)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in TEXTS]


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' logprobs [len - 1, V] at each position but the last."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def assert_matches(out, prompt: list[int], ref: torch.Tensor, num_top: int) -> None:
    got = out.prompt_logprobs
    assert [lp.token_id for lp in got] == prompt[1:]
    want = ref.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([lp.logprob for lp in got]), want, atol=1e-4)
    for lp, row in zip(got, ref):
        assert len(lp.top) == num_top
        ids = [t for t, _ in lp.top]
        values = torch.tensor([v for _, v in lp.top])
        assert torch.allclose(values, row.topk(num_top).values, atol=1e-4)  # the best values...
        assert torch.allclose(row[ids], values, atol=1e-4)  # ...at ids that have them (near ties)
    for lp, row, target in zip(got, ref, want):  # rank: 1 + the tokens likelier (near ties either way)
        assert 1 + (row > target + 1e-4).sum() <= lp.rank <= 1 + (row > target - 1e-4).sum()
    assert any(lp.rank > 1 for lp in got) or len(got) < 2


def test_prompt_logprobs_equal_transformers_over_chunks_and_batches(engine, prompts, hf, monkeypatch):
    """Scored prompts batched with unscored ones, every prompt over several 10-token chunks,
    their logits taken 7 rows at a time."""
    monkeypatch.setattr("pd_serve.engine.runner.SCORE_ROWS", 7)
    params = [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=k) for k in (3, 0, None, 1)]
    outs = engine.generate(prompts, params)
    for out, prompt, p in zip(outs, prompts, params):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_matches(out, prompt, reference(hf, prompt), p.prompt_logprobs)
    assert len(prompts[3]) == 1 and outs[3].prompt_logprobs == []  # nothing precedes its token
    assert_pages_settled(engine)


def test_a_scored_prompt_is_computed_in_full_past_the_prefix_cache(engine, prompts, hf):
    prompt = prompts[1]
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # now cached
    unscored, scored = engine.generate([prompt] * 2, [
        SamplingParams(temperature=0.0, max_tokens=2),
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)])
    assert unscored.num_cached_tokens > 0 and scored.num_cached_tokens == 0
    assert_matches(scored, prompt, reference(hf, prompt), 2)
    assert scored.token_ids == unscored.token_ids
    assert_pages_settled(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_prompt_logprobs_survive_preemption_and_the_overlap_schedule(default_model_dir, prompts, hf, overlap):
    """Preempted requests compute their prompts again (some in the middle of them): each
    token's logprob is kept once."""
    tight = Engine(default_model_dir, device="cpu", max_total_tokens=128, page_size=16,
                   chunked_prefill_size=16)
    tight.overlap = overlap
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    outs = tight.generate(prompts[:3] * 2, params)
    assert sum(o.num_preemptions for o in outs) >= 3, "the budget should force preemption"
    for out, prompt in zip(outs, prompts[:3] * 2):
        assert_matches(out, prompt, reference(hf, prompt), 1)
    assert not tight.has_unfinished()
    assert_pages_settled(tight)


def test_prompt_logprobs_beside_a_grammar_are_never_lost(engine, prompts, hf):
    """A grammar row's token goes to the grammar thread, which may ask for the step's result
    at once, so the result carries the step's prompt logprobs from its making."""
    from pd_serve.engine.sampling_params import Grammar

    params = SamplingParams(max_tokens=3, prompt_logprobs=2, grammar=Grammar("json_object", ""))
    for _ in range(6):
        for out, prompt in zip(engine.generate(prompts, params), prompts):
            assert_matches(out, prompt, reference(hf, prompt), 2)
