"""The CLI generator: --version, config keys as flags (the same as --set, in command-line order), bounds
checked from the option dataclasses, units and defaults in the help."""

from __future__ import annotations

import pytest

from paratrain.cli import build_parser, main


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"paratrain {version('paratrain')}"


def test_config_keys_are_flags_in_order_with_set():
    args = build_parser().parse_args(["train", "--parallel.tp", "2", "--set", "parallel.tp=4", "--train.steps", "5"])
    assert args.set == ["parallel.tp=2", "parallel.tp=4", "train.steps=5"]


def test_a_config_key_flag_reaches_the_config(capsys):
    assert main(["config", "--parallel.tp", "2", "--train.microbatch", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp = 2" in out and "microbatch = 2" in out


def test_a_bound_is_one_line_naming_the_flag(capsys):
    argv = ["plan", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "2", "--top", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["paratrain plan: error: --top = 0: must be >= 1"]


def test_help_names_units_and_shared_defaults():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("plan", "estimate", "compare", "recommend"):
        text = sub[name].format_help()
        assert "--seq SEQ" in text and "(default 4096)" in text and "--global-batch" in text, name
