"""`pd-serve launch` on CPU shares the cores out among its workers' ranks (OMP_NUM_THREADS in
each child's environment), unless OMP_NUM_THREADS is set; on CUDA it leaves threads alone.
With torch's default (a thread per core in every process) a 1P1D burst on a 2-core box ran its
prefill step beside a small decode batch 6x slower than alone, and the gateway showed ~200
requests on a prefill worker whose last status said nothing ran. The processes are not started:
subprocess.Popen records each child's environment."""

from __future__ import annotations

import os

import pytest

from pd_serve import cli, launch


@pytest.fixture
def children(monkeypatch):
    """name -> the environment launch would start it with, for `pd-serve launch argv` on a host
    where this process may use 8 cores."""

    def start(argv: list[str]) -> dict[str, dict[str, str]]:
        started = {}

        class FakePopen:
            def __init__(self, cmd, env=None, **_):
                name = cmd[cmd.index("--worker-id") + 1] if "--worker-id" in cmd else "gateway"
                started[name] = env

        monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: 8)
        args, rest = cli.build_parser().parse_known_args(["launch", "--port", "0", *argv])
        args.engine_argv = rest
        cli._cluster_from_args(args)
        return started

    return start


def _threads(started: dict[str, dict[str, str]]) -> dict[str, str | None]:
    return {name: env.get("OMP_NUM_THREADS") for name, env in started.items() if name != "gateway"}


@pytest.mark.parametrize("argv,want", [
    ([], "4"),  # 1P1D: two ranks
    (["--prefill", "2", "--decode", "2"], "2"),
    (["--prefill-tp", "2", "--decode", "2"], "2"),  # 2 + 1 + 1 ranks
    (["--prefill", "4", "--decode", "8"], "1"),  # more ranks than cores: one each
])
def test_on_cpu_the_ranks_share_the_cores(monkeypatch, children, argv, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # (the test session sets it)
    threads = _threads(children(["--device", "cpu", *argv]))
    assert threads and set(threads.values()) == {want}, threads


def test_a_given_omp_num_threads_is_kept(monkeypatch, children):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert set(_threads(children(["--device", "cpu"])).values()) == {"3"}


def test_on_cuda_threads_are_left_alone(monkeypatch, children):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = _threads(children(["--device", "cuda", "--gpu-ids", "0,1"]))
    assert threads == {"prefill-0": None, "decode-1": None}
