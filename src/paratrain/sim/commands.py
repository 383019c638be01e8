"""`paratrain simulate`: failures, checkpoints, restarts, spares and stragglers over a whole training run."""

from __future__ import annotations

import dataclasses
import time
import typing
from pathlib import Path

from paratrain.cli import Output, UserError, Workload, command, opt, show
from paratrain.hardware.catalog import PURCHASE_HELP, PURCHASE_OPTIONS
from paratrain.sim.config import SimConfig, config_from_options, parse_duration_s
from paratrain.sim.engine import simulate
from paratrain.sim.report import daly_check, format_report, print_daly_check, progress_bars, write_plots
from paratrain.sim.results import summarize


def GB(value: float, _flag: str) -> float:  # noqa: N802 (a unit, as parse_duration_s is one)
    return value * 1e9


# a field's unit suffix -> its flag's suffix, the conversion of the flag's value and the unit shown in its help
# (a duration flag's value carries its unit: 90s, 20m, 2.5h, 54d)
FLAG_UNITS = {"_bytes_per_s": ("_gbps", GB, "GB/s"), "_bytes": ("_gb", GB, "GB"), "_s": ("", parse_duration_s, "")}
TITLES = {"workload": "workload (give --steps, or --duration for a fixed window)", "failures": "failures and recovery",
          "cost": "cost and Monte Carlo"}


def _shown(value: float, conv) -> str:
    """A default in the flag's unit: 1e12 bytes -> 1000 (GB), 180 s -> 3m."""
    if conv is GB:
        return f"{value / 1e9:g}"
    size, unit = next(((n, u) for n, u in ((86400, "d"), (3600, "h"), (60, "m"), (1, "s"))
                       if value >= n and value % n == 0), (1, "s"))
    return f"{value / size:g}{unit}"


def sim_options(cls=SimConfig, prefix: str = "") -> list[tuple]:
    """simulate's options of SimConfig's (and StragglerConfig's) fields with a help: the help, choices and default
    from the field, the flag in the field's unit (detect_s -> --detect 60s, checkpoint_bytes -> --checkpoint-gb);
    None unless given, so --config and the catalog fill the rest (config_from_options, by `to`)."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):  # stragglers: StragglerConfig's, where SimConfig has them
            out += sim_options(hints[f.name], f"{prefix}{f.name}.")
        if "help" not in f.metadata:
            continue
        meta, suffix = dict(f.metadata), next((s for s in FLAG_UNITS if f.name.endswith(s)), "")
        flag_suffix, conv, unit = FLAG_UNITS.get(suffix, ("", None, ""))
        name = meta.pop("flag", "--" + f.name.removesuffix(suffix) + flag_suffix)[2:].replace("-", "_")
        shown = None if f.default in (None, dataclasses.MISSING) else _shown(f.default, conv) if conv else f.default
        notes = "; ".join(x for x in (unit, None if shown is None else f"default {shown:g}" if isinstance(
            shown, float) else f"default {shown}") if x)
        kinds = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
        kind = str if conv is parse_duration_s or len(kinds) > 1 else float if conv else kinds[0]  # str | float: str
        group = meta.pop("group", "stragglers")
        meta |= {"group": TITLES.get(group, group), "to": prefix + f.name} | ({"conv": conv} if conv else {})
        out.append((name, kind | None, opt(meta.pop("help") + (f" ({notes})" if notes else ""), **meta)))
    return out


@command("simulate", (dataclasses.make_dataclass("SimOptions", sim_options(), kw_only=True), Workload, Output),
         "failures, checkpoints, spares and stragglers at cluster scale (goodput, time, cost)",
         config=(str | None, opt("TOML file with SimConfig fields (see docs/simulator.md)", metavar="FILE")),
         hardware=(str | None, opt("catalog system (e.g. p5.48xlarge, trn2.48xlarge): fills chips per node and the "
                                   "price per chip-hour", group="cluster")),
         purchase=(str, opt(PURCHASE_HELP + " (the price --hardware fills in)", "on-demand", choices=PURCHASE_OPTIONS,
                            group="cluster")),
         failures_file=(str | None, opt("TOML failure model ([[cause]] tables) instead of the Llama 3 table",
                                        group=TITLES["failures"], metavar="TOML")),
         rate_scale=(float | None, opt("multiply every failure rate (default 1)", group=TITLES["failures"])),
         price=(str | None, opt("", group=TITLES["cost"], refused="ambiguous (USD per device-hour here, per "
                                "node-hour in `paratrain compare`); use --price-per-device-hour-usd USD")),
         plot=(str | None, opt("write PNGs of goodput vs checkpoint interval, vs cluster size and vs spare nodes",
                               metavar="DIR", group="output")),
         daly_check=(bool, opt("reproduce Daly's published examples analytically and by simulation, then exit",
                               group="output")))
def run_simulate(args) -> None:
    if args.daly_check:
        rows = daly_check(samples=args.samples or 200, seed=args.seed or 0, progress=progress_bars(args.json)(
            "Daly cases"))
        return show(args, rows, lambda: print_daly_check(rows))
    cfg, started = config_from_options(args), time.perf_counter()
    report = summarize(simulate(cfg))
    report["elapsed_s"] = time.perf_counter() - started
    if args.plot:
        try:
            report["plots"] = write_plots(cfg, Path(args.plot), json_mode=args.json)
        except OSError as exc:
            raise UserError(f"--plot {args.plot!r}: cannot write there ({exc.strerror})") from None
    show(args, report, lambda: print(format_report(report)))
