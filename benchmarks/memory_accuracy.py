"""Memory accuracy: the planner's memory per device (Estimate.memory_per_device_bytes, the rank that needs the most)
against the peak memory published runs measured with the same layout, per set predicted vs measured, MAPE and the
signed error (prediction - measurement, in % of the measurement).

    .venv/bin/python benchmarks/memory_accuracy.py             # every set, every row
    .venv/bin/python benchmarks/memory_accuracy.py --breakdown # ... with the weights / grads / optimizer / activations

Data: benchmarks/data/memory_runs.csv, EVALUATION only (no constant is set on it): one row per published peak with the
run's full layout (the columns of eval_runs.csv, read the same way: benchmarks/planner_accuracy.py's _eval_options,
_eval_model and _system), the measured GiB (2^30 bytes), what was measured (`measure`) and the source (repo@commit path
and table). Like with like: torchtitan's `memory:` is torch.cuda's reserved_bytes.all.peak (torch.cuda.memory_stats;
torchtitan metrics.py DeviceMemoryMonitor.get_peak_stats at 9dec370), the caching allocator's segments at their peak:
every tensor plus the allocator's rounding and fragmentation, without the CUDA context and NCCL's buffers (cudaMalloc'd
outside the allocator). The planner's memory_per_device_bytes counts the same tensors (it checks them against the HBM
left after the context and the communicators' buffers, memory_capacity_bytes) and, for the fsdp2 stack, what FSDP2's
reduce-scatter and all-gather streams keep in their own allocator pools (Options.fsdp_stream_pools, memfrag); the
fragmentation inside a stream's segment is not counted (memory_usable_fraction 1.0 on the GPU systems).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

from benchmarks import planner_accuracy as bench
from paratrain.config.ranks import DEFAULT_RANK_ORDER
from paratrain.hardware.catalog import get_catalog
from paratrain.plan.api import Layout, estimate

MEMORY_CSV = Path(__file__).parent / "data" / "memory_runs.csv"
GIB = 2.0**30


def row_estimate(catalog, r: dict):
    """The planner's estimate of one published run, every layout field as published (no "best" fields: a memory row
    must name its whole layout), the software as the timing benchmark reads the same columns."""
    system = bench._system(catalog, r["system"])
    seq, nodes = int(r["seq"]), int(r["nodes"])
    fsdp = r["dp_kind"] in ("fsdp", "hsdp")
    tp = int(r["tp"])
    lay = Layout(tp=tp, pp=int(r["pp"]), cp=int(r["cp"]), sp=r["sp"] == "1" if r.get("sp") else tp > 1,
                 dp_kind=r["dp_kind"], zero_stage=int(r["zero_stage"]) if r.get("zero_stage") else 3 if fsdp else 1,
                 rank_order=r.get("rank_order") or DEFAULT_RANK_ORDER, microbatch=int(r["microbatch"]),
                 recompute=r["recompute"], pp_schedule=r["schedule"], virtual_stages=int(r["vp"]),
                 pp_layers="balanced")
    return estimate(bench._eval_model(r["model"], seq), system, nodes, seq, int(r["global_batch"]), lay,
                    bench._eval_options(system, r))


def memory_rows(path: Path = MEMORY_CSV) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def memory_sets(catalog, path: Path = MEMORY_CSV) -> dict[str, list[tuple]]:
    """Per set: (label, predicted GiB, measured GiB, estimate) of each row."""
    sets: dict[str, list[tuple]] = {}
    for r in memory_rows(path):
        est = row_estimate(catalog, r)
        label = (f"{r['model']} {int(r['nodes'])}x{r['system']} tp{r['tp']} pp{r['pp']} cp{r['cp']} "
                 f"mb{r['microbatch']} {r['recompute']} {r['precision']}{' compile' if r['compile'] == '1' else ''}"
                 f"{' asyncTP' if r['tp_overlap'] == '1' else ''} seq{r['seq']}")
        sets.setdefault(r["set"], []).append((label, est.memory_per_device_bytes / GIB, float(r["measured_gib"]), est))
    return sets


def set_errors(rows: list[tuple]) -> tuple[float, float]:
    """(MAPE, mean signed error) in % of the measured peaks."""
    pred, meas = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
    signed = (pred - meas) / meas * 100
    return float(np.mean(np.abs(signed))), float(np.mean(signed))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--breakdown", action="store_true", help="print each row's weights/grads/optimizer/activations")
    args = ap.parse_args()
    catalog = get_catalog()
    sets = memory_sets(catalog)
    print("EVALUATION (memory per device: planner vs measured torch max_memory_reserved, GiB)")
    for name, rows in sets.items():
        m, s = set_errors(rows)
        print(f"\n{name:24s} n={len(rows):2d}  MAPE {m:5.1f}%  signed {s:+5.1f}%")
        for label, pred, meas, est in rows:
            line = f"  {label:78s} pred {pred:6.1f}  meas {meas:6.1f}  {(pred - meas) / meas * 100:+6.1f}%"
            if args.breakdown:
                b = est.memory_breakdown_bytes
                line += "  [" + " ".join(f"{k}={v / GIB:.1f}"
                                         for k, v in b.items()) + "]"
            print(line + ("" if est.fits else "  (planner: does not fit)"))
    allrows = [r for rows in sets.values() for r in rows]
    m, s = set_errors(allrows)
    print(f"\nall rows                 n={len(allrows):2d}  MAPE {m:5.1f}%  signed {s:+5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
