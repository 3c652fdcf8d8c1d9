"""The requests of a serving workload: prompts of a dataset and their arrival times.

`pd-serve plan` simulates exactly what bench/serving.py sends for the same flags and --seed:
both draw the prompts and arrivals here, in the same order from one numpy Generator.
Datasets (prompts of random token ids): random (uniform lengths), sharegpt (lengths from the
shipped table sharegpt_lengths.json), shared-prefix (groups sharing a prefix).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASETS = ("random", "sharegpt", "shared-prefix")
SHAREGPT_LENGTHS = Path(__file__).resolve().parent / "sharegpt_lengths.json"
FIRST_REGULAR_ID = 100  # random prompts leave out ids below this (special tokens live there)


@dataclass(frozen=True)
class Prompt:
    """One request: token ids (sent as they are to /v1/completions, decoded for chat)."""

    token_ids: list[int]
    output_len: int


def uniform_lengths(rng: np.random.Generator, length: int, range_ratio: float, num: int) -> np.ndarray:
    """`num` integers uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    low = max(1, math.ceil(length * (1 - range_ratio)))
    high = max(low, math.floor(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, num)


def random_ids(rng: np.random.Generator, num: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_REGULAR_ID, vocab_size, num).tolist()


def random_dataset(rng: np.random.Generator, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float, vocab_size: int) -> list[Prompt]:
    inputs = uniform_lengths(rng, input_len, range_ratio, num_prompts)
    outputs = uniform_lengths(rng, output_len, range_ratio, num_prompts)
    return [Prompt(random_ids(rng, int(i), vocab_size), int(o)) for i, o in zip(inputs, outputs)]


def sharegpt_dataset(rng: np.random.Generator, num_prompts: int, vocab_size: int,
                     max_model_len: int | None, path: Path = SHAREGPT_LENGTHS) -> list[Prompt]:
    """Random-id prompts with (input, output) lengths from the shipped ShareGPT-like table.

    Pairs that do not fit in `max_model_len` are left out; the rest are shuffled and taken in
    turn (again from the start when `num_prompts` exceeds them).
    """
    pairs = json.loads(path.read_text(encoding="utf-8"))["pairs"]
    fits = [(i, o) for i, o in pairs if max_model_len is None or i + o <= max_model_len]
    if not fits:
        raise ValueError(f"no (input, output) pair in {path.name} fits max_model_len={max_model_len}")
    order = rng.permutation(len(fits))
    picks = [fits[order[k % len(fits)]] for k in range(num_prompts)]
    return [Prompt(random_ids(rng, i, vocab_size), o) for i, o in picks]


def shared_prefix_dataset(rng: np.random.Generator, num_prompts: int, num_prefixes: int,
                          prefix_len: int, suffix_len: int, output_len: int,
                          vocab_size: int) -> list[Prompt]:
    """`num_prefixes` groups sharing a `prefix_len`-id prefix, each prompt with its own
    `suffix_len`-id suffix; group sizes differ by at most one, and the groups are interleaved
    in a random order."""
    prefixes = [random_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    groups = rng.permutation(np.arange(num_prompts) % num_prefixes)
    return [Prompt(prefixes[g] + random_ids(rng, suffix_len, vocab_size), output_len) for g in groups]


def arrival_offsets(rng: np.random.Generator, num: int, request_rate: float,
                    burstiness: float) -> np.ndarray:
    """Send times (s) from the start: the first at 0, then gamma-distributed gaps with shape
    `burstiness` and mean 1 / rate (burstiness 1: a Poisson process); all at 0 for rate inf."""
    if math.isinf(request_rate):
        return np.zeros(num)
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def make_prompts(args: argparse.Namespace, rng: np.random.Generator, max_model_len: int | None) -> list[Prompt]:
    if args.dataset == "random":
        return random_dataset(rng, args.num_prompts, args.input_len, args.output_len,
                              args.range_ratio, args.vocab_size)
    if args.dataset == "sharegpt":
        return sharegpt_dataset(rng, args.num_prompts, args.vocab_size, max_model_len, args.sharegpt_lengths)
    return shared_prefix_dataset(rng, args.num_prompts, args.num_prefixes, args.prefix_len,
                                 args.suffix_len, args.output_len, args.vocab_size)


def add_workload_args(parser: argparse.ArgumentParser, datasets: tuple[str, ...] = DATASETS) -> None:
    """The workload's flags, as bench/serving.py takes them (defaults included); `datasets`:
    the --dataset choices (bench/serving.py adds its closed-loop multi-turn)."""
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: %(default)s)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps between requests: 1 is Poisson, < 1 burstier, "
                             "> 1 steadier (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default: %(default)s)")
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", choices=datasets, default="random", help="(default: %(default)s)")
    g.add_argument("--input-len", type=int, default=1024, help="random: prompt ids (default: %(default)s)")
    g.add_argument("--output-len", type=int, default=128,
                   help="random, shared-prefix: output tokens (default: %(default)s)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len * (1 - r), len * (1 + r)] (default: %(default)s)")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: groups (default: %(default)s)")
    g.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: ids shared by a group (default: %(default)s)")
    g.add_argument("--suffix-len", type=int, default=64,
                   help="shared-prefix: ids of each prompt's own (default: %(default)s)")
    g.add_argument("--sharegpt-lengths", type=Path, default=SHAREGPT_LENGTHS,
                   help="sharegpt: JSON table of (input, output) lengths (default: the shipped "
                        "pd_serve/planner/sharegpt_lengths.json)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="sharegpt: leave out longer pairs (default: max_model_len from /v1/models)")
    g.add_argument("--vocab-size", type=int, default=49152,
                   help=f"prompt ids are drawn from [{FIRST_REGULAR_ID}, this) (default: %(default)s)")
