"""Engine behaviour on real weights: batch invariance, preemption, aborts, sampling, stop strings."""

from __future__ import annotations

import asyncio
import random

import pytest

from helpers import assert_pages_settled
from pd_serve import AsyncEngine, Engine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def smol(default_model_dir) -> Engine:
    return Engine(default_model_dir, device="cpu", max_total_tokens=8192)


@pytest.fixture(scope="module")
def prompts(smol) -> list[list[int]]:
    texts = ["Once upon a time", "The three primary colours are", "Water boils at",
             "List the planets of the solar system in order from the sun, starting with Mercury "
             "and ending with Neptune, and say one fact about each of them, briefly:",
             "def add(a, b):", "In 1492,", "The quick brown fox", "Photosynthesis is the process"]
    return [smol.tokenizer.encode(t) for t in texts]


def assert_all_pages_free(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert_pages_settled(engine)


def test_batch_invariance_with_chunked_prefill(default_model_dir, smol, prompts):
    target = prompts[3]
    assert len(target) > 30
    alone = smol.generate([target], GREEDY)[0].token_ids
    engine = Engine(default_model_dir, device="cpu", max_total_tokens=8192, chunked_prefill_size=10)
    chunks_of_target = []
    execute = engine.runner.execute

    def recording_execute(plan, after_layer=None):
        chunks_of_target.extend(c for c in plan.chunks if c.request.prompt_token_ids == target
                                and c.start < len(target))
        return execute(plan, after_layer)

    engine.runner.execute = recording_execute
    batched = engine.generate(prompts, GREEDY)
    assert len(chunks_of_target) >= 3, "the prompt should be prefilled over 3+ chunks"
    assert batched[3].token_ids == alone
    assert_all_pages_free(engine)


def test_long_prefill_threshold_gives_same_tokens(default_model_dir, smol, prompts):
    """Prompts cut to 5 tokens a step while others wait, then topped up with the step's rest."""
    reference = [o.token_ids for o in smol.generate(prompts, GREEDY)]
    engine = Engine(default_model_dir, device="cpu", max_total_tokens=8192,
                    chunked_prefill_size=16, long_prefill_token_threshold=5)
    steps = []
    execute = engine.runner.execute

    def recording_execute(plan, after_layer=None):
        steps.append([c.num_tokens for c in plan.chunks if c.start < len(c.request.prompt_token_ids)])
        return execute(plan, after_layer)

    engine.runner.execute = recording_execute
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference
    assert any(s.count(5) >= 2 for s in steps), "prompts cut to 5 tokens should share a step"
    assert any(max(s, default=0) > 5 for s in steps), "a cut chunk should take the rest back"
    assert_all_pages_free(engine)


def test_preemption_under_tiny_kv_budget_gives_same_tokens(default_model_dir, smol, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    reference = [o.token_ids for o in smol.generate(prompts, params)]
    tight = Engine(default_model_dir, device="cpu", max_total_tokens=160, page_size=16)
    outs = tight.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0, "the budget should force preemption"
    assert [o.token_ids for o in outs] == reference
    assert_all_pages_free(tight)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_200_random_requests_with_aborts_leave_every_page_free(tiny_checkpoints, overlap):
    """Also under the overlap schedule (GPU's default; forced on here): aborts and stops land
    while a step is in flight, and its pages wait for it."""
    engine = Engine(tiny_checkpoints["llama3"], device="cpu", max_total_tokens=512,
                    chunked_prefill_size=64, max_running_requests=16)
    engine.overlap = overlap
    rng = random.Random(0)
    live, finished, aborted = set(), 0, 0
    for i in range(200):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([-1, 5]),
            top_p=rng.choice([1.0, 0.9]), max_tokens=rng.randint(1, 24),
            seed=rng.choice([None, i]), stop=rng.choice([[], ["e"], ["the", "a"]]),
            repetition_penalty=rng.choice([1.0, 1.2]), logprobs=rng.choice([None, 2]))
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 120))]
        live.add(engine.add_request(prompt, params))
        for _ in range(rng.randint(0, 3)):
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
                    finished += 1
        if live and rng.random() < 0.25:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
            aborted += 1
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
    assert not live and finished + aborted == 200 and aborted > 20
    assert_all_pages_free(engine)


