"""bench/serving.py's multi-turn dataset (bench/multi_turn.py) and its reports, without a server;
tests/bench/test_serving_bench.py runs it against a real cluster."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # bench/ (a checkout need not install it)

from bench import multi_turn  # noqa: E402
from bench.serving import build_parser, cache_summary, counter_deltas, make_conversations  # noqa: E402
from pd_serve.planner.metrics import RequestRecord  # noqa: E402

WORDS = [" alpha", " beta", " gamma", " delta"]


def test_dataset_shares_the_system_prompt_and_sizes_messages():
    convs = multi_turn.multi_turn_dataset(np.random.default_rng(0), WORDS, num_conversations=5,
                                          num_turns=3, system_prompt_len=40, turn_len=7, output_len=9)
    assert len(convs) == 5 and len({c.system for c in convs}) == 1
    assert len(convs[0].system.split()) == 40
    for c in convs:
        assert len(c.user_messages) == 3 and c.output_len == 9
        assert all(len(m.split()) == 7 and set(m.split()) <= {w.strip() for w in WORDS}
                   for m in c.user_messages)
    assert len({m for c in convs for m in c.user_messages}) == 15  # every message its own
    same = multi_turn.multi_turn_dataset(np.random.default_rng(0), WORDS, 5, 3, 40, 7, 9)
    assert same == convs  # the seed fixes the dataset
    assert multi_turn.multi_turn_dataset(np.random.default_rng(0), WORDS, 1, 2, 0, 3, 1)[0].system == ""


def test_turn_messages_hold_the_history():
    conv = multi_turn.Conversation("SYS", ["u1", "u2", "u3"], output_len=4)
    assert multi_turn.turn_messages(conv, []) == [{"role": "system", "content": "SYS"},
                                                  {"role": "user", "content": "u1"}]
    third = multi_turn.turn_messages(conv, ["a1", "a2"])
    assert [(m["role"], m["content"]) for m in third] == [
        ("system", "SYS"), ("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2"),
        ("user", "u3")]
    # each turn's messages start with the previous turn's: the prompt grows as a prefix
    second = multi_turn.turn_messages(conv, ["a1"])
    assert third[:len(second)] == second
    no_system = multi_turn.Conversation("", ["u1"], 4)
    assert multi_turn.turn_messages(no_system, []) == [{"role": "user", "content": "u1"}]


def test_word_tokens_give_exact_token_counts():
    """Under the served tokenizer a message of n word tokens is n tokens, and the rendered chat
    prompt of a turn starts with the previous turn's prompt and its answer."""
    from bench.serving import load_tokenizer
    tokenizer = load_tokenizer(None)
    words = multi_turn.word_tokens(tokenizer, limit=500)
    assert len(words) == 500 and all(w[0] == " " and w[1:].isalpha() for w in words)
    rng = np.random.default_rng(3)
    for n in (1, 17, 256):
        text = multi_turn.random_text(rng, words, n)
        assert len(tokenizer.encode(text, add_special_tokens=False)) == n
    conv = multi_turn.multi_turn_dataset(rng, words, 1, 3, 64, 16, 8)[0]
    answers = [multi_turn.random_text(rng, words, 8) for _ in range(2)]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(multi_turn.turn_messages(conv, answers[:t])),
                                add_special_tokens=False) for t in range(3)]
    for t in range(3):
        assert 64 + 16 * (t + 1) + 8 * t <= len(prompts[t]) <= multi_turn.max_conversation_len(t + 1, 64, 16, 8)
    for earlier, later in zip(prompts, prompts[1:]):
        assert later[:len(earlier)] == earlier


def test_make_conversations_checks_the_context():
    args = build_parser().parse_args(["--dataset", "multi-turn", "--num-conversations", "2", "--num-turns", "3",
                                      "--system-prompt-len", "32", "--turn-len", "8", "--output-len", "4"])
    convs, turns = make_conversations(args, np.random.default_rng(0), max_model_len=4096)
    assert len(convs) == 2 and [len(c) for c in turns] == [3, 3]
    assert [r.prompt_len for r in turns[0]] == [32 + 8, 32 + 12 + 8, 32 + 24 + 8]
    assert all(r.max_tokens == 4 for c in turns for r in c)
    with pytest.raises(ValueError, match="max_model_len"):
        make_conversations(args, np.random.default_rng(0), max_model_len=64)


