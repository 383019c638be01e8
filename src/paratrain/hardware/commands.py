"""`paratrain hardware list` and `paratrain hardware show NAME`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paratrain.cli import Output, command, opt, show
from paratrain.hardware.catalog import get_catalog
from paratrain.hardware.describe import chip_rows, describe, print_list, print_tree, system_summary

GROUPS = [("hardware", "the accelerator catalog (list, show)")]


@dataclass(kw_only=True)
class CatalogArgs(Output):
    hardware_file: list[Path] = opt("also load this hardware TOML file (repeatable)", factory=list, metavar="FILE")


@command("hardware list", CatalogArgs, "one line per system and chip")
def cmd_list(args) -> None:
    catalog = get_catalog(args.hardware_file or None)
    rows, chips = [system_summary(s) for s in catalog.systems.values()], chip_rows(catalog)
    show(args, {"systems": rows, "chips": chips}, lambda: print_list(rows, chips))


@command("hardware show", CatalogArgs, "every field of one system or chip, with sources",
         name=(str, opt("system or chip name (see `paratrain hardware list`)", positional=True)))
def cmd_show(args) -> None:
    detail = describe(get_catalog(args.hardware_file or None), args.name)
    show(args, detail, lambda: print_tree(detail))
