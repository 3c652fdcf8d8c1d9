"""Every `pd-serve` command, and every benchmark of bench/ that the docs run, prints its --help
(a help string with a bare % breaks argparse's formatting, and only --help shows it)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from pd_serve.cli import build_parser, main

REPO_ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


@pytest.mark.parametrize("argv", [[c, "--help"] for c in _commands()])
def test_help_prints(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["serving", "phase_ratio", "planner_check"])
def test_benchmark_help_prints(name, capsys, monkeypatch):
    """The benchmarks are scripts of the checkout (bench/ is not installed), run as
    `python bench/NAME.py`."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    module = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out