def test_seeded_sampling_is_reproducible(smol, prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    first = smol.generate([prompts[0]], seeded)[0].token_ids
    in_batch = smol.generate(prompts[:4], [seeded if i == 2 else GREEDY for i in range(4)])
    assert in_batch[0].token_ids == smol.generate([prompts[0]], GREEDY)[0].token_ids
    again = smol.generate([prompts[2], prompts[0]], [GREEDY, seeded])[1].token_ids
    assert first == again
    other = smol.generate([prompts[0]], SamplingParams(temperature=0.9, top_p=0.95, seed=99,
                                                       max_tokens=20, ignore_eos=True))[0]
    assert other.token_ids != first
    # torch's CPU generator keeps 32 bits of a seed: other 64-bit seeds are mixed down, so
    # none of these samples like its neighbour (cut or folded bits would make pairs alike)
    def sample(seed):
        return smol.generate([prompts[0]], SamplingParams(temperature=0.9, top_p=0.95, seed=seed,
                                                          max_tokens=20, ignore_eos=True))[0].token_ids
    alike = [sample(s) for s in (1234 + 2**32, 0, -1, 1, 2**32 + 1, 2**63 - 1, -2**63)]
    assert len({tuple(t) for t in alike + [first]}) == len(alike) + 1


def test_top_k_1_equals_greedy(smol, prompts):
    greedy = [o.token_ids for o in smol.generate(prompts[:4], GREEDY)]
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in smol.generate(prompts[:4], top1)] == greedy


def test_stop_string_cuts_output_exactly(smol, prompts):
    full = smol.generate([prompts[3]], GREEDY)[0]
    text = full.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    cut = smol.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=24,
                                                     ignore_eos=True, stop=[stop, "\x00never"]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.index(stop)]
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids


def test_an_output_ending_inside_a_character_keeps_its_text(smol, prompts):
    """max_tokens ends the output on a token that carries part of a UTF-8 character: the text is
    tokenizer.decode of the output (with U+FFFD), streamed or not."""
    tok = smol.tokenizer
    first = tok.encode("🙂")[0]
    assert tok.decode([first]).endswith("\ufffd"), "pick a character split over tokens"
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logit_bias={first: 100.0})
    out = smol.generate([prompts[0]], params)[0]
    assert out.token_ids == [first] and out.text == tok.decode([first])
    streamed = list(smol.stream(prompts[0], params))
    assert "".join(o.new_text for o in streamed) == out.text


def test_stop_token_ids_and_max_tokens_and_eos(smol, prompts):
    full = smol.generate([prompts[1]], GREEDY)[0]
    stopped = smol.generate([prompts[1]], SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[full.token_ids[5]]))[0]
    first = full.token_ids.index(full.token_ids[5])
    assert stopped.token_ids == full.token_ids[:first + 1] and stopped.finish_reason == "stop"
    # the stop token adds no text unless include_stop_str_in_output (vLLM's rule)
    assert stopped.text == smol.tokenizer.decode(full.token_ids[:first])
    kept = smol.generate([prompts[1]], SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[full.token_ids[5]],
        include_stop_str_in_output=True))[0]
    assert kept.token_ids == stopped.token_ids
    assert stopped.stop_reason == kept.stop_reason == full.token_ids[5]  # vLLM's stop_reason
    assert kept.text == smol.tokenizer.decode(full.token_ids[:first + 1]) != stopped.text
    short = smol.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"
    chat = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    ended = smol.generate(chat, SamplingParams(temperature=0.0, max_tokens=200))[0]
    assert ended.finish_reason == "stop" and ended.token_ids[-1] in smol.tokenizer.eos_token_ids
    assert ended.stop_reason is None and short.stop_reason is None  # an EOS, the length


