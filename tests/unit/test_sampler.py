"""Sampler: greedy, seeded reproducibility, filters, penalties and logprobs, all on CPU."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pd_serve.engine.executor import CachedRequest
from pd_serve.engine.plan import NewRequest, sampling_to_wire
from pd_serve.engine.sampler import Sampler, apply_penalties
from pd_serve.engine.sampling_params import SamplingParams


def make_request(prompt=(0,), output=(), **params) -> CachedRequest:
    """A request as the sampler gets it (the executor's), with the given prompt/output ids and
    SamplingParams fields (the outputs' draws not taken from a seeded generator)."""
    sampling = sampling_to_wire(SamplingParams(**params))
    req = CachedRequest(NewRequest("r", list(prompt), len(prompt), [], sampling), vocab_size=0)
    req.token_ids.extend(output)
    return req


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    """One logits row [V] whose softmax is `probs`."""
    return torch.tensor(probs).log()


def draw_many(row: torch.Tensor, num_draws: int, sampler: Sampler | None = None, **params):
    """Sample `num_draws` unseeded rows that all share logits `row` [V]; returns a Counter."""
    sampler = sampler or Sampler(seed=0)
    logits = row.unsqueeze(0).expand(num_draws, -1)  # [N, V]
    requests = [make_request(**params) for _ in range(num_draws)]
    return Counter(sampler(logits, requests).token_ids)


def entropy(counts: Counter) -> float:
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = logits.float().argmax(-1).tolist()
    out = Sampler()(logits, [make_request(temperature=0.0) for _ in range(4)])
    assert out.token_ids == expected
    assert out.logprobs == [None] * 4
    # Greedy rows mixed with sampled rows (the non-fast path) still take the argmax.
    mixed = [make_request(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(4)]
    tokens = Sampler()(logits, mixed).token_ids
    assert [tokens[0], tokens[2]] == [expected[0], expected[2]]
    assert all(isinstance(t, int) for t in tokens)


def test_top_k_1_equals_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1)) * 0.1
    expected = logits.argmax(-1).tolist()
    assert Sampler()(logits, [make_request(top_k=1) for _ in range(8)]).token_ids == expected
    # With logprobs on, the fast path is skipped; the answer must not change.
    reqs = [make_request(top_k=1, temperature=1.5, logprobs=0) for _ in range(8)]
    assert Sampler()(logits, reqs).token_ids == expected


def _seeded_draws(seed: int, logits: torch.Tensor, sampler_seed: int = 0) -> list[int]:
    sampler, req = Sampler(seed=sampler_seed), make_request(seed=seed)
    return [sampler(logits, [req]).token_ids[0] for _ in range(50)]


def test_seeded_sampling_is_reproducible():
    logits = torch.zeros(1, 100)  # uniform: 50 draws of two seeds are all but surely different
    first = _seeded_draws(7, logits)
    assert _seeded_draws(7, logits, sampler_seed=123) == first  # the sampler's seed is irrelevant
    assert _seeded_draws(8, logits) != first
    assert len(set(first)) > 10  # really sampling, not stuck on one token


def test_unseeded_sampling_follows_sampler_seed():
    logits = torch.zeros(20, 100)
    reqs = [make_request() for _ in range(20)]
    assert Sampler(seed=3)(logits, reqs).token_ids == Sampler(seed=3)(logits, reqs).token_ids
    assert Sampler(seed=3)(logits, reqs).token_ids != Sampler(seed=4)(logits, reqs).token_ids


def test_seeded_sampling_is_independent_of_batch():
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(1, 64, generator=gen) * 0.5
    alone = _seeded_draws(11, row)
    sampler, req = Sampler(), make_request(seed=11)
    others = [make_request(), make_request(seed=5), make_request(temperature=0.0)]
    in_batch = []
    for _ in range(50):
        before, after = torch.randn(2, 64, generator=gen), torch.randn(1, 64, generator=gen)
        logits = torch.cat([before, row, after])  # [4, 64], the seeded row third
        batch = [others[0], others[1], req, others[2]]
        in_batch.append(sampler(logits, batch).token_ids[2])
    assert in_batch == alone


def test_sampling_frequencies_match_probabilities():
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = draw_many(logits_from_probs(probs), 20000)
    for token_id, p in enumerate(probs):
        assert counts[token_id] / 20000 == pytest.approx(p, abs=0.015)


def test_top_k_samples_only_among_top_k():
    row = torch.randn(50, generator=torch.Generator().manual_seed(3))
    top5 = set(row.topk(5).indices.tolist())
    counts = draw_many(row, 2000, top_k=5)
    assert set(counts) <= top5
    assert len(counts) >= 3  # it samples, it does not collapse to greedy
    assert len(draw_many(row, 2000, top_k=0)) > 5  # 0 disables the filter


@pytest.mark.parametrize("top_k", [50, 51, 2**63 - 1, 2**64 - 1])
def test_a_top_k_past_the_vocabulary_keeps_all_of_it(top_k):
    """SamplingParams bounds top_k below only, and msgpack carries it up to 2**64 - 1: a
    worker given such a request samples from the whole vocabulary, not fails its step."""
    row = torch.randn(50, generator=torch.Generator().manual_seed(3))
    counts = draw_many(row, 2000, top_k=top_k)
    assert len(counts) > 5 and set(counts) <= set(range(50))
    mixed = [make_request(top_k=top_k), make_request(top_k=1)]  # another row's filter still holds
    assert Sampler()(row.unsqueeze(0).expand(2, -1), mixed).token_ids[1] == row.argmax().item()


def test_top_p_small_keeps_only_dominant_token():
    row = torch.zeros(20)
    row[7] = 2.0  # p(7) ~ 0.28 >= top_p, every other token ~ 0.038
    assert set(draw_many(row, 1000, top_p=0.2)) == {7}
    assert len(draw_many(row, 1000, top_p=1.0)) > 5


def test_top_p_samples_only_the_nucleus():
    # Sorted probs 0.4, 0.3, 0.15, 0.1, 0.05 -> cumulative 0.4, 0.7, 0.85, 0.95: the smallest set
    # reaching 0.9 is the first four tokens. Ids are shuffled so order is not the id order.
    ids = [3, 0, 4, 1, 2]
    probs = [0.0] * 5
    for token_id, p in zip(ids, [0.4, 0.3, 0.15, 0.1, 0.05]):
        probs[token_id] = p
    row = logits_from_probs(probs)
    counts = draw_many(row, 3000, top_p=0.9)
    assert set(counts) == set(ids[:4])
    assert ids[4] in draw_many(row, 3000)  # without top_p the tail token does show up


def test_min_p_drops_unlikely_tokens():
    # threshold = 0.15 * 0.5 = 0.075: tokens 3 (0.06) and 4 (0.04) go, 2 (0.1) stays.
    row = logits_from_probs([0.5, 0.3, 0.1, 0.06, 0.04])
    assert set(draw_many(row, 3000, min_p=0.15)) == {0, 1, 2}
    assert set(draw_many(row, 3000)) == {0, 1, 2, 3, 4}


def test_apply_penalties_by_hand():
    row = [1.0, -1.0, 2.0, -2.0, 0.5, 3.0]
    logits = torch.tensor([row, row, row])
    before = logits.clone()
    reqs = [
        make_request(prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0,
                     frequency_penalty=0.5, presence_penalty=0.25),
        make_request(prompt=[0, 1], output=[2, 2, 3]),  # neutral
        make_request(prompt=[5], output=[4], frequency_penalty=1.0, presence_penalty=1.0),
    ]
    out = apply_penalties(logits, reqs)
    expected = torch.tensor([
        # 0: prompt, >0 -> /2; 1: prompt, <0 -> *2; 2: output x2, >0 -> /2 - 0.5*2 - 0.25;
        # 3: output x1, <0 -> *2 - 0.5 - 0.25; 4 and 5 unseen.
        [0.5, -2.0, -0.25, -4.75, 0.5, 3.0],
        row,
        # frequency/presence count only output ids: 4 -> 0.5 - 1 - 1; prompt id 5 untouched.
        [1.0, -1.0, 2.0, -2.0, -1.5, 3.0],
    ])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, before)  # input not modified


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    assert Sampler()(logits, [make_request(temperature=0.0)]).token_ids == [0]
    req = make_request(prompt=[0], temperature=0.0, repetition_penalty=2.0)  # 3 -> 1.5 < 2
    assert Sampler()(logits, [req]).token_ids == [1]
    req = make_request(prompt=[2], output=[0], temperature=0.0, presence_penalty=2.0)
    assert Sampler()(logits, [req]).token_ids == [1]


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4))
    reqs = [
        make_request(prompt=[1, 2], logprobs=5, temperature=0.5, repetition_penalty=1.5),
        make_request(logprobs=0, temperature=0.0),
        make_request(logprobs=None),
    ]
    out = Sampler()(logits, reqs)
    raw = torch.log_softmax(logits, dim=-1)
    first, second = out.logprobs[0], out.logprobs[1]
    assert out.logprobs[2] is None
    assert first.token_id == out.token_ids[0] and second.token_id == out.token_ids[1]
    assert first.logprob == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-6)
    assert second.logprob == pytest.approx(raw[1].max().item(), abs=1e-6)
    assert second.top == []
    top_lps = [lp for _, lp in first.top]
    assert len(first.top) == 5 and top_lps == sorted(top_lps, reverse=True)
    expected_ids = raw[0].topk(5).indices.tolist()
    assert [t for t, _ in first.top] == expected_ids
    assert top_lps == pytest.approx(raw[0, expected_ids].tolist(), abs=1e-6)


