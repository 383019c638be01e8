"""The long help of every command has one source, the package's cli_help.md (also the commands' documentation,
linked from docs/cli.md): `--help` prints each section, every section belongs to a command, and the file ships
in the package."""

from __future__ import annotations

import argparse
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from paratrain.cli import build_parser, command_help
from paratrain.hardware.catalog import ENV_DIR

ROOT = Path(__file__).resolve().parents[1]


def _parsers(parser, name=""):
    """(command name, its parser) for the whole CLI: `serve plan` under `serve`; the root is `paratrain`."""
    yield name or "paratrain", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}".strip())


def test_every_section_is_printed_verbatim_by_its_commands_help():
    parsers, sections = dict(_parsers(build_parser())), command_help()
    assert not set(sections) - set(parsers), "sections of cli_help.md that name no command"
    assert {"train", "estimate", "plan", "simulate", "serve", "launch", "verify", "compare"} <= set(sections)
    for name, blocks in sections.items():
        text = parsers[name].format_help()
        assert 1 <= len(blocks) <= 2 and all(b.strip() for b in blocks), name
        for block in blocks:
            assert block in text, f"{name} --help lacks its cli_help.md text"
    simulate = parsers["simulate"].format_help()  # a second block is printed below the options
    assert simulate.index(sections["simulate"][0]) < simulate.index("\ncluster:\n") < simulate.index(
        sections["simulate"][1])


def test_help_text_names_the_catalog_variable():
    assert f"${ENV_DIR}" in command_help()["hardware"][0]


def test_the_help_file_is_package_data():
    """An installed wheel has the file: the package-data globs of pyproject.toml match it."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["paratrain"]
    assert (ROOT / "src/paratrain/cli_help.md").is_file()
    assert any(fnmatch("cli_help.md", g) for g in globs)


def test_main_builds_only_its_command_and_every_help_reads_the_same(capsys):
    """main() gives the command its argv names its options (build_parser(only=...)); the others are listed by their
    help line only. Every `--help` (the root, each group, each command) and a bad command's error read exactly as
    with the whole parser built."""
    from paratrain.cli import chosen_commands

    full = dict(_parsers(build_parser()))
    for name, parser in full.items():
        argv = [] if name == "paratrain" else name.split()
        lazy = dict(_parsers(build_parser(only=chosen_commands([*argv, "--help"]))))
        assert lazy[name].format_help() == parser.format_help(), name
        assert lazy[name].format_usage() == parser.format_usage(), name
    assert chosen_commands(["serve", "plan", "--model", "x"]) == {"serve", "serve plan"}
    assert chosen_commands(["--version"]) == set()
    lazy = build_parser(only=chosen_commands(["trian"]))
    errors = []
    for parser in (lazy, build_parser()):
        try:
            parser.parse_args(["trian"])
        except SystemExit as exc:
            errors.append((exc.code, capsys.readouterr().err))
    assert len(errors) == 2 and errors[0] == errors[1] and "invalid choice: 'trian'" in errors[0][1], errors
    assert len(dict(_parsers(lazy))) == len(full)  # every command still listed
