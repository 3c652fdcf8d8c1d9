"""`pd-serve launch` stops its gateway with its workers, so its workers drain for 0 s on SIGTERM
unless --drain-timeout is given; the gateway gets no such flag. The processes are not started:
LocalCluster._start records what it would run."""

from __future__ import annotations

import pytest

from pd_serve import cli
from pd_serve.launch import LocalCluster, flag_value


@pytest.mark.parametrize("argv,want", [([], "0"), (["--drain-timeout", "45"], "45")])
def test_launch_workers_drain_timeout(monkeypatch, argv, want):
    started = []
    monkeypatch.setattr(LocalCluster, "_start",
                        lambda self, name, args, log_level, gpu=None: started.append((name, args)))
    args, rest = cli.build_parser().parse_known_args(["launch", "--device", "cpu", *argv])
    args.engine_argv = rest
    cli._cluster_from_args(args)
    workers = {name: flag_value(a, "--drain-timeout", None) for name, a in started if name != "gateway"}
    assert workers == {"prefill-0": want, "decode-1": want}
    assert all("--drain-timeout" not in a for name, a in started if name == "gateway")