def test_higher_temperature_spreads_distribution():
    row = torch.randn(20, generator=torch.Generator().manual_seed(5)) * 2
    cold = entropy(draw_many(row, 4000, temperature=0.3))
    warm = entropy(draw_many(row, 4000, temperature=1.0))
    hot = entropy(draw_many(row, 4000, temperature=3.0))
    assert cold < warm < hot


def test_logit_bias_moves_greedy_and_sampled_tokens_but_not_logprobs():
    """+100 forces a token, -100 removes the argmax (greedy then takes the runner-up), in
    greedy and sampled rows alike; the returned logprobs are the unbiased model's."""
    logits = logits_from_probs([0.1, 0.6, 0.25, 0.05]).unsqueeze(0).expand(3, -1)  # [3, V]
    requests = [make_request(temperature=0, logit_bias={3: 100.0}),
                make_request(temperature=0, logit_bias={1: -100.0}, logprobs=1),
                make_request(temperature=1.0, seed=4, logit_bias={0: 100.0})]
    assert not Sampler.argmax_only(requests[:1])
    out = Sampler(seed=0)(logits, requests)
    assert out.token_ids == [3, 2, 0]
    assert out.logprobs[1].logprob == pytest.approx(math.log(0.25), abs=1e-5)
    assert out.logprobs[1].top[0] == (1, pytest.approx(math.log(0.6), abs=1e-5))
    counts = draw_many(logits[0], 200, logit_bias={1: -100.0})
    assert counts[1] == 0 and set(counts) <= {0, 2, 3}


