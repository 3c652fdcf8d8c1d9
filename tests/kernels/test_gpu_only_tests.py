"""On a GPU machine tests/kernels/conftest.py runs only the tests here parametrised with device
"cuda" (one Triton mode per process). A test that needs a GPU without that parameter is skipped
on the CPU for want of a GPU and on the GPU by that rule: it never runs. Five did, from
2026-11-29 to 2026-12-02 (page copies past int32 offsets, on a peer GPU and replayed for any page
count; KV stores past int32 offsets; decode attention replayed with new lengths and pages)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def _needs_a_gpu(item) -> bool:
    """Skipped for want of a CUDA GPU (needs_cuda, "needs two CUDA GPUs", ...)."""
    return any("cuda" in str(mark.kwargs.get("reason", "")).lower()
               for mark in item.iter_markers("skipif"))


def _device(item):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("device") if callspec is not None else None


def test_gpu_only_tests_are_parametrised_with_device_cuda(request):
    never_run = [item.nodeid for item in request.session.items
                 if HERE in Path(item.path).parents and _needs_a_gpu(item)
                 and _device(item) != "cuda"]
    assert not never_run, f"these would run on no machine: {never_run}"
