"""What every benchmark records next to its numbers (the commit, the devices, the JSON file:
pd_serve/planner/provenance.py, which `pd-serve profile` uses too), and a device sync."""

from __future__ import annotations

import torch

from pd_serve.planner.provenance import device_name, git_commit, write_json  # noqa: F401


def sync(*devices: torch.device) -> None:
    """Wait for the queued work of every CUDA device given; nothing to wait for on CPU."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
