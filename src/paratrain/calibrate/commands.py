"""`paratrain probe` (measure this machine) and `paratrain calibrate` (fit the planner to measured runs)."""

from __future__ import annotations

from paratrain.calibrate.probe import probe_json, run_probe, write_probe
from paratrain.calibrate.session import print_calibration, print_probe, run_calibration
from paratrain.cli import Output, command, opt, show
from paratrain.device import CPU, CUDA, NEURON

PROBE_DEVICES = (CPU, CUDA, NEURON)


@command("probe", Output, "measure this machine and write a hardware file for the planner",
         out=(str, opt("hardware TOML to write", "runs/hardware/local.toml", metavar="FILE")),
         name=(str, opt("system name in the catalog", "local")),
         ranks=(int | None, opt("ranks per node the entry describes (default: this machine's cores on CPU); more "
                                "ranks than cores share them, each at its share of a core", ge=1)),
         groups=(tuple[int, ...], opt("group sizes to time collectives on (comma list)", (2, 4), ge=2)),
         device=(str, opt("where to probe: the host, or an accelerator (bf16 matmuls; collectives on the host "
                          "only)", PROBE_DEVICES[0], choices=PROBE_DEVICES)),
         quick=(bool, opt("fewer sizes and repeats (about 10 s)")))
def run_probe_cmd(args) -> None:
    res = run_probe(args.device, list(args.groups), quick=args.quick, log=lambda m: None if args.json else print(m))
    out = write_probe(res, args.out, args.name, args.ranks)
    show(args, {**probe_json(res), "hardware_file": str(out)}, lambda: print_probe(res, out))


@command("calibrate", Output, "fit the planner to measured runs; write a calibrated hardware file",
         runs=(list[str], opt("run summaries: JSON from paratrain train --summary-json (the planner's parameters) "
                              "and/or paratrain generate --summary-json (the serving model's, into "
                              "[systems.X.serving])", positional=True, nargs="+", factory=list)),
         hardware=(str, opt("hardware TOML file holding the system to calibrate", required=True, metavar="FILE")),
         system=(str, opt("system name inside that file", "local")),
         out=(str | None, opt("hardware TOML to write (default: <hardware>.calibrated.toml beside it)",
                              metavar="FILE")),
         in_place=(bool, opt("rewrite the --hardware file itself")),
         holdout=(float, opt("fraction of runs kept out of the fit and only predicted (every other run), in [0, 1)",
                             0.0, ge=0, lt=1)),
         suggest=(int | None, opt("list the next N runs (default 3) that best separate the parameters, each with "
                                  "its config (<runs folder>/next/<layout>.toml); writes no hardware file",
                                  nargs="?", const=3, metavar="N", ge=1)),
         dry_run=(bool, opt("fit and report, do not write a file")))
def run_calibrate_cmd(args) -> None:
    out = run_calibration(args)
    show(args, out, lambda: print_calibration(out))
