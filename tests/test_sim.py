"""Cluster simulator: analytic cross-checks (Young, Daly), accounting, failures by cause, spares, stragglers."""

import csv
import heapq
import math
import re
from pathlib import Path

import numpy as np
import pytest

from paratrain.sim.analytic import (
    daly_exact_optimum,
    daly_goodput,
    daly_interval,
    daly_wall_time,
    young_interval,
)
from paratrain.sim.config import DAY_S, HOUR_S, SimConfig, StragglerConfig, load_sim_toml, parse_interval
from paratrain.sim.engine import EVICTION_CAUSE, simulate
from paratrain.sim.failures import (
    LLAMA3_DEVICE_HOURS,
    LLAMA3_TABLE5,
    FailureCause,
    llama3_causes,
    total_rate_per_device_hour,
)
from paratrain.sim.results import summarize, t_quantile_975
from paratrain.sim.stragglers import eviction_rate_per_s, simulate_stragglers
from paratrain.sim.sweeps import (
    daly_case_config,
    exponential_failure_model,
    interval_grid,
    simulated_optimum,
    sweep_interval,
)
from paratrain.stragglers import steps_to_flag

REFERENCE_CSV = Path(__file__).parent / "data" / "llama3_table5_interruptions.csv"  # source: tests/data/README.md
MIN = 60.0


# ---- analytic -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mtbf_min, published_min, tolerance_min", [(24 * 60, 117, 0.5), (6 * 60, 57, 0.5), (15, 9.1, 0.05)])
def test_daly_formula_reproduces_published_examples(mtbf_min, published_min, tolerance_min):
    assert daly_interval(5 * MIN, mtbf_min * MIN) / MIN == pytest.approx(published_min, abs=tolerance_min)


def test_young_is_sqrt_two_delta_m_and_daly_exact_optimum_is_a_minimum():
    assert young_interval(5 * MIN, 24 * HOUR_S) == pytest.approx(120 * MIN)
    delta, mtbf = 5 * MIN, 15 * MIN
    best = daly_exact_optimum(delta, mtbf)
    wall = [daly_wall_time(1.0, tau, delta, 0.0, mtbf) for tau in (0.9 * best, best, 1.1 * best)]
    assert wall[1] < wall[0] and wall[1] < wall[2]
    assert daly_interval(delta, mtbf) == pytest.approx(best, rel=0.01)  # Daly's estimate is close to exact
    assert daly_interval(3 * HOUR_S, HOUR_S) == HOUR_S  # delta >= 2M: checkpoint every M


def test_student_t_quantile_matches_tables():
    for dof, table in ((5, 2.5706), (10, 2.2281), (30, 2.0423), (99, 1.9842)):
        assert t_quantile_975(dof) == pytest.approx(table, rel=2e-3)


# ---- failure model ------------------------------------------------------------------------------------------
def test_llama3_table_matches_reference_csv_and_sums_to_419():
    assert sum(count for _, _, count in LLAMA3_TABLE5) == 419
    with REFERENCE_CSV.open() as fh:
        rows = [(r["component"], r["category"], int(r["count"])) for r in csv.DictReader(fh)]
    assert tuple(rows) == LLAMA3_TABLE5
    rate = total_rate_per_device_hour(llama3_causes())
    assert rate == pytest.approx(419 / (16384 * 54 * 24))
    assert LLAMA3_DEVICE_HOURS == 16384 * 54 * 24


def test_llama3_case_gives_419_interruptions_and_over_90_percent_effective_time():
    cfg = SimConfig(devices=16384, step_time_s=10.0, duration_s=54 * DAY_S, checkpoint_bytes=6.5e12,
                    write_bytes_per_s=2e12, read_bytes_per_s=2e12, samples=200)
    report = summarize(simulate(cfg))
    interruptions = report["metrics"]["interruptions"]
    lo, hi = interruptions["ci95"]
    expected = 419 * (1 - report["metrics"]["spare_wait_hours"]["mean"] / (54 * 24))
    assert lo - 1 <= expected <= hi + 1
    assert report["inputs"]["mean_restart_s"] < 10 * MIN  # "restart costs of a few minutes"
    assert report["metrics"]["effective_training_fraction"]["ci95"][0] > 0.90
    by_cause = {row["cause"]: row for row in report["interruptions_by_cause"]}
    gpu = by_cause["Faulty GPU"]
    assert gpu["ci95"][0] - 2 <= gpu["expected"] <= gpu["ci95"][1] + 2