def _record(ttft: float, prompt: int, cached: int | None, transfer: int | None = None, ok: bool = True):
    return RequestRecord(prompt, 4, send_time=1.0, chunk_times=[1.0 + ttft, 1.0 + ttft + 0.1] if ok else [],
                         num_output_tokens=2, num_prompt_tokens=prompt, num_cached_tokens=cached,
                         server_timings=None if transfer is None else {"transfer_bytes": transfer},
                         error=None if ok else "HTTP 500")


def test_turn_metrics_and_cache_summary():
    turns = [[_record(0.4, 100, 0, 1000), _record(0.1, 200, 96, 200)],
             [_record(0.6, 100, 64, 600), _record(0.2, 210, None, None)],
             [_record(0.5, 100, 0, ok=False), _record(9.0, 300, 0, ok=False)]]
    m = multi_turn.turn_metrics(turns)
    assert m["ttft_ms_first_turn"]["median"] == pytest.approx(500.0)
    assert m["ttft_ms_later_turns"]["median"] == pytest.approx(150.0)
    first, second = m["by_turn"]
    assert (first["turn"], first["completed"], second["completed"]) == (1, 2, 2)
    assert first["mean_prompt_tokens"] == 100 and second["mean_prompt_tokens"] == 205
    assert first["mean_cached_tokens"] == 32 and second["mean_cached_tokens"] == 96  # None left out
    assert first["mean_kv_transfer_bytes"] == 800 and second["mean_kv_transfer_bytes"] == 200

    records = [r for c in turns for r in c]
    assert cache_summary(records) == {"prompt_tokens": 610, "cached_tokens": 160,
                                      "cached_fraction": pytest.approx(160 / 610)}
    assert cache_summary([_record(0.1, 50, None)])["cached_tokens"] is None


def test_counter_deltas():
    before = {"prefix_cache_hit_tokens": {"prefill-0": 10.0}}
    after = {"prefix_cache_hit_tokens": {"prefill-0": 50.0, "prefill-1": 5.0},
             "kv_transfer_bytes": {"prefill-0": 4096.0}}
    assert counter_deltas(before, after) == {
        "prefix_cache_hit_tokens": {"total": 45.0, "by_worker": {"prefill-0": 40.0, "prefill-1": 5.0}},
        "kv_transfer_bytes": {"total": 4096.0, "by_worker": {"prefill-0": 4096.0}}}
    assert counter_deltas(None, after) is None and counter_deltas(before, None) is None


def test_multi_turn_flags():
    args = build_parser().parse_args(["--dataset", "multi-turn"])
    assert (args.num_turns, args.system_prompt_len, args.turn_len, args.think_time) == (8, 1024, 256, 0.0)
    assert args.num_conversations == 16 and args.dataset == "multi-turn"


def test_summary_table_has_turns_and_cache():
    from bench.serving import format_summary
    from pd_serve.planner.metrics import compute_metrics
    turns = [[_record(0.4, 100, 0), _record(0.1, 200, 96)]]
    m = compute_metrics([r for c in turns for r in c], duration_s=1.0)
    m |= {"multi_turn": multi_turn.turn_metrics(turns), "cache": cache_summary(turns[0]),
          "server": {"prefix_cache_hit_tokens": {"total": 96.0, "by_worker": {"colocated-0": 96.0}}}}
    table = format_summary(m)
    for line in ("Median TTFT, first turns (ms):", "Median TTFT, turn 2 (ms):", "Cached tokens (usage):"):
        assert line in table
    assert [line.split()[-1] for line in table.splitlines() if line.startswith("Prefix cache hit")] == ["96"]
