"""`paratrain probe` (measure this machine) and `paratrain calibrate` (fit the planner to measured runs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROBE_HELP = """\
Measure this machine the way training ranks use it and write a hardware file for the planner:
matmul throughput by size, memory bandwidth, and gloo collectives (all-reduce, reduce-scatter, all-gather,
send/recv) by message size and group size, fitted to latency + bytes/bandwidth.

  paratrain probe --out hardware/local.toml
  PARATRAIN_HARDWARE_DIR=hardware paratrain plan --hardware local --nodes 1 ...
"""


def register(sub) -> None:
    p = sub.add_parser("probe", help="measure this machine and write a hardware file for the planner",
                       description=PROBE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/hardware/local.toml", help="hardware TOML to write")
    p.add_argument("--name", default="local", help="system name in the catalog (default: local)")
    p.add_argument("--ranks", type=int, default=8, help="ranks per node the system entry describes")
    p.add_argument("--groups", default="2,4", help="group sizes to time collectives on (comma list)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about 10 s)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.set_defaults(func=run_probe_cmd)


def run_probe_cmd(args) -> int:
    from paratrain.calibrate.probe import hardware_toml, run_probe
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
    if args.json:
        print(json.dumps({"matmul_tflops_by_size": res.matmul_tflops_by_size,
                          "memory_bw_gbytes_per_s": res.memory_bw_gbytes_per_s, "collective_fits": res.fits,
                          "hardware_file": str(out)}, indent=2))
    else:
        print(f"peak matmul {res.peak_tflops * 1e3:,.1f} GFLOP/s per rank, memory {res.memory_bw_gbytes_per_s:.1f} GB/s")
        for kind, fit in res.fits.items():
            print(f"{kind:>15}: latency {fit['latency_us']:.0f} us, bandwidth {fit['bw_gbytes_per_s']:.2f} GB/s")
        print(f"wrote {out}")
    return 0
