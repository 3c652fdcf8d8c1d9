"""How fast the CPU workload of bench/offline.py (16 prompts x 128 in / 64 out, the embedded
model, float32) could run on this machine at best: the prefill's matmuls at the machine's
matmul rate, each decode step's weight and K/V reads at its memory read rate. Then the same
with the rates torch's CPU kernels reach on the model's own shapes (oneDNN on packed weights
at 16 rows, the engine's decode path). Both against a measured transformers time, if given.

    python bench/probes/cpu_floor.py --hf-seconds 8.24 --output bench/results/cpu-floor-16x128in-64out.json
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from _common import device_name, git_commit, write_json  # noqa: E402
from pd_serve.model.config import ModelConfig  # noqa: E402
from pd_serve.model.gguf_default import default_model_dir  # noqa: E402

PROMPTS, INPUT_LEN, OUTPUT_LEN = 16, 128, 64


def seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-seconds", type=float, default=None,
                   help="transformers' generate time for the workload (bench/offline.py)")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    cfg = ModelConfig.from_dir(default_model_dir())
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    shapes = [(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * inter, h), (h, inter)]
    layer_params = sum(n * k for n, k in shapes)
    head_params = cfg.vocab_size * h
    weight_bytes = 4 * (layers * layer_params + head_params)
    kv_token_bytes = 4 * 2 * layers * cfg.kv_size  # K and V of one token, all layers

    big = torch.randn(128 << 20)  # 512 MiB: far past the caches
    read_gbps = big.numel() * 4 / seconds(big.sum) / 1e9
    x, w = torch.randn(2048, h), torch.randn(2 * inter, h)
    matmul_gflops = 2 * x.shape[0] * h * 2 * inter / seconds(lambda: x @ w.t()) / 1e9
    # each linear layer of every layer, then the LM head: (16 rows of its input, packed weight)
    calls = [(torch.randn(PROMPTS, k), torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k), PROMPTS))
             for n, k in shapes * layers + [(cfg.vocab_size, h)]]

    def decode_linears():
        for rows, weight in calls:
            torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")
    linear_s = seconds(decode_linears, 5)
    library_gbps = weight_bytes / linear_s / 1e9

    prefill_flops = 2 * PROMPTS * INPUT_LEN * layers * layer_params
    mean_context = INPUT_LEN + OUTPUT_LEN / 2
    kv_step_bytes = PROMPTS * mean_context * kv_token_bytes
    prefill_s = prefill_flops / (matmul_gflops * 1e9)
    hardware = prefill_s + OUTPUT_LEN * (weight_bytes + kv_step_bytes) / (read_gbps * 1e9)
    # torch's kernels: the linear layers as timed, K/V gathered (read and written) and read by SDPA
    library = prefill_s + OUTPUT_LEN * (linear_s + 3 * kv_step_bytes / (read_gbps * 1e9))
    record = {
        "bench": "cpu_floor", "device_name": device_name(torch.device("cpu")),
        "git_commit": git_commit(), "torch_threads": torch.get_num_threads(),
        "workload": {"prompts": PROMPTS, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                     "dtype": "float32", "model": "SmolLM2-135M-Instruct (embedded)"},
        "weight_bytes": weight_bytes, "kv_bytes_per_decode_step": kv_step_bytes,
        "prefill_flops": prefill_flops,
        "read_gbps": read_gbps, "matmul_gflops": matmul_gflops,
        "decode_linears_ms": linear_s * 1e3, "decode_linears_gbps": library_gbps,
        "floor_hardware_s": hardware, "floor_library_s": library,
        "definitions": {
            "read_gbps": "sum of a 512 MiB float32 tensor: bytes read / s",
            "matmul_gflops": f"[2048, {h}] x [{h}, {2 * inter}] float32",
            "decode_linears_ms": "every linear layer and the LM head on 16 rows, oneDNN on packed weights",
            "floor_hardware_s": "prefill FLOPs at matmul_gflops + 64 steps of weights and K/V at read_gbps",
            "floor_library_s": "prefill as above + 64 x (decode_linears + K/V read three times at read_gbps)",
        },
    }
    output_tokens = PROMPTS * OUTPUT_LEN
    print(f"read {read_gbps:.1f} GB/s, matmul {matmul_gflops:.0f} GFLOP/s, decode linears "
          f"{linear_s * 1e3:.1f} ms a step ({library_gbps:.1f} GB/s of {weight_bytes / 1e6:.0f} MB)")
    print(f"best time: {hardware:.2f} s at the hardware's rates, {library:.2f} s at torch's "
          f"kernels' ({output_tokens / hardware:.0f} / {output_tokens / library:.0f} tok/s)")
    if args.hf_seconds:
        record["hf_seconds"] = args.hf_seconds
        record["max_ratio_hardware"] = args.hf_seconds / hardware
        record["max_ratio_library"] = args.hf_seconds / library
        print(f"against transformers' {args.hf_seconds:.2f} s: at most "
              f"{record['max_ratio_hardware']:.2f}x / {record['max_ratio_library']:.2f}x")
    if args.output:
        write_json(args.output, record)


if __name__ == "__main__":
    main()
