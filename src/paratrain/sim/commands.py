"""`paratrain simulate`: failures, checkpoints, restarts, spares and stragglers over a whole training run."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from paratrain.cli import Output, UserError, Workload, command, opt, show
from paratrain.hardware.catalog import PURCHASE_HELP, PURCHASE_OPTIONS
from paratrain.sim.config import TITLES, config_from_options, sim_options
from paratrain.sim.engine import simulate
from paratrain.sim.report import daly_check, format_report, print_daly_check, progress_bars, write_plots
from paratrain.sim.results import summarize


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
                               metavar="DIR", group="output", writes="dir")),
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
