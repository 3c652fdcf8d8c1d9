"""`pd-serve launch` with expert parallelism: a worker of --ep-size N over replicated attention
(--tp 1) has N ranks, so it takes N GPUs (CUDA_VISIBLE_DEVICES), and --prefill-ep / --decode-ep
reach that role's workers only; on CPU no GPUs are assigned. The processes are not started:
LocalCluster._start records what it would run."""

from __future__ import annotations

import pytest

from pd_serve import cli
from pd_serve.launch import LocalCluster, flag_value


def _workers(monkeypatch, argv: list[str]) -> dict[str, tuple[str | None, str, str]]:
    """worker name -> (CUDA_VISIBLE_DEVICES, its --tp, its --ep-size) for `pd-serve launch argv`."""
    started = []
    monkeypatch.setattr(LocalCluster, "_start",
                        lambda self, name, args, log_level, gpu=None: started.append((name, args, gpu)))
    parser = cli.build_parser()
    args, rest = parser.parse_known_args(["launch", "--port", "0", *argv])
    args.engine_argv = rest
    cli._cluster_from_args(args)
    return {name: (gpu, flag_value(args, "--tp", "1"), flag_value(args, "--ep-size", "1"))
            for name, args, gpu in started if name != "gateway"}


@pytest.mark.parametrize("argv,want", [
    (["--prefill-ep", "2", "--gpu-ids", "0,1,2"],
     {"prefill-0": ("0,1", "1", "2"), "decode-1": ("2", "1", "1")}),
    (["--decode-ep", "4", "--gpu-ids", "0,1,2,3,4"],
     {"prefill-0": ("0", "1", "1"), "decode-1": ("1,2,3,4", "1", "4")}),
    (["--ep-size", "2", "--gpu-ids", "0,1,2,3"],  # every worker's flag
     {"prefill-0": ("0,1", "1", "2"), "decode-1": ("2,3", "1", "2")}),
    (["--prefill-tp", "2", "--prefill-ep", "2", "--decode-ep", "2", "--gpu-ids", "0,1,2,3"],
     {"prefill-0": ("0,1", "2", "2"), "decode-1": ("2,3", "1", "2")}),  # EP beside TP, and not
])
def test_an_ep_worker_takes_a_gpu_per_rank(monkeypatch, argv, want):
    assert _workers(monkeypatch, ["--device", "cuda", *argv]) == want


def test_on_cpu_ep_workers_get_no_gpus(monkeypatch):
    got = _workers(monkeypatch, ["--device", "cpu", "--prefill-ep", "2", "--decode-ep", "2"])
    assert got == {"prefill-0": (None, "1", "2"), "decode-1": (None, "1", "2")}