def test_eos_adds_no_text_and_a_stream_never_shows_a_stop_strings_start(smol, prompts):
    """With special tokens kept, the EOS that ends an output adds no text (as the gateway and
    vLLM do) unless include_stop_str_in_output; a streamed output holds back what could begin a stop string, so its deltas add
    up to the cut text and no output along the way shows text past the cut."""
    chat = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    kept = smol.generate(chat, SamplingParams(temperature=0.0, max_tokens=200,
                                              skip_special_tokens=False))[0]
    assert kept.finish_reason == "stop" and kept.token_ids[-1] in smol.tokenizer.eos_token_ids
    assert kept.text == smol.tokenizer.decode(kept.token_ids[:-1], skip_special_tokens=False)
    shown = smol.generate(chat, SamplingParams(temperature=0.0, max_tokens=200,  # (vLLM's rule)
                                               skip_special_tokens=False,
                                               include_stop_str_in_output=True))[0]
    assert shown.text == smol.tokenizer.decode(kept.token_ids, skip_special_tokens=False)
    text = smol.generate([prompts[3]], GREEDY)[0].text
    stop = text[len(text) // 2:len(text) // 2 + 4]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    streamed = list(smol.stream(prompts[3], params))
    assert "".join(o.new_text for o in streamed) == streamed[-1].text == text[:text.index(stop)]
    assert streamed[-1].stop_reason == stop and streamed[-2].stop_reason is None
    assert all(streamed[-1].text.startswith(o.text) for o in streamed)  # nothing past the cut


def test_each_streamed_output_keeps_what_it_had_when_it_was_made(smol, prompts):
    """Outputs read their ids, logprobs and text from the request when asked: read after the
    request ends, each still holds its own first n tokens, their logprobs and its text."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    streamed = list(smol.stream(prompts[1], params))
    final = streamed[-1]
    assert [len(o.token_ids) for o in streamed] == list(range(1, 13))
    for o in streamed:
        n = len(o.token_ids)
        assert o.token_ids == final.token_ids[:n] and o.logprobs == final.logprobs[:n]
        assert o.new_logprobs == final.logprobs[n - 1:n]
        assert o.text == "".join(s.new_text for s in streamed[:n])


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives(smol, prompts):
    out = smol.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids) == 4
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id and len(lp.top) == 3
        assert lp.top[0][0] == token_id and lp.top[0][1] == pytest.approx(lp.logprob)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob <= 0.0


def test_context_length_ends_generation(default_model_dir):
    engine = Engine(default_model_dir, device="cpu", max_total_tokens=512, context_length=24)
    prompt = engine.tokenizer.encode("One two three four five six seven eight")
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 24
    with pytest.raises(ValueError, match="prompt has 30 tokens; the context length is 24"):
        engine.add_request(list(range(100, 130)))


def test_a_kv_cache_smaller_than_the_context_limits_requests(default_model_dir, caplog):
    """A pool of 64 tokens under the model's 8,192-token context: requests are limited to the
    pool (a longer one could only be cut short), with a warning that says what to change."""
    with caplog.at_level("WARNING"):
        engine = Engine(default_model_dir, device="cpu", max_total_tokens=64, page_size=16)
    assert engine.max_model_len == 64 and "requests are limited to 64 tokens" in caplog.text
    prompt = list(range(100, 140))
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 64
    with pytest.raises(ValueError, match="prompt has 64 tokens; the context length is 64"):
        engine.add_request(list(range(100, 164)))


def test_logit_bias_outside_the_vocabulary_is_refused(smol):
    vocab = smol.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside the vocabulary"):
        smol.add_request([1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert not smol.has_unfinished()


def test_async_stream_deltas_add_up_and_early_exit_aborts(default_model_dir, smol, prompts):
    engine = Engine(default_model_dir, device="cpu", max_total_tokens=2048)
    final = smol.generate([prompts[2]], GREEDY)[0]

    async def main():
        aengine = AsyncEngine(engine)
        deltas, ids = [], []
        async for out in aengine.generate(prompts[2], GREEDY, request_id="a"):
            deltas.append(out.new_text)
            ids += out.new_token_ids
        assert "".join(deltas) == final.text and ids == final.token_ids
        async for out in aengine.generate(prompts[2], GREEDY, request_id="b"):
            break  # a client that goes away
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not engine.has_unfinished():
                break

    asyncio.run(main())
    assert_all_pages_free(engine)
