"""`paratrain hardware list` and `paratrain hardware show NAME`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paratrain.cli import Output, command, opt, print_json
from paratrain.hardware.catalog import get_catalog


@dataclass(kw_only=True)
class CatalogArgs(Output):
    hardware_file: list[Path] = opt("also load this hardware TOML file (repeatable)", factory=list, metavar="FILE")


@dataclass(kw_only=True)
class ShowArgs(CatalogArgs):
    name: str = opt("system or chip name (see `paratrain hardware list`)", positional=True)


GROUPS = [("hardware", "the accelerator catalog (list, show)")]


@command("hardware list", CatalogArgs, "one line per system and chip")
def cmd_list(args) -> None:
    from paratrain.hardware.describe import chip_rows, print_list, system_summary

    catalog = get_catalog(args.hardware_file or None)
    rows, chips = [system_summary(s) for s in catalog.systems.values()], chip_rows(catalog)
    print_json({"systems": rows, "chips": chips}) if args.json else print_list(rows, chips)


@command("hardware show", ShowArgs, "every field of one system or chip, with sources")
def cmd_show(args) -> None:
    from paratrain.hardware.describe import describe, print_tree

    detail = describe(get_catalog(args.hardware_file or None), args.name)
    print_json(detail) if args.json else print_tree(detail)
