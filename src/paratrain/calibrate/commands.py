"""`paratrain probe` (measure this machine) and `paratrain calibrate` (fit the planner to measured runs)."""

from __future__ import annotations

from paratrain.calibrate.probe import probe_json, run_probe, write_probe
from paratrain.calibrate.session import Calibration, print_calibration, print_probe, run_calibration
from paratrain.cli import Output, command, from_options, opt, options_of, show
from paratrain.device import CPU, CUDA, NEURON, Accelerator, resolve_device_type

PROBE_DEVICES = (CPU, CUDA, NEURON)


@command("probe", Output, "measure this machine and write a hardware file for the planner",
         out=(str, opt("hardware TOML to write", "runs/hardware/local.toml", metavar="FILE", writes="file")),
         name=(str, opt("system name in the catalog", "local")),
         ranks=(int | None, opt("ranks per node the entry describes (default: this machine's cores on CPU); more "
                                "ranks than cores share them, each at its share of a core", ge=1)),
         groups=(tuple[int, ...], opt("group sizes to time collectives on (comma list)", (2, 4), ge=2)),
         device=(str, opt("where to probe: the host, or an accelerator (bf16 matmuls; collectives on the host "
                          "only)", PROBE_DEVICES[0], choices=PROBE_DEVICES)),
         quick=(bool, opt("fewer sizes and repeats (about 10 s)")))
def run_probe_cmd(args) -> None:
    resolve_device_type(args.device, Accelerator.detect(), field="--device")  # one line, before any measurement
    res = run_probe(args.device, list(args.groups), quick=args.quick, log=lambda m: None if args.json else print(m))
    out = write_probe(res, args.out, args.name, args.ranks)
    show(args, {**probe_json(res), "hardware_file": str(out)}, lambda: print_probe(res, out))


@command("calibrate", (options_of(Calibration), Output),
         "fit the planner to measured runs; write a calibrated hardware file")
def run_calibrate_cmd(args) -> None:
    out = run_calibration(from_options(Calibration, args))
    show(args, out, lambda: print_calibration(out))
