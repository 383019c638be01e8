"""The planner's collective model against published nccl-tests measurements (benchmarks/collective_accuracy.py), as
a regression guard: each set's MAPE may not grow past what it is today, and every row names its source.

The data is EVALUATION data (no constant was set on it); the guards record today's values so that a change that
worsens the collective model fails here, and one that improves it tightens them (docs/planner.md, collbench).
"""

from __future__ import annotations

import re

import pytest

from benchmarks.collective_accuracy import load_rows, predicted_time_s, set_mapes
from paratrain.hardware.catalog import get_catalog

# MAPE per set at collbench (3 Dec 2026), rounded up to 0.1 point
MAPE_PCT = {"one_node": 33.8, "two_node": 48.6, "latency": 185.7, "b200_scale_use3a": 21.9, "b200_scale_slinky": 49.1}
COMMIT = re.compile(r"@[0-9a-f]{40}\b")


@pytest.fixture(scope="module")
def rows():
    return load_rows()


def test_every_row_names_a_source_and_a_catalog_system(rows):
    catalog = get_catalog()
    for row in rows:
        assert COMMIT.search(row["source"]) or row["source"].startswith("https://"), row["source"]
        assert catalog.system(row["system"]).devices_per_node >= int(row["ranks_per_node"])
        assert row["collective"] in ("allreduce", "allgather", "reducescatter")
        assert float(row["time_us"]) > 0


def test_the_data_reaches_the_scale_the_issue_is_about(rows):
    assert max(int(r["ranks"]) for r in rows) >= 512
    assert sum(int(r["ranks"]) >= 256 for r in rows) >= 6


def test_each_set_stays_within_its_recorded_error(rows):
    mapes = set_mapes(get_catalog(), rows)
    assert set(mapes) == set(MAPE_PCT)
    for name, mape_pct in mapes.items():
        assert mape_pct <= MAPE_PCT[name], f"{name}: {mape_pct:.1f}% > {MAPE_PCT[name]}%"


def test_a_partly_filled_node_is_refused(rows):
    row = dict(rows[0], ranks="16", ranks_per_node="4")
    with pytest.raises(ValueError, match="ranks per node"):
        predicted_time_s(get_catalog(), row)
