"""kernels/moe_routing.py's route_one_row at Qwen3-30B-A3B's layer shape (hidden 2048, 128
experts, top 8, bf16): 48 layers' launches in a CUDA graph, us a launch, per warps setting.

    python bench/probes/route_one_row.py out.json   (bench/results/moe-route-one-row-h200.json)
"""
import statistics
import sys

import torch

from bench._common import device_name, git_commit, write_json
from kernels import moe_routing

LAYERS, EXPERTS, HIDDEN, TOP_K = 48, 128, 2048, 8
dev = torch.device("cuda")
gen = torch.Generator(dev).manual_seed(0)
layers = [[torch.randn(1, HIDDEN, generator=gen, device=dev).bfloat16(),
           torch.randn(1, HIDDEN, generator=gen, device=dev).bfloat16(),
           torch.ones(HIDDEN, device=dev).bfloat16(),
           (torch.randn(EXPERTS, HIDDEN, generator=gen, device=dev) * 0.02).bfloat16()]
          for _ in range(LAYERS)]


def step():
    for x, residual, norm_weight, weight in layers:
        moe_routing.route_one_row(x, residual, norm_weight, 1e-6, weight, TOP_K, True)


def us_per_launch() -> float:
    step()  # compiles, and makes the counter buffer outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return statistics.median(times)


rows = []
for warps in (1, 2, 4, 8):
    moe_routing.ONE_ROW_WARPS = warps
    rows.append({"warps": warps, "us_per_launch": us_per_launch()})
    print(f"warps {warps}: {rows[-1]['us_per_launch']:.2f} us a launch", flush=True)
write_json(sys.argv[1], {"probe": "route_one_row", "device": device_name(dev),
                         "git_commit": git_commit(), "rows": rows,
                         "shape": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K,
                                   "layers": LAYERS}})
