"""bench/one_batch.py's figures and report: what a case's numbers mean (FLOP and byte
accounting, floors, DEFINITIONS), the run's record (Bench: each case's progress line, errors and
the JSON rewritten after every case), the --profile host and kernel profiles, and the table
printed at the end."""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench._common import sync, write_json
from pd_serve.engine.core import EngineCore
from pd_serve.model.config import ModelConfig

# ----------------------------------------------------------------------------- accounting

def param_counts(model: torch.nn.Module) -> dict:
    """Parameters by role: every one (tied ones once), decoder linear layers a token runs
    through (an MoE layer: the router and its top-k experts), the LM head, every expert, and
    the parameters a token uses ("active": all but the experts it is not routed to)."""
    cfg = model.config
    with torch.device("meta"):  # from the shape, so quantized layers (buffers) count the same
        total = sum(p.numel() for p in type(model)(cfg).parameters())
    h = cfg.hidden_size
    attention = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    per_expert = 3 * h * cfg.moe_intermediate_size
    shared = cfg.shared_expert_intermediate_size
    linear = experts = 0
    for layer in range(cfg.num_layers):
        if cfg.is_moe_layer(layer):
            experts += cfg.num_experts * per_expert
            mlp = h * cfg.num_experts + cfg.num_experts_per_tok * per_expert
            mlp += (3 * h * shared + h) if shared else 0  # the shared expert and its gate
        else:
            mlp = 3 * h * cfg.intermediate_size
        linear += attention + mlp
    idle = experts - experts * cfg.num_experts_per_tok // max(1, cfg.num_experts)
    return {"all": total, "decoder_linear": linear, "lm_head": cfg.vocab_size * cfg.hidden_size,
            "embedding": cfg.vocab_size * cfg.hidden_size, "tied": cfg.tie_word_embeddings,
            "experts": experts, "active": total - idle}


