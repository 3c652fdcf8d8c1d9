"""One Triton mode per process: on a CUDA machine the kernels compile, and every kernel test not
parametrised with device "cuda" is skipped there (CPU CI runs them, many in the interpreter).
Triton builds its standard library (tl.sum, tl.cdiv, ...) for one mode, so mixing interpreted
and compiled kernels in one process breaks one or the other.

`triton_mode` (autouse) sets PD_SERVE_TRITON_CPU=1 for each test here not parametrised with
device "cuda", so CPU tests run the kernels in Triton's interpreter; it is set per test, so the
setting never leaks into other test folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """(The hook sees every collected item of the session: only this folder's are touched.)"""
    if not ON_GPU:
        return
    skip = pytest.mark.skip(reason="CPU variant: runs in CPU CI (one Triton mode per process)")
    for item in items:
        if HERE not in Path(item.path).parents:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("device") != "cuda":
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def triton_mode(request, monkeypatch):
    """CPU tests run the kernels in Triton's interpreter; CUDA tests compile them."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("device") == "cuda":
        monkeypatch.delenv("PD_SERVE_TRITON_CPU", raising=False)
    else:
        monkeypatch.setenv("PD_SERVE_TRITON_CPU", "1")
