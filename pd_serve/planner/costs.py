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
    pipeline  where the profile has host_s / device_s on its prefill and mixed points (a GPU
        engine that runs the overlap schedule), the step's two parts under that schedule:
        host_time(tokens) the host's planning and launch (piecewise-linear in the step's tokens),
        and `device`, the same models fitted to each point's device time. A point's device time
        is its whole-step time_s where the device is the slower part (a lone or sustained step is
        then the device's), else its device_s: a step of 16 tokens is 16-18 ms of eager launches
        for 4.8 ms of device work (an H200), and the launches hide behind the step before
        (simulator.py).

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
    pipeline: "Pipeline | None" = None

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

    def pipelined_step(self, prefill_tokens: int, pairs: int, batch: int,
                       context: float) -> tuple[float, float]:
        """(host, device) seconds of one step under the overlap schedule. A decode-only step is
        its measured period on the device (its points were timed back to back, as a worker runs
        them: whatever the launch costs is in it); a step with prompt tokens runs eagerly, its
        host launch time and device time apart."""
        if not prefill_tokens:
            return 0.0, self.decode_step(batch, context)
        return (self.pipeline.host_time(prefill_tokens + batch),
                self.pipeline.device.step_time(prefill_tokens, pairs, batch, context))

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
        model = dataclasses.replace(model, overlap_s=overlap, **overrides)
        prefill, mixed = profile["prefill"]["points"], profile.get("mixed", {}).get("points", [])
        if any(p.get("device_s") is None for p in prefill + mixed):
            return model
        device = {**profile, "prefill": {"points": [_device_point(p) for p in prefill]},
                  "mixed": {"points": [_device_point(p) for p in mixed]}}
        tokens = sorted({p["num_tokens"] for p in prefill})
        host_s = tuple(float(np.mean([p["host_s"] for p in prefill if p["num_tokens"] == t]))
                       for t in tokens)
        pipeline = Pipeline(cls.from_profile(device, **overrides), tuple(map(float, tokens)), host_s)
        return dataclasses.replace(model, pipeline=pipeline)


@dataclass(frozen=True)
class Pipeline:
    """A step's host and device parts under the overlap schedule (module docstring)."""

    device: CostModel  # fitted to the points' device times
    host_tokens: tuple[float, ...]  # grid of a step's tokens (prompt tokens + decode rows)
    host_s: tuple[float, ...]  # the host's planning and launch time at that grid

    def host_time(self, num_tokens: int) -> float:
        return interp(num_tokens, self.host_tokens, self.host_s)


def _device_point(point: dict) -> dict:
    """The point with time_s its device's: the whole step where the device is the slower part."""
    whole = {k: v for k, v in point.items() if k not in ("host_s", "device_s")}
    if point["device_s"] < point["host_s"]:
        whole["time_s"] = point["device_s"]
    return whole


def load_profile(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--profile {path}: no such file (record one with pd-serve profile)")
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"--profile {path}: not JSON ({e}); record one with pd-serve profile") from None
    if not isinstance(profile, dict) or profile.get("kind") != "pd-serve-profile":
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