# ---- simulation against Daly's model ----------------------------------------------------------------------
@pytest.mark.parametrize("mtbf_s, replicas", [(24 * HOUR_S, 200), (6 * HOUR_S, 50), (15 * MIN, 10)])
def test_simulated_optimum_interval_agrees_with_daly(mtbf_s, replicas):
    # Daly's setting for his published examples (Figs. 3-5): T_s = 500 h, R = 10 min, delta = 5 min.
    cfg = daly_case_config(mtbf_s, 5 * MIN, restart_s=10 * MIN, samples=replicas)
    assert cfg.work_s == 500 * HOUR_S
    simulated, _ = simulated_optimum(cfg)
    assert simulated == pytest.approx(daly_interval(5 * MIN, mtbf_s), rel=0.10)


@pytest.mark.parametrize("mtbf_s, replicas", [(24 * HOUR_S, 200), (6 * HOUR_S, 50), (15 * MIN, 10)])
@pytest.mark.parametrize("grid_center", [0.5, 2.0])
def test_simulated_optimum_does_not_depend_on_where_the_grid_is_centred(mtbf_s, replicas, grid_center):
    # The default sweep is centred on Daly's interval; centred at half or twice it instead (Daly's optimum near
    # one end of the grid), the simulation must still find the same optimum.
    cfg = daly_case_config(mtbf_s, 5 * MIN, restart_s=10 * MIN, samples=replicas)
    daly = daly_interval(5 * MIN, mtbf_s)
    grid = interval_grid(grid_center * daly, 0.4, 2.5, 25, cfg.step_time_s)
    simulated, _ = simulated_optimum(cfg, sweep_interval(cfg, grid))
    assert simulated == pytest.approx(daly, rel=0.10)


@pytest.mark.parametrize("mtbf_s, restart_s", [(6 * HOUR_S, 10 * MIN), (30 * MIN, 5 * MIN)])
def test_simulated_goodput_matches_daly_expected_wall_time(mtbf_s, restart_s):
    cfg = daly_case_config(mtbf_s, 5 * MIN, restart_s, work_mtbfs=500, samples=80)
    tau = daly_interval(5 * MIN, mtbf_s)
    run = simulate(cfg, interval_s=tau)
    wall = run.totals.wall_s
    expected = daly_wall_time(cfg.work_s, run.interval_s, 5 * MIN, restart_s, mtbf_s)
    half = t_quantile_975(wall.size - 1) * wall.std(ddof=1) / math.sqrt(wall.size)
    # Daly also writes a checkpoint after the last segment; the simulation does not (one delta at most).
    assert abs(wall.mean() - expected) <= 3 * half + 5 * MIN


def test_no_failures_is_work_plus_checkpoints():
    none = (FailureCause("never", "GPU", 0.0, replaces_node=True),)
    cfg = SimConfig(devices=64, step_time_s=2.0, steps=10_000, checkpoint_bytes=20e9, write_bytes_per_s=1e9,
                    checkpoint_interval=1000.0, causes=none, samples=4)
    run = simulate(cfg)
    writes = math.ceil(20_000 / 1000) - 1  # no checkpoint after the last step
    assert run.totals.wall_s == pytest.approx(np.full(4, 20_000 + writes * 20.0))
    assert run.totals.interruptions.sum() == 0
    assert summarize(run)["metrics"]["goodput"]["mean"] == pytest.approx(20_000 / (20_000 + writes * 20.0))


