"""Host time of one ipc receiver flush, part by part (the KV-transfer issue's 8 MiB bar).

A flush uploads the page ids and launches one copy kernel. This times, on one GPU with the
process otherwise idle, the host microseconds of each way of doing the parts:

    ids_pin_tensor   torch.tensor(ids, pin_memory=True).to(dev, non_blocking=True) (the old way)
    ids_ring         ids written into a reused pinned buffer with numpy, one non-blocking copy_
    triton_launch    kernels.kv_copy.copy_pages (Triton) with the ids already on the device
    torch_index      dst[:, dst_ids] = src[:, src_ids] on int16 views (two torch kernels)
    stream_ctx       entering and leaving `with torch.cuda.stream(s)`
    event_query      recording an event and querying it once

    python bench/probes/flush_probe.py --output bench/results/probe-flush-h200.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _common import device_name, git_commit, write_json  # noqa: E402
from kernels.kv_copy import copy_pages  # noqa: E402


def host_us(fn, reps: int) -> dict:
    """Median / p90 host microseconds of fn(); the GPU is drained every 16 calls so its queue
    never fills (a full queue would make launches wait)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
        if i % 16 == 15:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times.sort()
    return {"median_us": round(statistics.median(times), 1),
            "p90_us": round(times[int(0.9 * len(times))], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", default="8,64,512,2048")
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    # Llama-3-8B layout with 1 MiB pages: [32, 2, P, 8, 8, 128] bf16, as bench/transfer.py.
    num_pages = 4096
    src = torch.zeros(32, 2, num_pages, 8, 8, 128, dtype=torch.bfloat16, device=dev)
    dst = torch.zeros_like(src)
    ring = torch.empty(2 * 4096, dtype=torch.int32, pin_memory=True)
    ring_np = ring.numpy()
    ids_dev = torch.empty(2 * 4096, dtype=torch.int32, device=dev)
    stream = torch.cuda.Stream(dev)
    rows_src = src.view(torch.int16).view(64, num_pages, -1)
    rows_dst = dst.view(torch.int16).view(64, num_pages, -1)
    results = {}
    for n in [int(v) for v in args.pages.split(",")]:
        ids = list(range(0, 2 * n, 2))[:n]
        both = ids + ids[::-1]

        def pin_tensor():
            torch.tensor(both, dtype=torch.int32, pin_memory=True).to(dev, non_blocking=True)

        def ring_copy():
            ring_np[:2 * n] = both
            ids_dev[:2 * n].copy_(ring[:2 * n], non_blocking=True)

        def list_to_numpy():
            np.asarray(both, dtype=np.int32)

        src_ids, dst_ids = ids_dev[:n], ids_dev[n:2 * n]
        ring_np[:2 * n] = both
        ids_dev[:2 * n].copy_(ring[:2 * n])
        src_long, dst_long = src_ids.long(), dst_ids.long()

        def triton():
            copy_pages(src, src_ids, dst, dst_ids, 0, 32)

        def torch_index():
            rows_dst[:, dst_long] = rows_src[:, src_long]

        def stream_ctx():
            with torch.cuda.stream(stream):
                pass

        def event_query():
            stream.record_event().query()

        results[str(n)] = {name: host_us(fn, args.reps) for name, fn in [
            ("ids_pin_tensor", pin_tensor), ("ids_ring", ring_copy), ("list_to_numpy", list_to_numpy),
            ("triton_launch", triton), ("torch_index", torch_index), ("stream_ctx", stream_ctx),
            ("event_query", event_query)]}
        print(n, "pages:", json.dumps(results[str(n)]), flush=True)
    out = {"probe": "host time of the parts of an ipc receiver flush", "device": device_name(dev),
           "torch_version": torch.__version__, "git_commit": git_commit(), "pages": results}
    if args.output:
        write_json(args.output, out)


if __name__ == "__main__":
    main()
