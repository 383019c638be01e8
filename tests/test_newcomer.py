"""The newcomer pass of 1 December 2026 (docs/cli.md): inputs that printed a screenful, a traceback or a wrong
result; each is now one line naming the value and what is allowed (exit 2), or the right result. In-process,
small: the whole file is a few CPU-seconds."""

from __future__ import annotations

import pytest

from paratrain.cli import main


def _one_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside parse_args
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv, says", [
    (["plan", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "1", "--objective", "speed"],
     "paratrain plan: error: argument --objective: invalid choice: 'speed' (choose from 'time', 'cost')"),
    (["compare", "--model", "llama2-7b", "--train-tokens", "abc", "--targets", "p5.48xlarge:4"],
     "paratrain compare: error: argument --train-tokens: invalid float value: 'abc'"),
    (["serve", "estimate", "--model", "llama3-8b", "--hardware", "p5.48xlarge"],
     "paratrain serve estimate: error: the following arguments are required: --prompt-tokens"),
    (["train", "--bogus"], "paratrain train: error: unrecognized arguments: --bogus (`paratrain train --help`"),
    (["serve", "plan", "--model", "llama3-8b", "--bogus", "1"], "`paratrain serve plan --help` lists every"),
])
def test_argparse_errors_are_one_line_naming_the_command(capsys, argv, says):
    """argparse printed its usage (up to 30 lines) above the error; `unrecognized arguments` named no command."""
    assert says in _one_line(capsys, argv)
