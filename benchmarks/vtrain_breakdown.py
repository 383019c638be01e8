"""vTrain single-node calibration set (benchmarks/data/published/vtrain_ground_truth_single.csv) broken down: the
planner's signed step-time error by hidden size, TP degree and microbatch, and per layout the measured and predicted
time of one layer-microbatch (forward, recomputed forward, backward), the slope of a least-squares fit of the step
time against layers x microbatches over the rows that share the layout (docs/planner.md, "The host-issue floor").

    PYTHONPATH=src:. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vtrain_breakdown.py
"""

from __future__ import annotations

import re
import sys

import numpy as np

from benchmarks.planner_accuracy import vtrain
from paratrain.hardware.catalog import get_catalog


def rows() -> list[dict]:
    out = []
    for label, pred, meas in vtrain(get_catalog().system("p4d.24xlarge")):
        d = {k: int(v) for k, v in re.findall(r"([a-zA-Z]+)(\d+)", label)}
        out.append({**d, "pred": pred, "meas": meas, "err": (pred - meas) / meas * 100})
    return out


def main() -> int:
    data = rows()
    print(f"vtrain_single: {len(data)} rows, MAPE {np.mean([abs(r['err']) for r in data]):.1f}%")
    for key in ("h", "tp", "mb", "pp"):
        groups: dict[int, list[float]] = {}
        for r in data:
            groups.setdefault(r[key], []).append(r["err"])
        print(f"  signed error by {key}: " + ", ".join(f"{k}: {np.mean(v):+.1f}% (n={len(v)})"
                                                      for k, v in sorted(groups.items())))
    print("\nms per layer-microbatch, measured / predicted (pp 1, dp 1 or the smallest dp measured)")
    for h in sorted({r["h"] for r in data}):
        for tp in sorted({r["tp"] for r in data}):
            cells = []
            for mb in sorted({r["mb"] for r in data}):
                same = [r for r in data if r["h"] == h and r["tp"] == tp and r["mb"] == mb and r["pp"] == 1]
                dps = sorted({r["dp"] for r in same})
                same = [r for r in same if dps and r["dp"] == dps[0]]
                if len(same) < 2:
                    cells.append("      -      ")
                    continue
                x = np.array([[1.0, r["L"] * r["gbs"] / r["dp"] / r["mb"]] for r in same])
                fit = [np.linalg.lstsq(x, np.array([r[k] for r in same]), rcond=None)[0][1] * 1e3 for k in ("meas", "pred")]
                cells.append(f"{fit[0]:5.2f} / {fit[1]:5.2f}")
            print(f"  h{h} tp{tp}: " + "  ".join(f"mb{mb} {c}" for mb, c in zip(sorted({r['mb'] for r in data}), cells, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