@pytest.mark.parametrize("mode", ["steps", "duration"])
def test_wall_time_is_fully_accounted(mode):
    extra = {"steps": 200_000} if mode == "steps" else {"duration_s": 20 * DAY_S}
    cfg = SimConfig(devices=65536, step_time_s=5.0, checkpoint_bytes=2e12, write_bytes_per_s=200e9,
                    async_fraction=0.5, spare_nodes=8, repair_mean_s=12 * HOUR_S, samples=30,
                    stragglers=StragglerConfig(rate_per_device_hour=2e-5), **extra)
    t = simulate(cfg).totals
    parts = t.compute_s + t.checkpoint_s + t.restart_s + t.spare_wait_s
    assert parts == pytest.approx(t.wall_s, rel=1e-9)
    assert np.all(t.lost_s >= 0) and np.all(t.lost_s <= t.compute_s)
    if mode == "steps":
        assert t.work_s == pytest.approx(np.full(cfg.samples, cfg.work_s), rel=1e-9)
    else:
        assert t.wall_s == pytest.approx(np.full(cfg.samples, cfg.duration_s))
    assert np.all(t.spare_wait_s > 0)  # 8 spares, 12 h repairs, ~17 hardware failures a day: they run out


def test_asynchronous_checkpoints_beat_blocking_ones():
    common = dict(devices=16384, step_time_s=10.0, duration_s=20 * DAY_S, checkpoint_bytes=6e12,
                  write_bytes_per_s=50e9, read_bytes_per_s=50e9, samples=40)
    blocking = summarize(simulate(SimConfig(**common)))["metrics"]["goodput"]["mean"]
    overlapped = summarize(simulate(SimConfig(**common, async_fraction=0.9)))["metrics"]["goodput"]["mean"]
    assert overlapped > blocking + 0.01


def test_same_seed_same_result_and_common_random_numbers_across_intervals():
    cfg = SimConfig(devices=8192, step_time_s=4.0, steps=300_000, samples=10, seed=7)
    a, b = simulate(cfg), simulate(cfg)
    assert np.array_equal(a.totals.wall_s, b.totals.wall_s)
    other_seed = simulate(cfg.with_updates(seed=8))
    assert not np.array_equal(a.totals.wall_s, other_seed.totals.wall_s)
    # Common random numbers: in a fixed window with enough spares (no idle time) every interval sees exactly
    # the same failures, so each replica's interruption count per cause is identical across intervals.
    window = SimConfig(devices=8192, step_time_s=4.0, duration_s=10 * DAY_S, spare_nodes=64, samples=10, seed=7)
    short, long = simulate(window, interval_s=120.0), simulate(window, interval_s=1800.0)
    assert short.totals.spare_wait_s.sum() == 0 == long.totals.spare_wait_s.sum()
    assert np.array_equal(short.totals.interruptions, long.totals.interruptions)
    assert not np.array_equal(short.totals.work_s, long.totals.work_s)  # the interval did change the run


# ---- spares ---------------------------------------------------------------------------------------------------
def test_without_spares_every_hardware_failure_waits_for_its_repair():
    cfg = SimConfig(devices=16384, step_time_s=10.0, duration_s=60 * DAY_S, spare_nodes=0,
                    repair_distribution="fixed", repair_mean_s=2 * HOUR_S, samples=20)
    run = simulate(cfg)
    hardware = run.causes.replaces_node
    failures = run.totals.interruptions[:, hardware].sum(axis=1)
    waits = run.totals.spare_wait_s
    # Every hardware failure but possibly the last (cut by the window) waited the full repair time.
    assert np.all(waits <= failures * 2 * HOUR_S + 1e-6)
    assert np.all(waits >= (failures - 1) * 2 * HOUR_S - 1e-6)


def test_more_spares_wait_less():
    base = dict(devices=32768, step_time_s=8.0, duration_s=30 * DAY_S, repair_mean_s=48 * HOUR_S, samples=30)
    waits = [simulate(SimConfig(**base, spare_nodes=s)).totals.spare_wait_s.mean() for s in (0, 4, 16, 64)]
    assert waits[0] > waits[1] > waits[2] >= waits[3]
    assert waits[3] == 0.0


