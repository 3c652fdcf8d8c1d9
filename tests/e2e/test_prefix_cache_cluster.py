"""The prefix cache in real clusters, through the official openai client: multi-turn chats that
share a system prompt give the same greedy answers with the cache on (colocated, 2P2D with
decode-side reuse) as with --disable-radix-cache (1P1D); later turns report their cached tokens
(usage.prompt_tokens_details.cached_tokens, timings), a conversation's turns stay on the decode
worker that holds it, only their new pages cross, and no page stays held by a request."""

from __future__ import annotations

import openai
import pytest

from cluster_helpers import metrics, start_cluster, wait_idle

SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, "
          "name the warehouse you would use, and never invent tracking numbers. The warehouses "
          "are in Rotterdam, Singapore, Santos, Durban and Long Beach; each ships every weekday "
          "and holds parcels for up to fourteen days before they are returned to the sender.")
QUESTIONS = [["Where should a parcel for Chile go?", "And one for Kenya?", "How long is it held?"],
             ["Which warehouse serves Japan?", "Does it ship on Sundays?", "What about Brazil?"]]
MAX_TOKENS = 8


def chat(cluster) -> tuple[list[list[str]], list[list[dict]]]:
    """The conversations turn by turn (each turn's prompt: the history and a new question);
    per turn, its answer and a dict of usage and timings."""
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    histories = [[{"role": "system", "content": SYSTEM}] for _ in QUESTIONS]
    answers, stats = [[] for _ in QUESTIONS], [[] for _ in QUESTIONS]
    for turn in range(len(QUESTIONS[0])):
        for c, questions in enumerate(QUESTIONS):
            histories[c].append({"role": "user", "content": questions[turn]})
            out = client.chat.completions.create(model=model, messages=histories[c],
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True})
            text = out.choices[0].message.content
            histories[c].append({"role": "assistant", "content": text})
            answers[c].append(text)
            stats[c].append({"prompt": out.usage.prompt_tokens,
                             "cached": out.usage.prompt_tokens_details.cached_tokens,
                             **out.model_extra["timings"]})
    return answers, stats


def assert_settled(cluster) -> None:
    state = wait_idle(cluster)
    assert all(used == 0 for used, _ in state.values()), f"pages held with nothing running: {state}"


@pytest.fixture(scope="module")
def reference():
    cluster = start_cluster(1, 1, extra=["--disable-radix-cache"])
    try:
        answers, stats = chat(cluster)
        assert all(s["cached"] == 0 and s["decode_cached_tokens"] == 0 for c in stats for s in c)
        return answers
    finally:
        cluster.stop()


def test_colocated_cache_gives_the_same_answers_and_reports_cached_tokens(reference):
    cluster = start_cluster(0, 0, num_colocated=1)
    try:
        answers, stats = chat(cluster)
        assert answers == reference
        assert stats[1][0]["cached"] >= 32  # the shared system prompt's first pages
        for conversation in stats:
            for s in conversation[1:]:  # the earlier turns' prompt, in whole pages
                assert s["cached"] % 16 == 0 and s["cached"] == s["cached_tokens"] > s["prompt"] // 2
        assert_settled(cluster)
    finally:
        cluster.stop()


def test_2p2d_decode_side_reuse_moves_only_new_pages(reference):
    cluster = start_cluster(2, 2)
    try:
        answers, stats = chat(cluster)
        assert answers == reference
        for conversation in stats:
            first = conversation[0]
            assert first["transferred_tokens"] == first["prompt"] - first["decode_cached_tokens"]
            for before, s in zip(conversation, conversation[1:]):
                # the decode worker of the turn before holds that turn's prompt in whole pages
                # (a page less if the answer's first token merges with the template's last):
                # the conversation stayed on it
                held = min(before["prompt"] // 16, (s["prompt"] - 1) // 16) * 16
                assert s["decode_cached_tokens"] >= held - 16
                assert s["transferred_tokens"] == s["prompt"] - s["decode_cached_tokens"]
                assert s["transferred_tokens"] < s["prompt"] // 2
                assert s["cached"] > 0  # prefill's own cache: the prompt of the turn before
        m = metrics(cluster.base_url)
        hits = {w: v for (name, w), v in m.items() if name == "pd_serve:prefix_cache_hit_tokens_total"}
        assert sum(v for w, v in hits.items() if w.startswith("decode")) > 0
        assert_settled(cluster)
    finally:
        cluster.stop()
