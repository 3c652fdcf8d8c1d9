"""Probe (one GPU, ~1 min): is a prefill step slower in a serving worker than `pd-serve profile`
times it? Three timings of one 2048-token prompt step on the same EngineCore: the profile's
(the least of 3 lone steps, synchronized around each), the mean of --steps steps back to back
(clocks under sustained load), and the same with a per-layer callback like the prefill
worker's (the layer-wise KV send hook, here doing nothing).

    PYTHONPATH=. python3 bench/probes/prefill_sustained.py --model <dir> --load-format dummy \
        --device cuda --output $OUT/probe-prefill-sustained.json
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._common import device_name, git_commit, write_json  # noqa: E402
from pd_serve.cli import add_engine_args, engine_config_from_args  # noqa: E402
from pd_serve.planner import profile  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--output", required=True)
    args = p.parse_args()
    config = engine_config_from_args(args)
    core = profile._build_core(config)
    timer = profile._Timer(core, repeats=3)
    n = args.prompt_len
    lone = timer.prefill([n])["time_s"]

    def run(on_layer) -> list[float]:
        times = []
        for _ in range(args.steps):
            request = timer._waiting(n)
            start = time.perf_counter()
            plan, _ = core.step(on_layer=on_layer)
            times.append(time.perf_counter() - start)  # token 1 is on the host: the step is done
            assert plan.num_tokens == n
            timer._finish([request])
        return times

    sustained = run(None)
    hooked = run(lambda plan, layer: None)
    out = {"probe": "prefill_sustained", "device": device_name(core.device), "commit": git_commit(),
           "prompt_len": n, "steps": args.steps, "lone_min_s": lone,
           "sustained_mean_s": statistics.mean(sustained),
           "sustained_last10_mean_s": statistics.mean(sustained[-10:]),
           "hooked_mean_s": statistics.mean(hooked), "hooked_last10_mean_s": statistics.mean(hooked[-10:])}
    print(out, flush=True)
    write_json(args.output, out)


if __name__ == "__main__":
    main()
