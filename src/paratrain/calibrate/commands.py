"""`paratrain probe` (measure this machine) and `paratrain calibrate` (fit the planner to measured runs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paratrain.device import CPU, CUDA, NEURON

PROBE_DEVICES = (CPU, CUDA, NEURON)

PROBE_HELP = """\
Measure this machine the way training ranks use it and write a hardware file for the planner:
matmul throughput by size, memory bandwidth, and gloo collectives (all-reduce, reduce-scatter, all-gather,
send/recv) by message size and group size, fitted to the planner's own collective model: latency per ring
step, bandwidth, and on CPU hosts the extra wait per step when more ranks than cores take turns (probe
groups larger than the core count, e.g. --groups 2,4,8 on 2 cores, to measure it).

  paratrain probe --out hardware/local.toml
  PARATRAIN_HARDWARE_DIR=hardware paratrain plan --hardware local --nodes 1 ...
"""


def register(sub) -> None:
    register_probe(sub)
    register_calibrate(sub)


def register_probe(sub) -> None:
    p = sub.add_parser("probe", help="measure this machine and write a hardware file for the planner",
                       description=PROBE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/hardware/local.toml", help="hardware TOML to write")
    p.add_argument("--name", default="local", help="system name in the catalog (default: local)")
    p.add_argument("--ranks", type=int, default=None,
                   help="ranks per node the entry describes (default: this machine's cores on CPU); more ranks "
                        "than cores share them, each at its share of a core")
    p.add_argument("--groups", default="2,4", help="group sizes to time collectives on (comma list)")
    p.add_argument("--device", choices=PROBE_DEVICES, default=PROBE_DEVICES[0],
                   help="where to probe: the host, or an accelerator (bf16 matmuls; collectives on the host only)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about 10 s)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.set_defaults(func=run_probe_cmd)


CALIBRATE_HELP = """\
Fit the planner's efficiency parameters of a hardware entry (a TOML file, e.g. the one `paratrain probe`
wrote) to measured runs (`paratrain train --summary-json FILE` writes one per run), and write them back.
Only physical parameters are fitted (matmul efficiency and per-kernel overhead, memory-bound efficiency
(held at the probe's measurement on a probed machine), link bandwidth and latency scale, the fixed software
cost of one collective call, data-parallel overlap); see src/paratrain/calibrate/fit.py.

  paratrain calibrate --hardware runs/hardware/local.toml runs/calib/*.json
  paratrain calibrate --hardware runs/hardware/local.toml --holdout 0.5 runs/calib/*.json   # check on half
"""


def register_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="fit the planner to measured runs and write the hardware file back",
                       description=CALIBRATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run summaries (JSON from paratrain train --summary-json)")
    p.add_argument("--hardware", required=True, help="hardware TOML file holding the system to calibrate")
    p.add_argument("--system", default="local", help="system name inside that file (default: local)")
    p.add_argument("--holdout", type=float, default=0.0,
                   help="fraction of runs kept out of the fit and only predicted (every other run)")
    p.add_argument("--dry-run", action="store_true", help="fit and report, do not write the file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_calibrate_cmd)


def run_calibrate_cmd(args) -> int:
    from paratrain.calibrate.fit import fit, load_measurements, mape, write_back
    from paratrain.cli import UserError
    if not 0 <= args.holdout < 1:
        raise UserError(f"--holdout {args.holdout}: allowed: 0 <= fraction < 1")
    runs = load_measurements(args.runs)
    system = _system_from_file(args.hardware, args.system)
    step = round(1 / args.holdout) if args.holdout else 0
    test = [m for i, m in enumerate(runs) if step and i % step == 1]
    train = [m for m in runs if m not in test]
    if not train:
        raise UserError("calibrate: no runs left to fit after the holdout")
    before, _ = mape(system, train)
    fitted, report = fit(system, train)
    after, rows = mape(fitted, train)
    out = {"fit_runs": len(train), "mape_before": before, "mape_fit": after, "parameters": report["parameters"],
           "fit_rows": rows}
    if test:
        out["mape_holdout"], out["holdout_rows"] = mape(fitted, test)
    if not args.dry_run:
        write_back(args.hardware, args.system, report["parameters"],
                   f"calibrated by `paratrain calibrate` on {len(train)} runs (MAPE {after:.1%})")
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(f"fitted on {len(train)} runs: MAPE {before:.1%} before, {after:.1%} after")
    for k, v in report["parameters"].items():
        print(f"  {k:>20} = {v:.4g}")
    for label, key in (("fit", "fit_rows"), ("held out", "holdout_rows")):
        for r in out.get(key, []):
            print(f"  [{label}] {r['run']:<28} measured {r['measured_s'] * 1e3:8.1f} ms  predicted "
                  f"{r['predicted_s'] * 1e3:8.1f} ms  error {r['error']:+.1%}")
    if test:
        print(f"held-out MAPE {out['mape_holdout']:.1%} on {len(test)} runs")
    if not args.dry_run:
        print(f"wrote the parameters into {args.hardware}")
    return 0


def _system_from_file(path: str, name: str):
    from pathlib import Path

    from paratrain.hardware.catalog import CatalogError, load_catalog

    if not Path(path).is_file():
        raise ValueError(f"--hardware '{path}': no such file")
    try:
        return load_catalog([Path(path)]).system(name)
    except CatalogError as exc:
        raise ValueError(str(exc)) from None


def run_probe_cmd(args) -> int:
    from paratrain.calibrate.probe import hardware_toml, probe_json, run_probe
    from paratrain.cli import UserError

    try:
        groups = [int(g) for g in args.groups.split(",") if g]
    except ValueError:
        raise UserError(f"--groups '{args.groups}': expected comma-separated integers, e.g. 2,4") from None
    if any(g < 2 for g in groups):
        raise UserError(f"--groups '{args.groups}': group sizes must be >= 2")
    res = run_probe(args.device, groups, quick=args.quick, log=lambda m: None if args.json else print(m))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(hardware_toml(res, args.name, args.ranks))
    out.with_suffix(".probe.json").write_text(json.dumps(probe_json(res), indent=2))
    if args.json:
        print(json.dumps({"matmul_tflops_by_size": res.matmul_tflops_by_size,
                          "memory_bw_gbytes_per_s": res.memory_bw_gbytes_per_s, "collective_fits": res.fits,
                          "link_fit": res.link_fit,
                          "hardware_file": str(out)}, indent=2))
    else:
        print(f"peak matmul {res.peak_tflops * 1e3:,.1f} GFLOP/s per rank, memory {res.memory_bw_gbytes_per_s:.1f} GB/s")
        for kind, fit in res.fits.items():
            print(f"{kind:>15}: latency {fit['latency_us']:.0f} us, bandwidth {fit['bw_gbytes_per_s']:.2f} GB/s")
        if (link := res.link_fit):
            print(f"planner's link model (all collectives, {link['points']} points, MAPE {link['mape']:.0%}): "
                  f"{link['latency_us']:.0f} us per ring step, +{link['timeshare_step_us']:.0f} us per step for "
                  f"each further rank sharing a core ({link['cores']} cores), {link['bw_gbytes_per_s']:.2f} GB/s")
        print(f"wrote {out}")
    return 0
