"""Step-time models fitted to a recorded profile (`pd-serve profile`): what the simulator charges.

    prefill_time(tokens, pairs) = base(tokens) + attn_s_per_pair * pairs
        base: piecewise-linear in the batch's prompt tokens; pairs: query-key pairs the
        attention computes, sum over rows of new_tokens * seq_len. attn_s_per_pair is fitted from
        the prompt mixes (one long prompt vs several short ones of the same total); 0 with one mix.
    decode_step(batch, ctx) = bilinear interpolation over the measured (batch, context) grid.
    step_time(...)  a colocated step mixing a prefill chunk and decodes runs one forward, not two:
        prefill_time + decode_step - overlap_s, where overlap_s (the fixed per-forward cost that
        the sum would count twice) is fitted from the profile's mixed steps; 0 without them.
    transfer_time(tokens) = latency_s + tokens * bytes_per_token / (gbps * 1e9).

Outside a grid the models clamp at the low end and extrapolate the last segment at the high end.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def interp(x: float, xs, ys) -> float:
    """Piecewise-linear through (xs, ys), xs increasing; clamped below, extrapolated above."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    if x <= xs[-1]:
        return float(np.interp(x, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (x - xs[-1]))


def attn_pairs(rows) -> int:
    """Query-key pairs of a batch's prefill rows, each (num_new, seq_len): sum of num_new * seq_len."""
    return sum(num_new * seq_len for num_new, seq_len in rows)


@dataclass(frozen=True)
class CostModel:
    prefill_tokens: tuple[float, ...]  # grid of batched prompt tokens
    prefill_base_s: tuple[float, ...]  # base(tokens) at that grid
    attn_s_per_pair: float
    decode_batches: tuple[float, ...]
    decode_contexts: tuple[float, ...]
    decode_s: tuple[tuple[float, ...], ...]  # [batch][context]
    overlap_s: float = 0.0
    bytes_per_token: int = 0
    transfer_gbps: float = float("inf")
    transfer_latency_s: float = 0.0

    def prefill_time(self, num_tokens: int, pairs: int = 0) -> float:
        return interp(num_tokens, self.prefill_tokens, self.prefill_base_s) + self.attn_s_per_pair * pairs

    def decode_step(self, batch: int, context: float) -> float:
        per_batch = [interp(context, self.decode_contexts, row) for row in self.decode_s]
        return interp(batch, self.decode_batches, per_batch)

    def step_time(self, prefill_tokens: int, pairs: int, batch: int, context: float) -> float:
        """One engine step: a prefill part, a decode part, or both (one forward)."""
        if not batch:
            return self.prefill_time(prefill_tokens, pairs)
        decode = self.decode_step(batch, context)
        if not prefill_tokens:
            return decode
        return self.prefill_time(prefill_tokens, pairs) + decode - min(self.overlap_s, decode)

    def transfer_time(self, num_tokens: int) -> float:
        return self.transfer_latency_s + num_tokens * self.bytes_per_token / (self.transfer_gbps * 1e9)

    @classmethod
    def load(cls, path: str | Path, **overrides) -> "CostModel":
        return cls.from_profile(load_profile(path), **overrides)

    @classmethod
    def from_profile(cls, profile: dict, **overrides) -> "CostModel":
        """Fits the models to a profile's JSON; `overrides` replace fields (e.g. transfer_gbps)."""
        tokens, base, per_pair = fit_prefill(profile["prefill"]["points"])
        d = profile["decode"]
        model = cls(tokens, base, per_pair, tuple(d["batch_sizes"]), tuple(d["context_lens"]),
                    tuple(tuple(row) for row in d["time_s"]),
                    bytes_per_token=profile["kv"]["bytes_per_token"],
                    transfer_gbps=profile["transfer"]["gbps"],
                    transfer_latency_s=profile["transfer"]["latency_s"])
        overlaps = [model.prefill_time(p["prefill_tokens"], p["attn_pairs"])
                    + model.decode_step(p["batch_size"], p["context_len"]) - p["time_s"]
                    for p in profile.get("mixed", {}).get("points", [])]
        overlap = max(0.0, float(np.mean(overlaps))) if overlaps else 0.0
        return dataclasses.replace(model, overlap_s=overlap, **overrides)


def load_profile(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--profile {path}: no such file (record one with pd-serve profile)")
    profile = json.loads(path.read_text(encoding="utf-8"))
    if profile.get("kind") != "pd-serve-profile":
        raise ValueError(f"--profile {path}: not a pd-serve profile (no kind: pd-serve-profile)")
    return profile


def fit_prefill(points: list[dict]) -> tuple[tuple, tuple, float]:
    """Least squares, in relative error, for time = base[tokens] + c * pairs: one base per
    measured token count and one c.

    c is identified only where a token count was measured with different prompt mixes; without
    that (or if the fit makes c negative) c = 0 and base is the mean time per token count.
    """
    tokens = sorted({p["num_tokens"] for p in points})
    index = {t: i for i, t in enumerate(tokens)}
    times = np.array([p["time_s"] for p in points], dtype=float)
    pairs = np.array([p["attn_pairs"] for p in points], dtype=float)
    design = np.zeros((len(points), len(tokens) + 1))
    for row, p in enumerate(points):
        design[row, index[p["num_tokens"]]] = 1.0
    design[:, -1] = pairs
    if any(len({p["attn_pairs"] for p in points if p["num_tokens"] == t}) > 1 for t in tokens):
        solution = np.linalg.lstsq(design / times[:, None], np.ones_like(times), rcond=None)[0]
        if solution[-1] >= 0:
            return tuple(map(float, tokens)), tuple(map(float, solution[:-1])), float(solution[-1])
    base = tuple(float(times[design[:, i] == 1].mean()) for i in range(len(tokens)))
    return tuple(map(float, tokens)), base, 0.0
