"""Probe (GPU): a batch-1 decode step (Qwen3-30B-A3B's shape by default) under block-size variants.

One engine (bench/one_batch.py's, random weights, --enable-batch1-kernels, 1k context); per
variant the block sizes are patched (kernels/moe_batch1.py's block_config, kernels/gemv.py's
_block_config, or an integer module constant), the batch-1 CUDA graph is captured again and the
step timed (bench/one_batch.py's run_decode: 48 steps, then the graph replayed alone). Rounds
visit every variant, alternately in and against list order, so drift falls on all alike.

    PYTHONPATH=. python3 bench/probes/step_configs.py --set down OUT.json [--quantization fp8]

--set down: the experts' down kernel (SLOTS, BLOCK_N, BLOCK_K, warps, stages); gate_up: the
experts' gate/up kernel; gemv: Qwen3-30B-A3B's q/k/v, o and LM-head GEMVs (bf16); constants:
decode attention, RoPE + KV store and argmax constants. --preset: another bench/one_batch.py
preset (down and gate_up need an MoE one). Writes each variant's step and replay times (ms,
one per round); bench/results/one-batch-qwen3-30b-a3b-bs1-step-configs-h100.json.
"""
import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")
import torch  # noqa: E402

import bench.one_batch as one_batch  # noqa: E402
import kernels.gemv as gemv  # noqa: E402
import kernels.moe_batch1 as moe_batch1  # noqa: E402
from bench._common import device_name, git_commit  # noqa: E402
from pd_serve.model.config import ModelConfig  # noqa: E402

STEPS = 48
QKV, O, HEAD = (5120, 2048), (2048, 4096), (151936, 2048)  # GEMV shapes (N, K)
PA, RS, AM = "kernels.paged_attention.", "kernels.kv_store.", "kernels.argmax."
SETS = {  # name -> [(label, {"moe": {...}, "gemv": {(n, k): config}, "const": {...}})]
    "down": [(f"down{d}", {"moe": {"down": d}}) for d in [
        (2, 4, 256, 4, 1), (2, 4, 128, 4, 1), (2, 4, 64, 4, 1), (4, 4, 128, 4, 1),
        (4, 2, 128, 4, 1), (8, 2, 256, 4, 1), (8, 2, 128, 4, 1), (8, 2, 128, 2, 1),
        (8, 2, 128, 4, 2), (8, 2, 64, 4, 1), (8, 1, 128, 4, 1), (8, 4, 128, 4, 1),
        (8, 1, 1024, 4, 1), (8, 1, 512, 4, 1), (8, 2, 512, 4, 1)]],  # (more read before the wait)
    "gate_up": [(f"gate_up{g}", {"moe": {"gate_up": g}}) for g in [
        (1, 2, 1024, 4, 2), (2, 1, 1024, 4, 2), (1, 1, 2048, 4, 1), (1, 1, 512, 4, 3),
        (1, 1, 1024, 8, 2), (1, 1, 1024, 4, 3), (1, 1, 512, 2, 3)]],
    "gemv": [(f"{name}{c}", {"gemv": {shape: (*c, False)}}) for name, shape, configs in [
        ("qkv", QKV, [(1, 1024, 4, 2), (4, 1024, 4, 2), (2, 2048, 4, 1), (2, 1024, 4, 3)]),
        ("o", O, [(2, 1024, 4, 2), (1, 2048, 4, 1), (1, 1024, 4, 3), (1, 512, 4, 4)]),
        ("lm_head", HEAD, [(4, 1024, 4, 2), (8, 1024, 8, 2), (1, 1024, 4, 2)])]
        for c in configs],
    "constants": [(f"{key.rpartition('.')[2]}={value}", {"const": {key: value}}) for key, value in [
        (PA + "_DECODE_BLOCK_N", 32), (PA + "_DECODE_BLOCK_N", 128), (PA + "_DECODE_WARPS", 2),
        (PA + "_DECODE_WARPS", 8), (PA + "_DECODE_STAGES", 1), (PA + "_DECODE_STAGES", 3),
        (PA + "_MIN_TILES_PER_SPLIT", 2), (PA + "_MERGE_ELEMENTS", 4096),
        (PA + "_MERGE_ELEMENTS", 65536), (RS + "_ROPE_BLOCK_ELEMENTS", 512),
        (RS + "_ROPE_BLOCK_ELEMENTS", 2048), (AM + "_BLOCK", 2048), (AM + "_BLOCK", 8192)]],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output")
    p.add_argument("--set", choices=sorted(SETS), default="down")
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(one_batch.PRESETS))
    p.add_argument("--quantization", choices=["fp8"], default=None)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--limit", type=float, default=400, help="stop starting variants after S s")
    return p.parse_args()