def test_ultraserver_replacement_needs_a_whole_spare_domain():
    base = dict(devices=16 * 4 * 256, devices_per_node=16, step_time_s=8.0, duration_s=30 * DAY_S,
                repair_mean_s=48 * HOUR_S, samples=30, spare_nodes=12)
    per_node = simulate(SimConfig(**base, nodes_per_domain=1)).totals.spare_wait_s.mean()
    per_server = simulate(SimConfig(**base, nodes_per_domain=4)).totals.spare_wait_s.mean()
    assert per_server > per_node  # 12 spare nodes are 3 spare UltraServers


# ---- stragglers ---------------------------------------------------------------------------------------------
def test_straggler_envelope_matches_occupancy_probability():
    # Identical slowdowns (sigma 0): the job is slowed whenever at least one episode is active, which for
    # Poisson arrivals is 1 - exp(-rate * duration) of the time (M/G/infinity occupancy), overlaps included.
    devices, rate, duration, factor = 100_000, 2e-5, 1800.0, 2.0
    cfg = StragglerConfig(rate_per_device_hour=rate, mean_duration_s=duration, slowdown_median=factor,
                          slowdown_sigma=0.0)
    out = simulate_stragglers(cfg, devices, 1.0, 600.0, 30 * DAY_S, 20, np.random.default_rng(1))
    busy = 1 - math.exp(-devices * rate / HOUR_S * duration)
    assert busy > 0.5  # heavy overlap: summing episodes would overstate the loss by ~40%
    assert out.lost_share.mean() == pytest.approx(busy * (1 - 1 / factor), rel=0.03)


def test_straggler_policies_rank_as_expected():
    stragglers = dict(rate_per_device_hour=5e-5, mean_duration_s=1800.0, slowdown_median=1.5)
    base = dict(devices=16384, step_time_s=10.0, duration_s=20 * DAY_S, samples=30)
    share = {}
    runs = {}
    for policy in ("wait", "bounded_staleness", "evict_replace"):
        cfg = SimConfig(**base, stragglers=StragglerConfig(policy=policy, staleness_steps=20, **stragglers))
        runs[policy] = simulate(cfg)
        share[policy] = runs[policy].stragglers.lost_share.mean()
    assert share["wait"] > share["bounded_staleness"] > 0
    assert share["wait"] > share["evict_replace"] > 0
    evictions = runs["evict_replace"].totals.interruptions[:, runs["evict_replace"].causes.names.index(EVICTION_CAUSE)]
    assert evictions.mean() > 0
    assert EVICTION_CAUSE not in runs["wait"].causes.names
    stragglers_free = simulate(SimConfig(**base))
    assert summarize(runs["wait"])["metrics"]["goodput"]["mean"] < summarize(stragglers_free)["metrics"]["goodput"]["mean"]


def test_evict_replace_evicts_what_the_runtime_detector_flags():
    """The simulator evicts with the runtime's rule (paratrain.stragglers): an episode slower than the detector's
    threshold is acted on after the detector's slow steps (each f x step_time_s) or evict_after_s, whichever is
    later; a milder one is never flagged, so evict_replace loses exactly what wait loses and evicts nothing."""
    devices, step_s, period_s = 16384, 100.0, 3600.0
    base = dict(rate_per_device_hour=5e-5, mean_duration_s=1800.0, slowdown_sigma=0.0, evict_after_s=300.0)
    episodes_per_s = devices * base["rate_per_device_hour"] / HOUR_S
    mild = {p: StragglerConfig(policy=p, slowdown_median=1.4, **base) for p in ("wait", "evict_replace")}
    assert eviction_rate_per_s(mild["evict_replace"], devices, step_s) == 0.0
    lost = {p: simulate_stragglers(c, devices, step_s, period_s, 10 * DAY_S, 5, np.random.default_rng(0)).lost_share
            for p, c in mild.items()}
    np.testing.assert_array_equal(lost["wait"], lost["evict_replace"])
    slow = StragglerConfig(policy="evict_replace", slowdown_median=2.0, **base)
    k = steps_to_flag(2.0, slow.detect_threshold, slow.detect_window)
    assert k * 2.0 * step_s > base["evict_after_s"]  # the detector, not evict_after_s, decides here
    assert eviction_rate_per_s(slow, devices, step_s) == pytest.approx(
        episodes_per_s * math.exp(-k * 2.0 * step_s / base["mean_duration_s"]))
    fast = eviction_rate_per_s(slow, devices, 1.0)  # short steps: flagged well within evict_after_s
    assert fast == pytest.approx(episodes_per_s * math.exp(-base["evict_after_s"] / base["mean_duration_s"]))


