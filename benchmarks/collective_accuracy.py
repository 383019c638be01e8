"""The planner's collective model against published nccl-tests measurements: per set the MAPE of the predicted
against the measured time, and the signed error by rank count and message size.

    .venv/bin/python benchmarks/collective_accuracy.py           # per set MAPE, signed errors by ranks and size
    .venv/bin/python benchmarks/collective_accuracy.py --rows    # ... and every row

Data: benchmarks/data/collective_runs.csv, one row per published measurement (nccl-tests' out-of-place time of one
collective over `ranks` ranks, `ranks_per_node` to a node, `bytes` as nccl-tests counts them: the all-reduce
buffer, the all-gather output, the reduce-scatter input) with its source. Sets whose name starts with `cal_` are
CALIBRATION data (a constant of the collective model may be set on them); every other set is EVALUATION data (no
constant of the planner was set on it). The two are printed apart. Each row is timed by the planner's own
plan.collectives.collective_time_s on the catalog system it ran on, over consecutive ranks (stride 1: the
nccl-tests launch, every GPU of each node).

Sets: one_node (8 H100 on NVLink: NCCL's default all-reduce, NVLS on Hopper, and ring reduce-scatter / all-gather),
two_node (16 GPUs on two p4de / p5 instances over EFA; at two nodes NCCL times rings and trees on the intra-node
bandwidth, src/graph/tuning.cc `bw = nNodes <= 2 ? bwIntra : bwInter`, so these are not the scale-out regime),
latency (8-byte all-reduces: the bare NCCL call, against the planner's per-call framework overhead), and
b200_scale_use3a / b200_scale_slinky (ring all-reduce and all-gather of 16 / 32 GiB on 8-512 B200 of two DGX-B200
class clusters with 8 x 400 Gb/s NDR rails, Together AI's published scaling reports; only bulk sizes are published
there, so these test the bandwidth term at scale, not the latency steps), and size_sweep_scale (NCCL's default
all-reduce and all-gather at every power of two from 1 MiB to 8 GiB on 32 H100, 4 nodes with 8 x 400 Gb/s InfiniBand:
the latency steps and the bandwidth term together beyond two nodes).

Calibration sets: cal_sweep_h100_ib (NCCL's default all-reduce at every power of two from 1 MiB to 8 GiB on 32 and 64
H100, 4 and 8 nodes of one cluster with InfiniBand 400G, catalog dgx-h100: NVIDIA/nccl-tests#309, gj-aion's
comments of 18 Jun 2025), for the per-step latency of the multi-node rings at mid sizes; size_sweep_scale stays the
evaluation sweep it is checked against.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from paratrain.hardware.catalog import get_catalog
from paratrain.plan.collectives import collective_time_s

RUNS_CSV = Path(__file__).parent / "data" / "collective_runs.csv"
CALIBRATION_PREFIX = "cal_"
SIZE_BUCKETS = ((0, "< 1 MiB"), (2**20, "1-64 MiB"), (2**26, "64 MiB-1 GiB"), (2**30, ">= 1 GiB"))


def load_rows(path: Path = RUNS_CSV) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def predicted_time_s(catalog, row: dict) -> float:
    """The planner's time of the row's collective: consecutive ranks, whole nodes (as nccl-tests launches)."""
    system = catalog.system(row["system"])
    ranks, per_node = int(row["ranks"]), int(row["ranks_per_node"])
    if per_node != min(ranks, system.devices_per_node):
        raise ValueError(f"{row['system']}: {per_node} ranks per node of {system.devices_per_node}: not a "
                         "consecutive-rank group the planner's stride-1 timing describes")
    # nccl-tests' default run leaves NVLS on where the switch has it (NCCL_NVLS_ENABLE unset); NCCL_ALGO ring does not
    nvls = row["algorithm"].startswith("not stated")
    return float(collective_time_s(system, row["collective"], float(row["bytes"]), float(ranks), 1.0, nvls=nvls))


def signed_errors_pct(catalog, rows: list[dict]) -> np.ndarray:
    """(predicted - measured) / measured x 100 per row."""
    pred = np.array([predicted_time_s(catalog, r) for r in rows])
    meas = np.array([float(r["time_us"]) * 1e-6 for r in rows])
    return 100.0 * (pred - meas) / meas


def set_mapes(catalog, rows: list[dict]) -> dict[str, float]:
    """Mean absolute percentage error of the predicted time, per set."""
    sets = sorted({r["set"] for r in rows})
    return {s: float(np.mean(np.abs(signed_errors_pct(catalog, [r for r in rows if r["set"] == s])))) for s in sets}


def _size_bucket(nbytes: int) -> str:
    return [label for low, label in SIZE_BUCKETS if nbytes >= low][-1]


def is_calibration_set(name: str) -> bool:
    """Sets named cal_* are calibration data (a constant may be set on them); every other set is evaluation data."""
    return name.startswith(CALIBRATION_PREFIX)


def _report(catalog, rows: list[dict], show_rows: bool) -> None:
    mapes = set_mapes(catalog, rows)
    calibration = [s for s in mapes if is_calibration_set(s)]
    evaluation = [s for s in mapes if not is_calibration_set(s)]
    for role, names in (("EVALUATION data (no constant was set on these)", evaluation),
                        ("CALIBRATION data (cal_*: a constant of the collective model may be set on these)",
                         calibration)):
        if names:
            print(f"\n#### {role}")
            for name in names:
                _report_set(catalog, rows, name, mapes[name], show_rows)
    largest = max(int(r["ranks"]) for r in rows)
    print(f"\nlargest rank count in the data: {largest}")
    print("\nsummary:")
    for name in evaluation + calibration:
        role = "calibration" if is_calibration_set(name) else "evaluation"
        print(f"  {role:<11} {name:<20} MAPE {mapes[name]:5.1f}%")


def _report_set(catalog, rows: list[dict], name: str, mape_pct: float, show_rows: bool) -> None:
    members = [r for r in rows if r["set"] == name]
    err = signed_errors_pct(catalog, members)
    print(f"\n{name}: {len(members)} rows, MAPE {mape_pct:.1f}%")
    for label, key in (("ranks", lambda r: int(r["ranks"])), ("size", lambda r: _size_bucket(int(r["bytes"])))):
        groups: dict = {}
        for r, e in zip(members, err, strict=True):
            groups.setdefault((r["system"], r["collective"], key(r)), []).append(e)
        for (system, kind, value), errs in groups.items():
            print(f"  by {label:5s} {system:14s} {kind:13s} {str(value):>14s}: mean signed {np.mean(errs):+6.1f}%"
                  f" ({min(errs):+.1f}..{max(errs):+.1f}, {len(errs)} rows)")
    if show_rows:
        for r, e in zip(members, err, strict=True):
            pred_us = predicted_time_s(catalog, r) * 1e6
            print(f"    {r['system']:14s} {r['collective']:13s} {int(r['ranks']):5d} ranks {int(r['bytes']):>12d} B"
                  f"  measured {float(r['time_us']):9.1f} us  predicted {pred_us:9.1f} us  {e:+6.1f}%")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", action="store_true", help="print every row's predicted and measured time")
    args = parser.parse_args(argv)
    _report(get_catalog(), load_rows(), args.rows)


if __name__ == "__main__":
    main()