class Patches:
    """Block configs and module constants for one variant; apply() undoes the last one's."""

    def __init__(self):
        self.moe, self.gemv = moe_batch1.block_config, gemv._block_config
        self.constants: dict[str, int] = {}  # the originals of constants ever set

    def apply(self, variant: dict) -> None:
        for key, value in self.constants.items():
            self._set(key, value)
        for key, value in variant.get("const", {}).items():
            self.constants.setdefault(key, self._set(key, value))
        moe, shapes = variant.get("moe", {}), variant.get("gemv", {})
        moe_batch1.block_config = lambda fp8: {**self.moe(fp8), **moe}
        gemv._block_config = lambda n, k, fp8: shapes.get((n, k), self.gemv(n, k, fp8))

    @staticmethod
    def _set(key: str, value: int) -> int:
        module_name, _, name = key.rpartition(".")
        module = importlib.import_module(module_name)
        old = getattr(module, name)
        setattr(module, name, value)
        return old


def main() -> int:
    args = parse_args()
    start = time.time()
    argv = ["--preset", args.preset, "--enable-batch1-kernels", "--batch-sizes", "1",
            "--contexts", "1024", "--prefill-grid", "1x256", "--no-hf", "--decode-steps",
            str(STEPS)] + (["--quantization", args.quantization] if args.quantization else [])
    bench_args = one_batch.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    one_batch.fill_defaults(bench_args, device)
    preset = one_batch.PRESETS[bench_args.preset]
    model_dir = Path(tempfile.mkdtemp(prefix="step-configs-"))
    (model_dir / "config.json").write_text(json.dumps(preset))
    cfg = ModelConfig.from_dict(preset, source=f"preset {bench_args.preset}")
    core, _ = one_batch.build_core(bench_args, model_dir, cfg, device, torch.bfloat16)
    variants = [("default", {})] + SETS[args.set]
    times = {label: [] for label, _ in variants}
    patches, runner, gen = Patches(), core.runner, torch.Generator().manual_seed(0)
    for r in range(args.rounds):
        for label, variant in (variants if r % 2 == 0 else variants[::-1]):
            if time.time() - start > args.limit:
                break
            patches.apply(variant)
            runner.graphs.pop(1, None)
            with torch.inference_mode():
                runner._plan_graph(1, [], [], [])
                runner.graphs[1] = runner._capture(1, torch.cuda.graph_pool_handle())
            run = one_batch.run_decode(core, gen, 1, 1024, 3, STEPS)
            times[label].append((run["seconds"] / STEPS * 1e3, run["graph_replay_s"] * 1e3))
            print(f"round {r} {label:28s} step {times[label][-1][0]:.4f} ms  replay "
                  f"{times[label][-1][1]:.4f} ms  ({time.time() - start:.0f} s)", flush=True)
    patches.apply({})
    rows = [{"variant": label, **{k: (str(v) if k == "gemv" else v) for k, v in variant.items()},
             "step_ms": [round(s, 4) for s, _ in times[label]],
             "replay_ms": [round(g, 4) for _, g in times[label]],
             "median_replay_ms": statistics.median(g for _, g in times[label])}
            for label, variant in variants if times[label]]
    Path(args.output).write_text(json.dumps({
        "probe": "step_configs", "set": args.set, "quantization": args.quantization,
        "preset": args.preset, "batch": 1, "context": 1024, "steps": STEPS,
        "device": device_name(device), "git_commit": git_commit(), "rows": rows}, indent=1))
    for row in sorted(rows, key=lambda row: row["median_replay_ms"]):
        print(f"{row['variant']:28s} median replay {row['median_replay_ms']:.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
