"""Sweeps over the checkpoint interval and the cluster size, and the simulated optimum interval.

Every point of an interval sweep replays the same failures (common random numbers: per-replica random streams
do not depend on the interval), so differences between points are differences of the policy, not of luck.
The simulated optimum is the vertex of a parabola fitted to mean wall time against log(interval) near the
best grid point, which is far less noisy than picking the best grid point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from paratrain.sim.analytic import daly_goodput, daly_interval
from paratrain.sim.config import DAY_S, HOUR_S, SimConfig
from paratrain.sim.engine import build_cause_table, resolve_interval_s, simulate
from paratrain.sim.failures import FailureCause
from paratrain.sim.results import interval as stat_interval
from paratrain.sim.stragglers import eviction_rate_per_s


def exponential_failure_model(mtbf_s: float, devices: int) -> tuple[FailureCause, ...]:
    """A single cause giving the job the MTBF `mtbf_s`, restarting in place (Daly's model)."""
    if not mtbf_s > 0:
        raise ValueError(f"mtbf_s={mtbf_s!r} must be > 0")
    return (FailureCause("Failure", "Any", HOUR_S / (mtbf_s * devices), replaces_node=False, detect_s=0.0),)


DALY_SOLVE_TIME_S = 500 * HOUR_S  # Daly 2006, Figs. 3-5: T_s = 500 h, R = 10 min, delta = 5 min


def daly_case_config(mtbf_s: float, delta_s: float, restart_s: float, *, work_s: float = DALY_SOLVE_TIME_S,
                     work_mtbfs: float | None = None, samples: int = 200, seed: int = 0,
                     step_time_s: float = 1.0) -> SimConfig:
    """Daly's setting as a SimConfig: exponential failures with MTBF M, blocking checkpoints of delta,
    restart R (all in the relaunch), no spares needed, no stragglers. Work: T_s = 500 h as in Daly's
    figures, or `work_mtbfs` MTBFs when given."""
    devices = 1
    write = 1e9
    work = work_s if work_mtbfs is None else work_mtbfs * mtbf_s
    return SimConfig(
        devices=devices, devices_per_node=1, step_time_s=step_time_s,
        steps=max(1, round(work / step_time_s)),
        checkpoint_bytes=delta_s * write, write_bytes_per_s=write, read_bytes_per_s=1e300,
        detect_s=0.0, restart_s=restart_s, swap_s=0.0, spare_nodes=0,
        causes=exponential_failure_model(mtbf_s, devices), samples=samples, seed=seed,
    )


@dataclass
class IntervalPoint:
    interval_s: float
    goodput: dict
    wall_s_mean: float
    daly_goodput: float | None


def sweep_interval(cfg: SimConfig, intervals_s: Iterable[float],
                   progress: Callable[[Iterable], Iterable] | None = None) -> list[IntervalPoint]:
    points = []
    intervals = list(intervals_s)
    for tau in (progress(intervals) if progress else intervals):
        run = simulate(cfg, interval_s=tau)
        t = run.totals
        analytic = None
        if math.isfinite(run.mtbf_s) and cfg.checkpoint_block_s > 0:
            analytic = daly_goodput(run.interval_s, cfg.checkpoint_block_s, run.causes.mean_restart_s, run.mtbf_s)
        points.append(IntervalPoint(run.interval_s, stat_interval(t.work_s / t.wall_s), float(t.wall_s.mean()),
                                    analytic))
    return points


def interval_grid(center_s: float, low: float = 0.4, high: float = 2.5, points: int = 25,
                  step_time_s: float = 1.0, floor_s: float = 0.0) -> np.ndarray:
    """Log-spaced intervals around `center_s`, in whole steps, no shorter than `floor_s`."""
    grid = center_s * np.exp(np.linspace(math.log(low), math.log(high), points))
    grid = np.maximum(np.round(grid / step_time_s), 1) * step_time_s
    return np.unique(np.maximum(grid, floor_s))


def simulated_optimum(cfg: SimConfig, points: list[IntervalPoint] | None = None) -> tuple[float, list[IntervalPoint]]:
    """The interval that maximises simulated goodput (parabola vertex in log interval)."""
    if points is None:
        center = analytic_optimum(cfg)
        points = sweep_interval(cfg, interval_grid(center, step_time_s=cfg.step_time_s, floor_s=cfg.checkpoint_async_s))
    # Work mode: minimise wall time; window mode: maximise goodput (same thing, the right noise model).
    values = np.array([p.wall_s_mean if cfg.steps is not None else -p.goodput["mean"] for p in points])
    x = np.log([p.interval_s for p in points])
    best = int(values.argmin())
    lo, hi = max(0, best - 4), min(len(points), best + 5)
    if hi - lo < 3:
        return points[best].interval_s, points
    a, b, _ = np.polyfit(x[lo:hi], values[lo:hi], 2)
    if a <= 0:  # no curvature: the grid point is the best estimate we have
        return points[best].interval_s, points
    vertex = float(np.clip(-b / (2 * a), x[lo], x[hi - 1]))
    return float(math.exp(vertex)), points


def analytic_optimum(cfg: SimConfig) -> float:
    causes = build_cause_table(cfg, eviction_rate_per_s(cfg.stragglers, cfg.devices, cfg.step_time_s))
    if math.isfinite(causes.mtbf_s) and cfg.checkpoint_block_s > 0:
        return daly_interval(cfg.checkpoint_block_s, causes.mtbf_s)
    return resolve_interval_s(cfg, causes.mtbf_s)


@dataclass
class ClusterPoint:
    devices: int
    interval_s: float
    goodput: dict
    interruptions_mean: float
    daly_goodput: float | None


def sweep_cluster(cfg: SimConfig, device_counts: Iterable[int], window_s: float | None = None,
                  progress: Callable[[Iterable], Iterable] | None = None) -> list[ClusterPoint]:
    """Goodput against cluster size over a fixed wall-clock window, each size with its own interval rule.

    Same checkpoint size and storage bandwidth at every size (the same model); spares keep the same share of
    nodes. Sizes are rounded to whole replacement units."""
    window = window_s or cfg.duration_s or 30 * DAY_S
    unit = cfg.devices_per_node * cfg.nodes_per_domain
    share = cfg.spare_node_count / cfg.nodes
    counts = sorted({max(unit, round(n / unit) * unit) for n in device_counts})
    points = []
    for devices in (progress(counts) if progress else counts):
        nodes = devices // cfg.devices_per_node
        spare_units = math.ceil(share * nodes / cfg.nodes_per_domain)
        sized = cfg.with_updates(devices=devices, steps=None, duration_s=window,
                                 spare_nodes=spare_units * cfg.nodes_per_domain)
        run = simulate(sized)
        t = run.totals
        analytic = None
        if math.isfinite(run.mtbf_s) and cfg.checkpoint_block_s > 0:
            analytic = daly_goodput(run.interval_s, cfg.checkpoint_block_s, run.causes.mean_restart_s, run.mtbf_s)
        points.append(ClusterPoint(devices, run.interval_s, stat_interval(t.work_s / t.wall_s),
                                   float(t.interruptions.sum(axis=1).mean()), analytic))
    return points


def default_cluster_sizes(devices: int) -> list[int]:
    """Powers of two from 1/64 of the job to 1M devices, always including the job itself."""
    sizes = {devices}
    n = max(8, devices // 64)
    while n <= 1_048_576:
        sizes.add(n)
        n *= 2
    return sorted(sizes)


@dataclass
class SparePoint:
    spare_nodes: int
    goodput: dict
    spare_wait_hours: dict


def sweep_spares(cfg: SimConfig, spare_counts: Iterable[int],
                 progress: Callable[[Iterable], Iterable] | None = None) -> list[SparePoint]:
    """Goodput and idle time waiting for repaired nodes against the number of hot spare nodes (whole
    replacement units). Same failures at every point (common random numbers)."""
    unit = cfg.nodes_per_domain
    counts = sorted({max(0, round(n / unit) * unit) for n in spare_counts})
    points = []
    for spares in (progress(counts) if progress else counts):
        t = simulate(cfg.with_updates(spare_nodes=spares)).totals
        points.append(SparePoint(spares, stat_interval(t.work_s / t.wall_s), stat_interval(t.spare_wait_s / HOUR_S)))
    return points


def default_spare_counts(cfg: SimConfig) -> list[int]:
    """0, then doubling replacement units up to 8% of the job's nodes (and the configured count)."""
    unit = cfg.nodes_per_domain
    counts = {0, cfg.spare_node_count}
    n = unit
    while n <= max(unit, 0.08 * cfg.nodes):
        counts.add(n)
        n *= 2
    return sorted(counts)
