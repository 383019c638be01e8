"""The planner's memory per device against published measured peaks (benchmarks/memory_accuracy.py, memacc): every
row names its source and what it measured, and no set's MAPE grows past where it stands (docs/planner.md, memacc)."""

from __future__ import annotations

from benchmarks.memory_accuracy import memory_rows, memory_sets, set_errors
from paratrain.hardware.catalog import get_catalog

# MAPE (%) of each set at memacc3 (4 Dec 2026; 3.5 / 9.0 / 8.0 at memfrag, 7.5 / 13.5 / 9.5 at memacc2); tighten when a set
# improves, never loosen
MEMORY_MAPE_GUARD = {"torchtitan_h100_1node": 3.5, "torchtitan_h100": 8.5, "torchtitan_h200": 8.0}


def test_memory_rows_sourced_and_sets_within_guard():
    rows = memory_rows()
    assert len(rows) >= 20
    for r in rows:
        assert "@" in r["source"] and "Memory" in r["source"] and r["measure"], r["source"]
        assert float(r["measured_gib"]) > 0 and "best" not in r.values()
    sets = memory_sets(get_catalog())
    assert set(sets) == set(MEMORY_MAPE_GUARD)
    for name, set_rows in sets.items():
        assert set_errors(set_rows)[0] <= MEMORY_MAPE_GUARD[name], (name, set_errors(set_rows))
