"""What a measurement records next to its numbers: the commit, the device, and the JSON file.
`pd-serve profile` writes its profile with them; the benchmarks (bench/_common.py) too."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when run from one


def git_commit() -> str:
    """$PD_SERVE_COMMIT when set (the device machine gets a copy of the tree, whose .git may be
    stale), else HEAD, with "-dirty" when tracked files differ from it (so a stale or edited
    tree never passes for a commit); "unknown" outside a git checkout."""
    if os.environ.get("PD_SERVE_COMMIT"):
        return os.environ["PD_SERVE_COMMIT"]
    try:
        head = _git("rev-parse", "HEAD")
        return head + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=SOURCE_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def device_name(device) -> str:
    """The GPU's name, or the CPU's with its core count (`device`: a torch.device)."""
    if device.type == "cuda":
        import torch
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def write_json(path: str | Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")
