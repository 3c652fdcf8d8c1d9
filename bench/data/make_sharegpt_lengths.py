"""Writes pd_serve/planner/sharegpt_lengths.json, the sharegpt dataset's table: 1000 synthetic
(input, output) token-length pairs.

Not drawn from the ShareGPT data (nothing is downloaded): each length is an independent
log-normal draw whose mean matches the ShareGPT averages reported in the vLLM paper (Kwon et al.,
SOSP 2023: 161 input and 338 output tokens per request), with a long right tail (input sigma
1.2, output sigma 0.9), rounded and clipped to [4, 4096] input and [4, 2048] output tokens. The
mean of a log-normal is exp(mu + sigma^2 / 2), so mu = ln(mean) - sigma^2 / 2.

    python bench/data/make_sharegpt_lengths.py      # rewrites the table (same seed, same table)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

SEED = 20240601
NUM_PAIRS = 1000
INPUT = {"mean": 161.0, "sigma": 1.2, "min": 4, "max": 4096}
OUTPUT = {"mean": 338.0, "sigma": 0.9, "min": 4, "max": 2048}


def draw(rng: np.random.Generator, spec: dict, n: int) -> np.ndarray:
    mu = math.log(spec["mean"]) - spec["sigma"] ** 2 / 2
    return np.clip(np.rint(rng.lognormal(mu, spec["sigma"], n)), spec["min"], spec["max"]).astype(int)


def main() -> None:
    rng = np.random.default_rng(SEED)
    inputs, outputs = draw(rng, INPUT, NUM_PAIRS), draw(rng, OUTPUT, NUM_PAIRS)
    table = {
        "description": "Synthetic ShareGPT-like request lengths in tokens, made by "
                       "bench/data/make_sharegpt_lengths.py (its docstring says how); not real data.",
        "seed": SEED, "input": INPUT, "output": OUTPUT,
        "stats": {"input_mean": round(float(inputs.mean()), 1), "input_median": float(np.median(inputs)),
                  "output_mean": round(float(outputs.mean()), 1), "output_median": float(np.median(outputs))},
        "columns": ["input_len", "output_len"],
        "pairs": [[int(i), int(o)] for i, o in zip(inputs, outputs)],
    }
    path = Path(__file__).resolve().parents[2] / "pd_serve" / "planner" / "sharegpt_lengths.json"
    # one pair per line: readable, and small diffs if the recipe changes
    head = json.dumps({k: v for k, v in table.items() if k != "pairs"}, indent=2)[:-2]
    rows = ",\n".join("    " + json.dumps(p) for p in table["pairs"])
    path.write_text(f'{head},\n  "pairs": [\n{rows}\n  ]\n}}\n', encoding="utf-8")
    print(f"wrote {path}: {table['stats']}")


if __name__ == "__main__":
    main()
