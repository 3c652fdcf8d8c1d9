"""bench/serving.py's multi-turn dataset: chat conversations that share one system prompt, and
what their turns measure.

Turn t's request is the chat history -- the system prompt, every earlier user message and the
model's actual answer to it -- plus a new user message; bench/serving.py sends a turn when the
previous one has finished (and --think-time has passed), so each conversation is a closed loop
and its prompt grows by one answer and one message a turn: what a prefix cache and sticky routing
are for. Messages are text made of "word tokens" (ids whose text is a space and an ASCII word
that encodes back to that one id): a BPE pre-tokenizer splits before each space, so a message of
n of them is n tokens under the served tokenizer, and the chat template adds a few per message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd_serve.planner.metrics import RequestRecord, summarize_ms
from pd_serve.planner.workload import FIRST_REGULAR_ID

NUM_WORDS = 4096                 # word tokens to draw messages from
TEMPLATE_TOKENS_PER_MESSAGE = 8  # a bound on what a chat template adds around one message


@dataclass(frozen=True)
class Conversation:
    """One conversation: the shared system prompt, a user message per turn, and the output
    tokens asked for each turn (ignore_eos)."""

    system: str
    user_messages: list[str]
    output_len: int


def word_tokens(tokenizer, limit: int = NUM_WORDS) -> list[str]:
    """Up to `limit` token texts of the form " word" (ASCII letters) that encode to one id."""
    words = []
    for token_id in range(FIRST_REGULAR_ID, tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if (len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
                and tokenizer.encode(text, add_special_tokens=False) == [token_id]):
            words.append(text)
            if len(words) == limit:
                break
    if not words:
        raise ValueError("the tokenizer has no ' word' tokens to build messages from")
    return words


def random_text(rng: np.random.Generator, words: list[str], num_tokens: int) -> str:
    """`num_tokens` word tokens drawn uniformly, as one string (it starts with a space)."""
    return "".join(words[i] for i in rng.integers(0, len(words), num_tokens))


def multi_turn_dataset(rng: np.random.Generator, words: list[str], num_conversations: int,
                       num_turns: int, system_prompt_len: int, turn_len: int,
                       output_len: int) -> list[Conversation]:
    """`num_conversations` conversations of `num_turns` turns under one shared system prompt
    of `system_prompt_len` tokens (none when 0); each user message is `turn_len` tokens."""
    system = random_text(rng, words, system_prompt_len)
    return [Conversation(system, [random_text(rng, words, turn_len) for _ in range(num_turns)],
                         output_len) for _ in range(num_conversations)]


def max_conversation_len(num_turns: int, system_prompt_len: int, turn_len: int, output_len: int) -> int:
    """A bound on the last turn's prompt plus its output, in tokens."""
    return (system_prompt_len + num_turns * (turn_len + output_len)
            + (2 * num_turns + 1) * TEMPLATE_TOKENS_PER_MESSAGE)


def turn_messages(conversation: Conversation, answers: list[str]) -> list[dict]:
    """Turn len(answers)'s chat messages: the system prompt (when there is one), each earlier
    user message followed by the model's answer to it, and this turn's user message."""
    messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
    for user, answer in zip(conversation.user_messages, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": conversation.user_messages[len(answers)]}]


def turn_metrics(turns: list[list[RequestRecord]]) -> dict:
    """Per turn over the completed requests (turns[c][t]: conversation c's turn t): TTFT stats,
    mean prompt and cached tokens (usage), and mean KV bytes the prefill sent (the gateway's
    `timings.transfer_bytes`, 1P1D only); TTFT of first turns against all later ones."""
    num_turns = max((len(c) for c in turns), default=0)
    by_turn = []
    for t in range(num_turns):
        done = [c[t] for c in turns if t < len(c) and c[t].success]
        by_turn.append({"turn": t + 1, "completed": len(done),
                        "ttft_ms": summarize_ms([r.ttft for r in done]),
                        "mean_prompt_tokens": _mean([r.input_tokens for r in done]),
                        "mean_cached_tokens": _mean([r.num_cached_tokens for r in done]),
                        "mean_kv_transfer_bytes": _mean([(r.server_timings or {}).get("transfer_bytes")
                                                         for r in done])})
    later = [r.ttft for c in turns for r in c[1:] if r.success]
    return {"ttft_ms_first_turn": summarize_ms([c[0].ttft for c in turns if c and c[0].success]),
            "ttft_ms_later_turns": summarize_ms(later), "by_turn": by_turn}


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None
