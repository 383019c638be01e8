"""The planner's collective model against published nccl-tests measurements (benchmarks/collective_accuracy.py), as
a regression guard: each set's MAPE may not grow past what it is today, and every row names its source.

The data is EVALUATION data (no constant was set on it); the guards record today's values so that a change that
worsens the collective model fails here, and one that improves it tightens them (docs/planner.md, collbench).
"""

from __future__ import annotations

import re

import pytest

from benchmarks.collective_accuracy import _report, is_calibration_set, load_rows, predicted_time_s, set_mapes
from paratrain.hardware.catalog import get_catalog
from paratrain.plan.collectives import collective_time_s, comm_sm_fraction, overlapped_exposed_s

# MAPE per set at collbench (3 Dec 2026), rounded up to 0.1 point; one_node 33.8 -> 16.4 and latency 185.7 -> 129.6
# with NCCL's NVLS all-reduce on Hopper (nccl, 4 Dec 2026)
# size_sweep_scale: 41.0% at its addition (collsize, 4 Dec 2026: a full 1 MiB-8 GiB sweep at 32 H100)
# cal_sweep_h100_ib: 48.71% at its addition (colldata, 6 Dec 2026: the CALIBRATION sweep, all-reduce 1 MiB-8 GiB at 32
# and 64 H100 of one IB cluster), rounded up
MAPE_PCT = {"one_node": 16.4, "two_node": 48.6, "latency": 129.6, "b200_scale_use3a": 21.9, "b200_scale_slinky": 49.1,
            "size_sweep_scale": 41.0, "cal_sweep_h100_ib": 48.8}
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


def test_a_size_sweep_beyond_one_node_covers_every_size_class(rows):
    """size_sweep_scale tests the latency steps as well as the bandwidth term: one rank count beyond two nodes, every
    power of two from 1 MiB to 8 GiB for each collective."""
    sweep = [r for r in rows if r["set"] == "size_sweep_scale"]
    assert {int(r["ranks"]) for r in sweep} == {32}
    for kind in ("allreduce", "allgather"):
        sizes = sorted(int(r["bytes"]) for r in sweep if r["collective"] == kind)
        assert sizes == [2**k for k in range(20, 34)], kind


def test_the_calibration_sweep_covers_four_and_eight_nodes_at_every_size(rows):
    """cal_sweep_h100_ib is the calibration sweep for the multi-node rings' per-step latency: NCCL's default
    all-reduce on whole dgx-h100 nodes at 32 and 64 ranks (4 and 8 nodes), every power of two from 1 MiB to 8 GiB,
    each row from the one nccl-tests thread it was copied from."""
    sweep = [r for r in rows if r["set"] == "cal_sweep_h100_ib"]
    assert {(r["system"], int(r["ranks_per_node"]), r["collective"]) for r in sweep} == {("dgx-h100", 8, "allreduce")}
    assert {int(r["ranks"]) for r in sweep} == {32, 64}
    for ranks in (32, 64):
        sizes = sorted(int(r["bytes"]) for r in sweep if int(r["ranks"]) == ranks)
        assert sizes == [2**k for k in range(20, 34)], ranks
    assert all(r["source"].startswith("https://github.com/NVIDIA/nccl-tests/issues/309") for r in sweep)


def test_calibration_sets_are_printed_apart_from_the_evaluation_sets(rows, capsys):
    """Only cal_* sets are calibration data; the report prints them under their own heading, after every
    evaluation set, so a constant fitted on them is never read as an evaluation result."""
    names = {r["set"] for r in rows}
    assert {n for n in names if is_calibration_set(n)} == {"cal_sweep_h100_ib"}
    assert not is_calibration_set("size_sweep_scale")
    _report(get_catalog(), rows, show_rows=False)
    out = capsys.readouterr().out
    cal_head = out.index("#### CALIBRATION")
    assert out.index("#### EVALUATION") < cal_head
    for name in names:
        at = out.index(f"\n{name}: ")
        assert (at > cal_head) == is_calibration_set(name), name
    assert "calibration cal_sweep_h100_ib" in out


def test_each_set_stays_within_its_recorded_error(rows):
    mapes = set_mapes(get_catalog(), rows)
    assert set(mapes) == set(MAPE_PCT)
    for name, mape_pct in mapes.items():
        assert mape_pct <= MAPE_PCT[name], f"{name}: {mape_pct:.1f}% > {MAPE_PCT[name]}%"


def test_a_partly_filled_node_is_refused(rows):
    row = dict(rows[0], ranks="16", ranks_per_node="4")
    with pytest.raises(ValueError, match="ranks per node"):
        predicted_time_s(get_catalog(), row)


def test_nccl_kernels_hold_sms_and_nvls_needs_a_reducing_switch():
    """Hidden traffic costs the SM share NCCL's CTAs hold (24 of an H100's 132 inside a node, 16 across nodes, none
    on Trainium); NVLS is taken only where the NVSwitch reduces (Hopper, not A100) and only where it is faster."""
    cat = get_catalog()
    h100, a100, trn1 = cat.system("dgx-h100"), cat.system("dgx-a100-80gb"), cat.system("trn1.32xlarge")
    assert comm_sm_fraction(h100, 8, 1) == pytest.approx(24 / 132)
    assert comm_sm_fraction(h100, 16, 1) == pytest.approx(16 / 132)
    assert comm_sm_fraction(trn1, 32, 1) == 0.0
    f = 0.25
    assert overlapped_exposed_s(1.0, 5.0, f) == pytest.approx(f)  # hidden: the compute runs at 1 - f meanwhile
    assert overlapped_exposed_s(5.0, 1.0, f) == pytest.approx(4.0)  # longer than its window: the rest exposed
    assert overlapped_exposed_s(1.0, 0.0, f) == pytest.approx(1.0)  # nothing to hide behind
    big = 8 * 2**30
    assert collective_time_s(h100, "allreduce", big, 8, 1, nvls=True) < 0.8 * collective_time_s(h100, "allreduce", big, 8, 1)
    assert collective_time_s(a100, "allreduce", big, 8, 1, nvls=True) == collective_time_s(a100, "allreduce", big, 8, 1)
    assert collective_time_s(h100, "allreduce", big, 16, 1, nvls=True) == collective_time_s(h100, "allreduce", big, 16, 1)