def test_a_requests_logit_bias_is_read_into_tensors_once():
    """A request's bias (up to the whole vocabulary, for each of up to 128 choices) becomes
    tensors at the first step that samples it and is reused while the request is in every
    step; a step without it forgets it. Read from the dict every step, 128 full-vocabulary
    biases took 3.7 s a step on 2 cores. The biased tokens are the same each step."""
    vocab = 4096
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    full = {t: (-100.0 if t != 7 else 100.0) for t in range(vocab)}  # only 7 can win
    requests = [make_request(temperature=0, logit_bias=full),
                make_request(temperature=0),
                make_request(temperature=1.0, seed=1, logit_bias={5: 100.0})]
    sampler = Sampler(seed=0)
    assert sampler(logits, requests).token_ids[::2] == [7, 5]
    made = {k: v[1] for k, v in sampler._biases.items()}
    assert len(made) == 2
    assert sampler(logits, requests).token_ids[::2] == [7, 5]
    assert all(sampler._biases[k][1] is t for k, t in made.items())  # the same tensors
    sampler(logits[:2], requests[:2])
    assert set(sampler._biases) == {id(requests[0].sampling_params)}


def test_penalties_over_steps_count_each_new_output_once():
    """The Sampler keeps a row's prompt and output ids as tensors between steps and appends
    its new outputs: step by step, with outputs growing by one or by several tokens, the
    penalised greedy choice is the one made from the id lists afresh."""
    logits = torch.tensor([[0.0, 0.1, 0.2, 2.0, 0.3, 1.9, 0.0, 1.2]] * 2)  # [2, 8]
    rows = [make_request(prompt=(6,), temperature=0, frequency_penalty=0.5),
            make_request(prompt=(7, 7), temperature=0, presence_penalty=0.4,
                         repetition_penalty=1.3)]
    kept, chosen = Sampler(seed=0), []
    for step in range(8):
        want = Sampler(seed=0)(logits, [make_request(
            prompt=r.prompt_token_ids, output=r.output_token_ids, temperature=0,
            frequency_penalty=r.sampling_params.frequency_penalty,
            presence_penalty=r.sampling_params.presence_penalty,
            repetition_penalty=r.sampling_params.repetition_penalty) for r in rows]).token_ids
        got = kept(logits, rows).token_ids
        assert got == want, step
        chosen.append(got)
        for r, token in zip(rows, got):
            r.token_ids.extend([token] * (1 + step % 2))  # (and a step that adds two)
        if step == 0:
            prompt = kept._histories[id(rows[0].sampling_params)][1]
    assert kept._histories[id(rows[0].sampling_params)][1] is prompt  # made once
    assert len({c[0] for c in chosen}) > 2  # the penalty moved the choice, step by step


