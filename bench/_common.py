"""What every benchmark records next to its numbers (the commit, the devices, the JSON file:
pd_serve/planner/provenance.py, which `pd-serve profile` uses too), a device sync, and the
options the GEMM benchmarks share."""

from __future__ import annotations

import argparse

import torch

from pd_serve.planner.provenance import device_name, git_commit, write_json  # noqa: F401


def sync(*devices: torch.device) -> None:
    """Wait for the queued work of every CUDA device given; nothing to wait for on CPU."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def gemm_parser(doc: str, m: str, calls: int) -> argparse.ArgumentParser:
    """The GEMM benchmarks' shared options (--device, --m, --calls, --repeats, --quick,
    --output); a benchmark adds its own, then `parse_gemm_args`."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--m", default=m, help="token counts, comma-separated")
    p.add_argument("--calls", type=int, default=calls, help="calls per timed CUDA graph")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="one small layer (smoke run)")
    p.add_argument("--output", default=None, help="write the JSON here")
    return p


def parse_gemm_args(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parse; --m as a list of ints, --device as a torch.device (a clear error without CUDA)."""
    args = p.parse_args(argv)
    args.m = [int(m) for m in args.m.split(",")]
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (use --device cpu)")
    return args