def expected_experts_hit(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of `batch` tokens reaches in one layer when each token picks
    top_k of num_experts uniformly: E (1 - (1 - K/E)^B); K at batch 1."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def stored_bytes(model: torch.nn.Module, only: type | None = None) -> int:
    """Bytes of every parameter and persistent buffer as stored (FP8 weights: 1 byte each, plus
    their scales); tied tensors once. only: count the modules of that type only (the experts)."""
    tensors = (model.state_dict().values() if only is None else
               [t for m in model.modules() if isinstance(m, only) for t in m.state_dict().values()])
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def attention_flops(cfg: ModelConfig, lengths: list[int]) -> int:
    """Causal self-attention of whole sequences: QK^T and PV, 2 FLOPs per multiply-add each."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs

# ----------------------------------------------------------------------------- figures

DEFINITIONS = {
    "copy_rate": "one large dst.copy_(src) on the device: (bytes read + bytes written) / s, median",
    "matmul_rate": "n^3 matmul in the run's dtype (8192 on GPU): 2 n^3 / s, median",
    "prefill.flops_linear": "2 x (decoder linear weights (q/k/v/o/gate/up/down) x tokens "
                            "+ LM head weights x one row per sequence)",
    "prefill.flops_all_params": "2 x every parameter a token uses (tied ones once; MoE: the "
                                "top-k experts only) x tokens (DESIGN.md's figure)",
    "prefill.flops_attention": "4 x layers x heads x head_dim x causal (query, key) pairs; not in "
                               "the floor",
    "prefill.floor_s": "flops_linear / matmul rate; ratio_to_floor = seconds / floor_s",
    "prefill.fraction_of_matmul_*": "FLOPs of that count / seconds / matmul rate",
    "prefill.seconds": "median wall time of one EngineCore.step() prefilling the whole batch",
    "decode.floor_ms": "(weight_bytes + kv_bytes) / copy rate; weight_bytes = every parameter "
                       "as stored (the embedding table too, as DESIGN.md's 16.1 GB; FP8 weights "
                       "1 byte plus scales) but the experts, plus of each MoE layer's experts "
                       "the expected number the batch reaches with uniform top-k routing, "
                       "E (1 - (1 - K/E)^batch) (experts_hit_per_layer; K at batch 1), kv_bytes = batch x mean context during the timed "
                       "steps x KV bytes per token (FP8 pages: 1 byte per element)",
    "decode.ms_per_step": "wall time of whole EngineCore.step() calls (schedule, run, sample)",
    "decode.graph_replay_ms": "CUDA-event time of replaying the step's decode graph alone (the "
                              "GPU's share; ms_per_step minus this is host time not overlapped)",
    "ours_over_hf": "our tokens/s / transformers' tokens/s on the same case (> 1: ours faster)",
}


def prefill_figures(cfg: ModelConfig, counts: dict, batch: int, length: int,
                    seconds: list[float], matmul_fps: float) -> dict:
    t = statistics.median(seconds)
    tokens = batch * length
    linear = 2 * (counts["decoder_linear"] * tokens + counts["lm_head"] * batch)
    all_params = 2 * counts["active"] * tokens
    attn = attention_flops(cfg, [length] * batch)
    floor = linear / matmul_fps
    return {"seconds": t, "samples": seconds, "tokens_per_s": tokens / t,
            "flops_linear": linear, "flops_all_params": all_params, "flops_attention": attn,
            "floor_s": floor, "ratio_to_floor": t / floor,
            "fraction_of_matmul_linear": linear / t / matmul_fps,
            "fraction_of_matmul_all_params": all_params / t / matmul_fps,
            "fraction_of_matmul_linear_plus_attention": (linear + attn) / t / matmul_fps}


def decode_figures(r: dict, batch: int, steps: int, weight_bytes: float, kv_per_token: int,
                   copy_bps: float, experts_hit: float | None = None) -> dict:
    step_s, replay_s = r["seconds"] / steps, r.get("graph_replay_s")
    kv_bytes = batch * r["mean_context"] * kv_per_token
    floor = (weight_bytes + kv_bytes) / copy_bps
    return {"steps": steps, "ms_per_step": step_s * 1e3, "tokens_per_s": batch / step_s,
            "mean_context": r["mean_context"], "fill_steps": r.get("fill_steps"),
            "weight_bytes": weight_bytes, "experts_hit_per_layer": experts_hit,
            "kv_bytes": kv_bytes, "floor_ms": floor * 1e3,
            "ratio_to_floor": step_s / floor,
            "graph_replay_ms": None if replay_s is None else replay_s * 1e3,
            "graph_replay_ratio_to_floor": None if replay_s is None else replay_s / floor,
            "host_profile": r.get("host_profile"), "kernel_profile": r.get("kernel_profile")}


# ----------------------------------------------------------------------------- record

class Progress:
    """One stderr line per finished case: `[####------] 3/20  what: result  (elapsed)`."""

    def __init__(self, total: int, width: int = 20):
        self.total, self.width, self.done, self.start = total, width, 0, time.perf_counter()

    def case(self, what: str, result: str) -> None:
        self.done += 1
        filled = self.width * self.done // max(1, self.total)
        print(f"[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total}  {what}: "
              f"{result}  ({time.perf_counter() - self.start:.0f} s)", file=sys.stderr, flush=True)



@dataclass
class Bench:
    """What every case shares: the settings, the model's accounting, the measured ceilings."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    cfg: ModelConfig
    progress: Progress
    ceilings: dict
    gen: torch.Generator = field(default_factory=torch.Generator)
    counts: dict = field(default_factory=dict)
    kv_bytes_per_token: int = 0
    stored_bytes: int = 0  # the model's weights as stored (stored_bytes())
    expert_bytes: int = 0  # the MoE layers' experts as stored (all of them)
    errors: list[str] = field(default_factory=list)
    record: dict = field(default_factory=dict)  # the JSON result, rewritten after every case
    started: float = field(default_factory=time.perf_counter)

    @property
    def weight_bytes(self) -> int:
        return self.stored_bytes or self.counts["all"] * self.dtype.itemsize

    def prefill_row(self, batch: int, length: int, seconds: list[float]) -> dict:
        return prefill_figures(self.cfg, self.counts, batch, length, seconds,
                               self.ceilings["matmul"]["median_tflops"] * 1e12)

    def decode_row(self, batch: int, result: dict) -> dict:
        weight_bytes, hit = self.step_weight_bytes(batch)
        return decode_figures(result, batch, self.args.decode_steps, weight_bytes,
                              self.kv_bytes_per_token, self.ceilings["copy"]["median_gbps"] * 1e9,
                              hit)

    def step_weight_bytes(self, batch: int) -> tuple[float, float | None]:
        """(weight bytes a decode step of `batch` rows reads, experts it reaches per MoE
        layer): every weight but the experts, and the experts' share that the batch is
        expected to reach (expected_experts_hit; None for a dense model)."""
        cfg = self.cfg
        if not cfg.num_experts:
            return self.weight_bytes, None
        hit = expected_experts_hit(cfg.num_experts, cfg.num_experts_per_tok, batch)
        return self.weight_bytes - self.expert_bytes * (1 - hit / cfg.num_experts), hit

    def case(self, what: str, row: dict, measure,
             reset: Callable[[], None] | None = None) -> dict:
        """Fill row with measure()'s figures unless it is skipped; a failure is recorded in
        the row and in errors (traceback on stderr), reset() (the engine's cases: end the
        failed case's requests) runs, and the other cases still run."""
        if "skipped" not in row:
            try:
                row.update(measure())
            except Exception as e:  # noqa: BLE001 -- see the docstring
                row["error"] = self.failed(what, e)
                if reset is not None:
                    reset()
        free_memory(self.device)
        self.progress.case(what, _summary(row))
        self.save()
        return row

    def save(self, final: bool = False) -> None:
        """Write the record so far to --output (a run cut short keeps its finished cases)."""
        self.record.update(complete=final, wall_s=time.perf_counter() - self.started)
        if self.args.output and final:
            write_json(self.args.output, self.record)
        elif self.args.output:
            Path(self.args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.output).write_text(json.dumps(self.record, indent=2) + "\n")

    def failed(self, what: str, e: Exception) -> str:
        traceback.print_exc(file=sys.stderr)
        message = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        self.errors.append(f"{what}: {message}")
        return message


def free_memory(device: torch.device) -> None:
    """Collect garbage, and hand cached CUDA blocks back to the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- profiles

def profile_steps(core: EngineCore, steps: int, top: int = 15) -> list[dict]:
    """The functions with the most own time over `steps` decode steps under cProfile, per step
    (cProfile slows Python code down, so read these as shares, not as absolute times)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        core.step()
    sync(core.device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, _)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": n / steps,
             "own_ms_per_step": tt / steps * 1e3, "cum_ms_per_step": ct / steps * 1e3}
            for (f, line, name), (_, n, tt, ct, _) in rows]