def test_logit_bias_is_checked():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


@pytest.mark.parametrize("params,want", [
    (dict(temperature=1e-40), 7),  # greedy below SAMPLING_EPS (dividing by it overflows)
    (dict(temperature=1e-300), 7),
    (dict(temperature=1.0, top_p=1e-46, seed=1), 7),  # 0 in float32: the top token stays
    (dict(temperature=1.0, repetition_penalty=1e-46, output=(7,), seed=2), 7),  # 0 in float32
    (dict(temperature=0.0, repetition_penalty=1e300, output=(7, 11)), 3),  # inf in float32
], ids=["temperature-1e-40", "temperature-1e-300", "top_p-1e-46", "rep-1e-46", "rep-1e300"])
def test_extreme_values_that_pass_validation_never_give_nan(params, want):
    """Doubles the API accepts that float32 turns into 0 or inf give a real choice, never a
    NaN row's: logits 5 for token 7, 4 for token 3, 0 elsewhere. A penalty near 0 makes a seen
    7 certain; one near inf sends seen 7 (and a seen 0-logit 11, 0 * inf) to 0, leaving 3."""
    logits = torch.zeros(1, 50)
    logits[0, 7], logits[0, 3] = 5.0, 4.0
    out = Sampler(seed=0)(logits, [make_request(**params)])
    assert out.token_ids == [want]


def test_min_tokens_masks_stop_ids_and_eos_until_enough_outputs():
    """Short of min_tokens a row cannot sample a stop token id or (unless ignore_eos) an EOS;
    its position (where the token goes, the token before possibly still in flight) counts."""
    logits = torch.full((1, 8), -5.0)
    logits[0, 3], logits[0, 5], logits[0, 6] = 9.0, 8.0, 7.0  # 3 (EOS) > 5 (stop id) > 6
    sampler = Sampler(eos_token_ids=[3])
    prompt = (0, 1)

    def token(output=(), position=None, **params):
        req = make_request(prompt, output, temperature=0.0, max_tokens=8, stop_token_ids=[5], **params)
        positions = None if position is None else [position]
        return sampler.launch(logits, [req], positions).result().token_ids[0]

    def masked(output, position=None):  # a masked row never takes the graph's own argmax
        req = make_request(prompt, output, temperature=0.0, max_tokens=8, min_tokens=2)
        return not Sampler.argmax_only([req], None if position is None else [position])

    assert [masked(()), masked((7,)), masked((7, 7)), masked((7,), 4)] == [True, True, False, False]
    assert token() == 3  # no min_tokens: the EOS wins
    assert token(min_tokens=2) == 6 and token((7,), min_tokens=2) == 6
    assert token((7, 7), min_tokens=2) == 3  # two outputs out: stops are allowed again
    assert token((7,), position=4, min_tokens=2) == 3  # one known, one in flight
    assert token(min_tokens=2, ignore_eos=True) == 3  # ignore_eos: the EOS is no stop
    # sampled rows are masked too, and the raw logprobs stay the model's
    req = make_request(prompt, (), temperature=1.0, max_tokens=8, stop_token_ids=[5], min_tokens=1,
                       logprobs=1, seed=1)
    out = sampler(logits.expand(1, -1), [req])
    assert out.token_ids[0] not in (3, 5)
    assert out.logprobs[0].top[0][0] == 3