# ---- inputs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, field", [
    ({"devices": 0}, "devices"),
    ({"devices": 100}, "devices"),  # not a multiple of 8 per node
    ({"step_time_s": -1.0}, "step_time_s"),
    ({"async_fraction": 1.0}, "async_fraction"),
    ({"checkpoint_interval": "sometimes"}, "checkpoint_interval"),
    ({"samples": 1}, "samples"),
    ({"repair_distribution": "weibull"}, "repair_distribution"),
    ({"stragglers": StragglerConfig(policy="sync")}, "straggler_policy"),
])
def test_bad_inputs_name_the_field(changes, field):
    kwargs = dict(devices=64, step_time_s=1.0, steps=100) | changes
    with pytest.raises(ValueError, match=field):
        SimConfig(**kwargs)


def test_exactly_one_of_steps_and_duration():
    with pytest.raises(ValueError, match="exactly one"):
        SimConfig(devices=8, step_time_s=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        SimConfig(devices=8, step_time_s=1.0, steps=10, duration_s=100.0)


def test_interval_parsing():
    assert parse_interval("daly", 2.0) == "daly"
    assert parse_interval("500steps", 2.0) == 1000.0
    assert parse_interval("20m", 2.0) == 1200.0
    with pytest.raises(ValueError, match="checkpoint_interval"):
        parse_interval("often", 2.0)


def test_toml_config_with_custom_causes(tmp_path):
    path = tmp_path / "sim.toml"
    path.write_text(
        'devices = 1024\nstep_time_s = 3.0\nduration_s = "10d"\nrate_scale = 2.0\n'
        '[stragglers]\nrate_per_device_hour = 1e-5\npolicy = "evict_replace"\n'
        '[[cause]]\nname = "Chip"\ncategory = "Accelerator"\ncount = 10\ndevice_hours = 1e6\n'
        '[[cause]]\nname = "Software"\ncategory = "Dependency"\nrate_per_device_hour = 1e-6\n'
    )
    cfg = SimConfig(**load_sim_toml(path))
    assert cfg.duration_s == 10 * DAY_S
    assert [c.rate_per_device_hour for c in cfg.causes] == pytest.approx([2e-5, 2e-6])
    assert [c.replaces_node for c in cfg.causes] == [True, False]
    assert cfg.stragglers.policy == "evict_replace"
    path.write_text('devices = 1024\nstep_time = 3.0\n')
    with pytest.raises(ValueError, match="step_time"):
        load_sim_toml(path)


@pytest.mark.parametrize("body, message", [
    ('checkpoint_bytes = "1TB"', "checkpoint_bytes='1TB' is not allowed: must be a number >= 0"),
    ('async_fraction = "half"', "async_fraction='half' is not allowed: must be a number in [0, 1)"),
    ('rate_scale = "x"', "rate_scale='x' is not allowed"),
    ('[stragglers]\nrate_per_device_hour = "often"', "straggler_rate_per_device_hour='often'"),
    ('[stragglers]\nstaleness_steps = 2.5', "staleness_steps=2.5 is not allowed: must be an integer >= 0"),
    ('[[cause]]\nname = "GPU"\nrate_per_device_hour = "high"', "rate_per_device_hour='high' is not allowed"),
    ('[[cause]]\nname = "GPU"\nrate_per_device_hour = 1e-6\nreplaces_node = "yes"', "replaces_node='yes'"),
    ("samples = ", "is not valid TOML"),
])
def test_bad_toml_values_are_one_clear_error(tmp_path, body, message):
    # Wrong types used to escape as TypeError tracebacks (a str compared with a number).
    path = tmp_path / "sim.toml"
    path.write_text(f"devices = 64\nstep_time_s = 1.0\nsteps = 10\n{body}\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        SimConfig(**load_sim_toml(path))


def test_toml_durations_may_be_strings(tmp_path):
    path = tmp_path / "sim.toml"
    path.write_text('devices = 64\nstep_time_s = "2s"\nduration_s = "1d"\n[stragglers]\nmean_duration_s = "20m"\n')
    cfg = SimConfig(**load_sim_toml(path))
    assert (cfg.step_time_s, cfg.duration_s, cfg.stragglers.mean_duration_s) == (2.0, DAY_S, 1200.0)


def test_exponential_failure_model_gives_the_requested_mtbf():
    cfg = daly_case_config(6 * HOUR_S, 5 * MIN, 0.0, work_mtbfs=10, samples=2)
    assert simulate(cfg).mtbf_s == pytest.approx(6 * HOUR_S)
    with pytest.raises(ValueError, match="mtbf_s"):
        exponential_failure_model(0.0, 1)


def test_daly_goodput_is_consistent_with_wall_time():
    assert daly_goodput(3600.0, 60.0, 300.0, 86400.0) == pytest.approx(
        1.0 / daly_wall_time(1.0, 3600.0, 60.0, 300.0, 86400.0))


def test_bounded_staleness_absorbs_the_first_s_steps_of_each_episode():
    # Sparse episodes (no overlap) with one slowdown f: each episode of length D slows the job for
    # max(0, D - a) where a = s * step / (1 - 1/f); for exponential D the mean is D_mean * exp(-a / D_mean).
    devices, rate, mean_d, factor, step, s = 10_000, 1e-6, 1200.0, 2.0, 30.0, 10
    cfg = StragglerConfig(rate_per_device_hour=rate, mean_duration_s=mean_d, slowdown_median=factor,
                          slowdown_sigma=0.0, policy="bounded_staleness", staleness_steps=s)
    out = simulate_stragglers(cfg, devices, step, 600.0, 1e9, 40, np.random.default_rng(3))
    g = 1 - 1 / factor
    absorbed = s * step / g
    expected = devices * rate / HOUR_S * g * mean_d * math.exp(-absorbed / mean_d)
    assert out.lost_share.mean() == pytest.approx(expected, rel=0.05)
    wait = simulate_stragglers(StragglerConfig(**{**cfg.__dict__, "policy": "wait"}), devices, step, 600.0, 1e9, 40,
                               np.random.default_rng(3))
    assert wait.lost_share.mean() == pytest.approx(devices * rate / HOUR_S * g * mean_d, rel=0.05)


def test_gap_closed_form_with_asynchronous_writes():
    from paratrain.sim.engine import _gap_segments

    # tau 600 s, 10 s stall, then 90 s until the write is durable; no restart before the gap.
    gaps = np.array([[650.0, 705.0, 1230.0, 5.0]])
    restart = np.array([[0.0, 0.0, 0.0, 20.0]])
    seg = _gap_segments(gaps, restart, np.array([[600.0]]), 10.0, 90.0)
    assert seg.compute.tolist() == [[640.0, 695.0, 1210.0, 0.0]]
    assert seg.checkpoint.tolist() == [[10.0, 10.0, 20.0, 0.0]]
    assert seg.restart.tolist() == [[0.0, 0.0, 0.0, 5.0]]  # a failure during the restart interrupts it
    # Checkpoint 1 is durable at 610 + 90 = 700, checkpoint 2 at 1310.
    assert seg.durable.tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_asynchronous_writes_lose_the_undurable_interval():
    # With M >> period the failure phase is ~uniform: E[lost] = (tau^2/2 + tau*stall + tau*async) / period.
    tau, write, mtbf = 600.0, 100.0, 400 * 700.0
    for async_fraction in (0.0, 0.9):
        cfg = daly_case_config(mtbf, write, 0.0, work_mtbfs=300, samples=20).with_updates(
            async_fraction=async_fraction, checkpoint_interval=tau)
        run = simulate(cfg)
        stall, pending = (1 - async_fraction) * write, async_fraction * write
        expected = (tau**2 / 2 + tau * stall + tau * pending) / (tau + stall)
        per_failure = run.totals.lost_s.sum() / run.totals.interruptions.sum()
        assert per_failure == pytest.approx(expected, rel=0.04)


def test_a_job_that_cannot_progress_is_a_clear_error_not_a_memory_blowup():
    cfg = SimConfig(devices=1_000_000, step_time_s=10.0, steps=1_000_000, restart_s=3 * HOUR_S, samples=4)
    with pytest.raises(ValueError, match="cannot make progress"):
        simulate(cfg)


def test_toml_example_in_the_docs_loads_and_runs(tmp_path):
    doc = Path(__file__).resolve().parents[1] / "docs" / "simulator.md"
    if not doc.exists():
        pytest.skip("docs/simulator.md not present")
    block = doc.read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "run.toml"
    path.write_text(block)
    cfg = SimConfig(**load_sim_toml(path)).with_updates(samples=5)
    assert cfg.spare_slots == 16 and cfg.stragglers.policy == "bounded_staleness"
    report = summarize(simulate(cfg))
    assert 0 < report["metrics"]["goodput"]["mean"] < 1
    assert report["metrics"]["cost_usd"]["mean"] > 0


def test_spare_pool_by_hand():
    from paratrain.sim.engine import _can_run_out, _spare_waits

    # One spare, 10 h repairs. Failure 1 (1 h) takes the spare; failure 2 (2 h) waits until the first failed
    # node is back (11 h): 9 h idle; failure 3 (exposure 30 h, wall 39 h) finds the node failed at 2 h repaired.
    cfg = SimConfig(devices=16, step_time_s=1.0, steps=10, spare_nodes=1)
    exposure = np.array([[1.0, 2.0, 30.0]]) * HOUR_S
    needs = np.array([[True, True, True]])
    repair = np.full((1, 3), 10 * HOUR_S)
    assert _can_run_out(exposure, needs, repair, 1)
    waits = _spare_waits(cfg, exposure, needs, repair, np.arange(1), None)
    assert (waits / HOUR_S).tolist() == [[0.0, 9.0, 0.0]]
    # Two spares: nobody waits, and the fast check says so without the sequential pass.
    assert not _can_run_out(exposure, needs, repair, 2)
    two = _spare_waits(cfg.with_updates(spare_nodes=2), exposure, needs, repair, np.arange(1), None)
    assert not two.any()
    # A software failure (no node replaced) never waits.
    soft = _spare_waits(cfg, exposure, np.array([[True, False, True]]), repair, np.arange(1), None)
    assert (soft / HOUR_S).tolist() == [[0.0, 0.0, 0.0]]


def test_cluster_sweep_goodput_falls_and_interruptions_scale_with_size():
    from paratrain.sim.sweeps import sweep_cluster

    cfg = SimConfig(devices=16384, step_time_s=10.0, duration_s=30 * DAY_S, checkpoint_bytes=6.5e12,
                    write_bytes_per_s=2e12, read_bytes_per_s=2e12, samples=8)
    points = sweep_cluster(cfg, [4096, 65536, 1_000_000])
    assert [p.devices for p in points] == [4096, 65536, 1_000_000]
    goodput = [p.goodput["mean"] for p in points]
    assert goodput[0] > goodput[1] > goodput[2]
    # Interruptions grow ~linearly with devices while restarts leave most of the window exposed.
    ratio = points[1].interruptions_mean / points[0].interruptions_mean
    assert ratio == pytest.approx(16, rel=0.15)
    for p in points:  # the simulation tracks Daly's model where Daly's assumptions hold (no spare waits here)
        assert p.goodput["mean"] == pytest.approx(p.daly_goodput, abs=0.01)


def event_by_event(cfg, causes, tau, gaps, cause, repair):
    """One replica stepped event by event: restart, compute tau, blocking stall, the asynchronous rest of the write
    (durable when it ends), failures on the exposure clock, spare units and repairs on the wall clock, the end of
    the work or of the window. Returns (wall, work kept, interruptions per cause, idle time waiting for spares)."""
    fail_at = np.cumsum(gaps)
    delta, pend = cfg.checkpoint_block_s, cfg.checkpoint_async_s
    work = cfg.work_s if cfg.steps is not None else np.inf
    horizon = cfg.duration_s if cfg.duration_s is not None else np.inf
    exposure, waited, saved, k, restart = 0.0, 0.0, 0.0, 0, 0.0
    spares = [0.0] * cfg.spare_slots
    counts = np.zeros(len(causes.names))
    while True:
        stop = min(fail_at[k], horizon - waited)  # next failure or the end of the window, on the exposure clock
        progress, durable = saved, []
        if stop < exposure + restart:
            exposure = stop
        else:
            exposure += restart
            while True:
                seg = min(tau, work - progress)
                if stop < exposure + seg:
                    progress += stop - exposure
                    exposure = stop
                    break
                exposure += seg
                progress += seg
                if progress >= work - 1e-9:
                    return exposure + waited, progress, counts, waited
                if stop < exposure + delta:
                    exposure = stop
                    break
                exposure += delta
                durable.append((exposure + pend, progress))
        if stop < fail_at[k]:  # the window closed: what was computed counts
            return horizon, progress, counts, waited
        saved = max([w for t, w in durable if t <= stop], default=saved)
        c = cause[k]
        counts[c] += 1
        if causes.replaces_node[c]:
            now = stop + waited
            if spares:
                ready = heapq.heappop(spares)
                heapq.heappush(spares, now + repair[k])
                wait = max(ready - now, 0.0)
            else:
                wait = repair[k]
            if now + wait >= horizon:
                return horizon, saved, counts, waited + horizon - now
            waited += wait
        restart = causes.restart_s[c]
        k += 1


@pytest.mark.parametrize("spare_nodes", [2, 0])
@pytest.mark.parametrize("mode", ["steps", "duration"])
def test_vectorised_engine_equals_an_event_by_event_simulation(mode, spare_nodes):
    """The engine computes whole gaps in closed form, vectorised; replayed on the same random draws, a plain
    event loop must give the same wall time, work, interruptions by cause and spare waits, replica by replica
    (18 causes with their own restart times, NCCL watchdog detection, 50% asynchronous writes, spares that run
    out with 6 h repairs, or none)."""
    from paratrain.sim import engine

    extra = {"steps": 200_000} if mode == "steps" else {"duration_s": 12 * DAY_S}
    cfg = SimConfig(devices=4096, step_time_s=5.0, checkpoint_bytes=2e12, write_bytes_per_s=100e9,
                    async_fraction=0.5, spare_nodes=spare_nodes, repair_mean_s=6 * HOUR_S, samples=20, seed=3,
                    **extra)
    run = engine.simulate(cfg)
    draws = engine._draw(cfg, run.causes, range(cfg.samples), 2000)  # the engine's per-replica streams
    got = [event_by_event(cfg, run.causes, run.interval_s, draws.gaps[r], draws.cause[r], draws.repair_s[r])
           for r in range(cfg.samples)]
    t = run.totals
    assert t.spare_wait_s.max() > 0  # the spare pool matters in every variant
    np.testing.assert_allclose([g[0] for g in got], t.wall_s, rtol=1e-12)
    np.testing.assert_allclose([g[1] for g in got], t.work_s, rtol=1e-12)
    np.testing.assert_array_equal(np.array([g[2] for g in got]), t.interruptions)
    np.testing.assert_allclose([g[3] for g in got], t.spare_wait_s, rtol=1e-12, atol=1e-6)
