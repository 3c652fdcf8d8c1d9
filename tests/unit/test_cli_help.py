"""Every `pd-serve` command, and every benchmark behind `pd-serve bench`, prints its --help (a
help string with a bare % breaks argparse's formatting, and only --help shows it)."""

from __future__ import annotations

import argparse

import pytest

from pd_serve.cli import build_parser, main


def _commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


@pytest.mark.parametrize("argv", [[c, "--help"] for c in _commands() if c != "bench"]
                         + [["bench", name, "--help"] for name in ("serving", "phase-ratio",
                                                                    "planner-check")])
def test_help_prints(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out
