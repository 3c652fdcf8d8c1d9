"""Host time of the single calls the KV-transfer path makes per request, in a tight loop on this
machine (us a call, median of 5 rounds of 20,000): CUDA stream lookups, events, a pinned
host-to-device copy, a CUDA graph replay, the protocol's chunk header, the Prometheus stats, a
wake-up byte over a socket pair. Needs a GPU.

    python bench/probes/host_costs.py --output bench/results/probe-host-costs-h200.json
"""

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from _common import device_name, git_commit, write_json  # noqa: E402
from pd_serve.protocol import KVChunk, fields_of  # noqa: E402
from pd_serve.transfer.base import TransferResult, TransferStats  # noqa: E402

CALLS, ROUNDS = 20000, 5


def per_call_us(fn) -> float:
    fn()
    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        rounds.append((time.perf_counter() - start) * 1e6 / CALLS)
    return statistics.median(rounds)


def cases(device: torch.device):
    stream = torch.cuda.current_stream(device)

    def new_event():
        torch.cuda.Event().record(stream)
    event = torch.cuda.Event()
    event.record(stream)
    chunk = KVChunk("r1", list(range(8)), 0, 32, 8 << 20, True, list(range(8)), [], [], 1)
    stats, results = TransferStats("send", "ipc"), [TransferResult("r1", True, "", 8 << 20, 1e-3)]
    wake_w, wake_r = socket.socketpair()
    wake_r.setblocking(False)

    def wake():
        wake_w.send(b"\0")
        wake_r.recv(4096)
    host = torch.zeros(17, dtype=torch.int32, pin_memory=True)
    ids = torch.zeros(17, dtype=torch.int32, device=device)
    x = torch.zeros(16, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        x.add_(1)  # warm up outside the capture
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return {
        "current_stream(device)": lambda: torch.cuda.current_stream(device),
        "current_stream(index)": lambda: torch.cuda.current_stream(device.index),
        "Event() + record(stream)": new_event,
        "event.record(stream), reused": lambda: event.record(stream),
        "event.synchronize(), done": event.synchronize,
        "event.query(), done": event.query,
        "KVChunk(...) of 8 pages": lambda: KVChunk("r1", list(range(8)), 0, 32, 8 << 20, True,
                                                   list(range(8)), [], [], 1),
        "protocol.fields_of(chunk)": lambda: fields_of(chunk),
        "TransferStats.record(1 result)": lambda: stats.record(results),
        "socketpair: 1 byte sent and read": wake,
        "pinned H2D copy_ of 17 int32, non_blocking": lambda: ids.copy_(host, non_blocking=True),
        "CUDAGraph.replay(), one tiny kernel": graph.replay,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default=None)
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    rows = {}
    for name, fn in cases(device).items():
        rows[name] = round(per_call_us(fn), 2)
        print(f"{name:45s} {rows[name]:7.2f} us", flush=True)
    torch.cuda.synchronize(device)
    if args.output:
        write_json(args.output, {"probe": "host us per call, tight loop", "device": device_name(device),
                                 "torch_version": torch.__version__, "git_commit": git_commit(),
                                 "python": sys.version.split()[0], "us_per_call": rows})


if __name__ == "__main__":
    main()