def profile_kernels(replay, steps: int, top: int = 20) -> list[dict]:
    """GPU time per step of each kernel in the decode graph (torch.profiler over `steps`
    replays), the costliest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:160], "calls_per_step": e.count / steps,
             "us_per_step": e.device_time_total / steps} for e in kernels[:top]]

# ----------------------------------------------------------------------------- table

def _summary(row: dict) -> str:
    if "ms_per_step" in row:
        replay = row.get("graph_replay_ms")
        return (f"{row['ms_per_step']:.2f} ms/step, {row['tokens_per_s']:,.0f} tok/s, "
                f"{row['ratio_to_floor']:.2f}x floor ({row['floor_ms']:.2f} ms)"
                + (f", graph replay alone {replay:.2f} ms" if replay else ""))
    if "tokens_per_s" in row:
        return (f"{row['tokens_per_s']:,.0f} tok/s, {row['seconds'] * 1e3:.1f} ms, "
                f"{row['ratio_to_floor']:.2f}x floor, {row['fraction_of_matmul_all_params']:.0%} "
                "of matmul (all params)")
    return row.get("skipped") or row.get("error") or "done"


def print_table(record: dict) -> None:
    c, e = record["ceilings"], record["engine"]
    print(f"\n{record['preset']} on {record['device_name']} ({record['dtype']}), attention "
          f"{e['attention_backend']}, CUDA graphs {'on' if e['cuda_graphs'] else 'off'}, overlap schedule "
          f"{'on' if e.get('overlap_schedule') else 'off'}")
    print(f"ceilings: copy {c['copy']['median_gbps']:,.4g} GB/s (read + write), matmul "
          f"{c['matmul']['n']}^3 {c['matmul']['median_tflops']:,.4g} TFLOP/s")
    print(f"\n{'prefill':<10}| {'tok/s':>10} | {'ms':>8} | {'x floor':>7} | "
          f"{'matmul % (linear)':>17} | {'(all params)':>12} | {'ours/HF':>7}")
    for r in record["prefill"]:
        name = f"{r['batch']}x{r['length']}"
        if "tokens_per_s" not in r:
            print(f"{name:<10}| {_summary(r)}")
            continue
        print(f"{name:<10}| {r['tokens_per_s']:>10,.0f} | {r['seconds'] * 1e3:>8.1f} | "
              f"{r['ratio_to_floor']:>7.2f} | {r['fraction_of_matmul_linear']:>17.1%} | "
              f"{r['fraction_of_matmul_all_params']:>12.1%} | {_ratio(r):>7}")
    print(f"\n{'decode':<14}| {'ms/step':>8} | {'tok/s':>9} | {'floor ms':>8} | {'x floor':>7} | "
          f"{'ours/HF':>7}")
    for r in record["decode"]:
        name = f"bs{r['batch']} ctx{r['context']}"
        if "ms_per_step" not in r:
            print(f"{name:<14}| {_summary(r)}")
            continue
        print(f"{name:<14}| {r['ms_per_step']:>8.2f} | {r['tokens_per_s']:>9,.0f} | "
              f"{r['floor_ms']:>8.2f} | {r['ratio_to_floor']:>7.2f} | {_ratio(r):>7}")
    for error in record["errors"]:
        print(f"error: {error}")


def _ratio(row: dict) -> str:
    return f"{row['ours_over_hf']:.2f}" if "ours_over_hf" in row else "-"

