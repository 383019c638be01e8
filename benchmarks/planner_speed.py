"""Planner search speed on ~1,000,000-device clusters (goal: a full `plan` search under 5 s; Calculon ~10/s).

    .venv/bin/python benchmarks/planner_speed.py

Each case runs the same `paratrain.plan.search` the CLI uses (every tp, pp, cp, microbatch, sp, recompute,
schedule and virtual stages, ZeRO stage / FSDP / HSDP combination), timed end to end including grid building
and ranking, best of 3. `layouts/s` counts layouts that went through the full model (the valid ones).
"""

from __future__ import annotations

import sys
import time

from paratrain.hardware.catalog import get_catalog
from paratrain.plan.api import Layout, estimate, search

CASES = [
    # (model, system, nodes, seq, global batch, extra search kwargs)
    ("llama3-70b", "trn1.32xlarge", 31250, 8192, 62500, {"any_stack": True}),  # exactly 1,000,000 NeuronCores
    ("llama3.1-405b", "trn1.32xlarge", 32768, 8192, 16384, {"any_stack": True}),  # 1,048,576 NeuronCores
    ("llama3.1-405b", "p5.48xlarge", 131072, 8192, 16384, {}),             # 1,048,576 H100
    ("llama3.1-405b", "trn3-ultraserver", 1820, 32768, 4095, {}),          # 1,048,320 Trn3 cores, CP searched
    ("llama3-70b", "trn2-ultraserver", 4096, 8192, 16384, {"any_stack": True}),  # 1,048,576, every choice
    ("llama3.1-405b", "p5.48xlarge", 131072, 8192, 16384,
     {"objective": "cost", "train_tokens": 15e12, "max_time_s": 60 * 86400}),  # cost: 18 node counts, 60-day cap
]


def main() -> int:
    catalog = get_catalog()
    print(f"{'model':<14} {'system':<17} {'devices':>9} {'combos':>9} {'layouts':>8} {'fit':>6} "
          f"{'time s':>7} {'layouts/s':>11}  best layout")
    worst = 0.0
    for model, system, nodes, seq, gbs, kw in CASES:
        devices = nodes * catalog.system(system).devices_per_node
        best_time, res = float("inf"), None
        for _ in range(3):
            start = time.perf_counter()
            res = search(model, system, nodes, seq, gbs, top=10, **kw)
            best_time = min(best_time, time.perf_counter() - start)
        worst = max(worst, best_time)
        top = res.candidates[0].layout if res.candidates else None
        desc = "none fits" if top is None else (f"tp{top.tp} pp{top.pp} cp{top.cp} dp{top.dp} mb{top.microbatch} "
                                                f"{top.recompute} {top.pp_schedule} {top.dp_kind}-z{top.zero_stage}")
        label = model + (" (cost)" if kw.get("objective") == "cost" else "")
        print(f"{label:<14} {system:<17} {devices:>9,} {res.combinations:>9,} {res.valid:>8,} {res.fitting:>6,} "
              f"{best_time:>7.3f} {res.valid / best_time:>11,.0f}  {desc}")
    # one estimate (the API the simulator and cost model call in loops)
    start = time.perf_counter()
    n = 200
    for _ in range(n):
        estimate("llama2-7b", "trn1.32xlarge", 128, 4096, 1024, Layout(tp=8, sp=True, recompute="selective", microbatch=1))
    per = (time.perf_counter() - start) / n
    print(f"\nsingle estimate(): {per * 1e3:.2f} ms ({1 / per:,.0f}/s)")
    print(f"slowest full search: {worst:.3f} s (goal < 5 s) -> {'PASS' if worst < 5 else 'FAIL'}")
    return 0 if worst < 5 else 1


if __name__ == "__main__":
    sys.exit(main())
