"""CPU seconds of the test suite per file and per test, from `pytest --cpu-report=PATH` (tests/cpu_report.py).

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests --cpu-report=/tmp/cpu.json
    python benchmarks/suite_cpu.py /tmp/cpu.json                 # table per file + the slowest tests
    python benchmarks/suite_cpu.py /tmp/after.json --before /tmp/before.json   # before/after per file

CPU = user + sys of pytest and all its children (subprocesses, torchrun ranks, the gloo pool's workers).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def per_file(report: dict) -> dict[str, dict[str, float]]:
    files: dict[str, dict[str, float]] = defaultdict(lambda: {"cpu_s": 0.0, "sys_s": 0.0, "wall_s": 0.0, "tests": 0})
    for row in report["tests"]:
        name = row["nodeid"].split("::")[0]
        files[name]["cpu_s"] += row["cpu_s"]
        files[name]["sys_s"] += row.get("sys_s", 0.0)
        files[name]["wall_s"] += row["wall_s"]
        files[name]["tests"] += not name.startswith("<")
    return dict(files)


def table(report: dict, before: dict | None, top: int) -> str:
    files = per_file(report)
    old = per_file(before) if before else {}
    total = report["total"]
    lines = [f"total CPU {total['cpu_s']:.0f} s, wall {total['wall_s']:.0f} s, "
             f"{sum(f['tests'] for f in files.values())} tests, load average at the end {' '.join(total['loadavg'])}"]
    if before:
        lines[0] += f" (before: CPU {before['total']['cpu_s']:.0f} s)"
    lines += ["", "| file | tests | CPU s | of which sys s | wall s |" + (" CPU s before |" if before else ""),
              "|---|---:|---:|---:|---:|" + ("---:|" if before else "")]
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["cpu_s"]):
        cells = f"| {name} | {f['tests']} | {f['cpu_s']:.1f} | {f['sys_s']:.1f} | {f['wall_s']:.1f} |"
        if before:
            cells += f" {old[name]['cpu_s']:.1f} |" if name in old else " - |"
        lines.append(cells)
    lines += ["", f"slowest {top} tests (CPU s, of which children / live children = pool workers)", ""]
    for row in sorted(report["tests"], key=lambda r: -r["cpu_s"])[:top]:
        lines.append(f"{row['cpu_s']:7.1f}  {row.get('children_s', 0):6.1f} {row.get('live_children_s', 0):6.1f}"
                     f"  {row['nodeid']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="JSON written by pytest --cpu-report")
    ap.add_argument("--before", help="an earlier report to compare with, per file")
    ap.add_argument("--top", type=int, default=40, help="how many of the slowest tests to list")
    args = ap.parse_args()
    with open(args.report) as f:
        report = json.load(f)
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
    print(table(report, before, args.top))


if __name__ == "__main__":
    main()
