"""The Monte-Carlo discrete-event simulation of a training run with failures, checkpoints and restarts.

Why it is fast without simulating devices: independent Poisson failures of N devices superpose into one
Poisson process of the job with rate N * sum(rates), and a synchronous job restarts from its last durable
checkpoint after every failure, so the run is a sequence of independent "gaps" between failures. Within a gap
the job restarts (R of the previous failure's cause), then repeats [compute tau, checkpoint delta] until the
next failure. Everything a gap contributes (compute, checkpoint time, work made durable, work lost) is a
closed-form function of its length, so all gaps of all replicas are computed as numpy arrays at once.
The run ends in the first gap long enough to finish the remaining work (or at the wall-clock horizon).

The only sequential part is the spare pool: a failed node is replaced from the hot spares and goes to repair;
when no spare is left the job waits for the earliest repair. That pass loops over failures (vectorised across
replicas) and only runs when some replica can actually run out of spares.

Failures are counted while the job runs, checkpoints or restarts (its exposure); while it idles waiting for
a repaired node nothing runs, so no interruptions are counted then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from paratrain.sim.analytic import daly_interval, daly_wall_time, young_interval
from paratrain.sim.config import HOUR_S, SimConfig
from paratrain.sim.stragglers import StragglerOutcome, eviction_rate_per_s, simulate_stragglers

EVICTION_CAUSE = "Straggler eviction"
# Replicas are simulated in batches holding at most this many gaps, to bound memory.
MAX_GAPS_PER_BATCH = 2_000_000
# Stream ids for the per-replica random generators (common random numbers across sweeps).
_GAPS, _CAUSES, _REPAIRS = 0, 1, 2
_STRAGGLER_STREAM = 2**31 - 1
NO_FAILURE_GAP_S = 1e18
MAX_GAPS_PER_REPLICA = 5_000_000  # ~600 MB of arrays for one replica: beyond, the job cannot progress


@dataclass(frozen=True)
class CauseTable:
    """The job-level failure processes as arrays, plus the straggler-eviction pseudo-cause when it applies."""

    names: tuple[str, ...]
    categories: tuple[str, ...]
    rate_per_s: np.ndarray  # job-level rate of each cause
    restart_s: np.ndarray  # detect + relaunch + (swap) + restore after this cause
    replaces_node: np.ndarray  # bool
    loses_work: np.ndarray  # bool: False only for evictions, which happen right after a checkpoint

    @property
    def total_rate_per_s(self) -> float:
        return float(self.rate_per_s.sum())

    @property
    def mtbf_s(self) -> float:
        rate = self.total_rate_per_s
        return math.inf if rate == 0 else 1.0 / rate

    @property
    def mean_restart_s(self) -> float:
        rate = self.total_rate_per_s
        if rate == 0:
            return 0.0
        return float((self.rate_per_s * self.restart_s).sum() / rate)


def build_cause_table(cfg: SimConfig, evictions_per_s: float) -> CauseTable:
    names, categories, rates, restarts, replaces, loses = [], [], [], [], [], []
    for cause in cfg.causes:
        detect = cfg.detect_s if cause.detect_s is None else cause.detect_s
        swap = cfg.swap_s if cause.replaces_node else 0.0
        names.append(cause.name)
        categories.append(cause.category)
        rates.append(cfg.devices * cause.rate_per_device_hour / HOUR_S)
        restarts.append(detect + cfg.restart_s + swap + cfg.restore_s)
        replaces.append(cause.replaces_node)
        loses.append(True)
    if evictions_per_s > 0:  # planned stop at a checkpoint: no detection, no lost work, one node swapped
        names.append(EVICTION_CAUSE)
        categories.append("Straggler")
        rates.append(evictions_per_s)
        restarts.append(cfg.restart_s + cfg.swap_s + cfg.restore_s)
        replaces.append(True)
        loses.append(False)
    return CauseTable(tuple(names), tuple(categories), np.array(rates, dtype=float), np.array(restarts, dtype=float),
                      np.array(replaces, dtype=bool), np.array(loses, dtype=bool))


def resolve_interval_s(cfg: SimConfig, mtbf_s: float) -> float:
    """Compute time between checkpoints: the given one or the Young/Daly optimum, in whole steps.

    Checkpoints are taken at step boundaries, so the interval is rounded to a whole number of steps (>= 1)
    and never shorter than the asynchronous part of a write (one write in flight at a time)."""
    rule = cfg.checkpoint_interval
    delta = cfg.checkpoint_block_s
    if isinstance(rule, str):
        if not math.isfinite(mtbf_s) or delta == 0:
            # No failures: checkpoint rarely; free checkpoints: as often as the async write allows.
            tau = 24 * HOUR_S if not math.isfinite(mtbf_s) else 0.0
        elif rule == "young":
            tau = young_interval(delta, mtbf_s)
        else:
            tau = daly_interval(delta, mtbf_s)
        tau = max(tau, cfg.checkpoint_async_s)
    else:
        tau = float(rule)
    steps = max(1, round(tau / cfg.step_time_s))
    tau = steps * cfg.step_time_s
    if tau < cfg.checkpoint_async_s:  # rounding down below the async write: one more step
        tau = math.ceil(cfg.checkpoint_async_s / cfg.step_time_s) * cfg.step_time_s
    return tau


@dataclass
class ReplicaTotals:
    """Per-replica totals (arrays of length samples). Times in seconds of wall clock except work_s, which is
    fault-free compute (steps * step time) kept at the end of the run."""

    wall_s: np.ndarray
    work_s: np.ndarray
    compute_s: np.ndarray  # wall time spent running steps (incl. steps later lost, incl. straggler slowdown)
    lost_s: np.ndarray  # wall time of steps thrown away by failures (recomputed later)
    straggler_s: np.ndarray  # wall time lost to stragglers inside compute_s
    checkpoint_s: np.ndarray  # wall time stopped for blocking checkpoint writes
    restart_s: np.ndarray  # wall time detecting, relaunching, swapping nodes, restoring
    spare_wait_s: np.ndarray  # wall time idle waiting for a repaired node
    interruptions: np.ndarray  # (samples, causes): failures (and evictions) per cause
    checkpoints: np.ndarray  # checkpoint writes started (closed form per gap, not stepped one by one)
    gaps: int  # number of gaps simulated (events) across all replicas, for speed reporting


@dataclass
class SimRun:
    cfg: SimConfig
    causes: CauseTable
    interval_s: float
    stragglers: StragglerOutcome
    totals: ReplicaTotals

    @property
    def mtbf_s(self) -> float:
        return self.causes.mtbf_s


def simulate(cfg: SimConfig, interval_s: float | None = None) -> SimRun:
    """Run `cfg.samples` Monte-Carlo replicas of the training run. `interval_s` overrides the interval rule."""
    causes = build_cause_table(cfg, eviction_rate_per_s(cfg.stragglers, cfg.devices, cfg.step_time_s))
    tau = resolve_interval_s(cfg, causes.mtbf_s) if interval_s is None else float(interval_s)
    if tau < cfg.checkpoint_async_s:
        raise ValueError(f"checkpoint interval {tau:.1f} s is shorter than the asynchronous write "
                         f"({cfg.checkpoint_async_s:.1f} s): one write at a time")
    horizon = _exposure_estimate_s(cfg, causes, tau)
    straggle_rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(cfg.seed, spawn_key=(_STRAGGLER_STREAM,))))
    straggle = simulate_stragglers(cfg.stragglers, cfg.devices, cfg.step_time_s, tau + cfg.checkpoint_block_s,
                                   horizon, cfg.samples, straggle_rng)
    if np.any(straggle.lost_share >= 0.999):
        raise ValueError("stragglers leave the job no progress (>= 99.9% of compute lost): check the straggler rate")
    if cfg.steps is not None:  # stragglers stretch the time to do the work: draw enough failures for it
        horizon /= 1.0 - float(straggle.lost_share.max())
    totals = _simulate_replicas(cfg, causes, tau, straggle.lost_share, horizon)
    return SimRun(cfg, causes, tau, straggle, totals)


def _exposure_estimate_s(cfg: SimConfig, causes: CauseTable, tau: float) -> float:
    """Expected time the job is exposed to failures, used to size the random draws."""
    if cfg.duration_s is not None:
        return cfg.duration_s
    if not math.isfinite(causes.mtbf_s):
        return cfg.work_s * (1 + cfg.checkpoint_block_s / tau)
    m = causes.mtbf_s
    # Daly's expected wall time, in logs: exp(R/M) overflows long before the job becomes hopeless to simulate.
    log_failures = (causes.mean_restart_s / m + math.log(math.expm1((tau + cfg.checkpoint_block_s) / m))
                    + math.log(cfg.work_s / tau))
    if log_failures > math.log(MAX_GAPS_PER_REPLICA):
        raise _no_progress_error(math.exp(min(log_failures, 700.0)))
    return daly_wall_time(cfg.work_s, tau, cfg.checkpoint_block_s, causes.mean_restart_s, m)


# ---- the vectorised core ---------------------------------------------------------------------------------
def _simulate_replicas(cfg, causes: CauseTable, tau, lost_share, horizon_s) -> ReplicaTotals:
    mtbf = causes.mtbf_s
    expected_gaps = 1.0 if not math.isfinite(mtbf) else horizon_s / mtbf
    n_gaps = int(expected_gaps * 1.05 + 8 * math.sqrt(expected_gaps) + 16)
    if n_gaps > MAX_GAPS_PER_REPLICA:
        raise _no_progress_error(expected_gaps)
    batch = max(1, min(cfg.samples, MAX_GAPS_PER_BATCH // n_gaps))
    parts = []
    for first in range(0, cfg.samples, batch):
        replicas = range(first, min(cfg.samples, first + batch))
        parts.append(_simulate_batch(cfg, causes, tau, lost_share[replicas.start:replicas.stop], replicas, n_gaps))
    return _concat(parts)


def _simulate_batch(cfg, causes, tau, lost_share, replicas, n_gaps) -> ReplicaTotals:
    while True:  # draw more gaps if some replica has not finished (rare: sized at +8 sigma)
        draws = _draw(cfg, causes, replicas, n_gaps)
        result = _run_batch(cfg, causes, tau, lost_share, draws)
        if result is not None:
            return result
        n_gaps *= 2
        if n_gaps > MAX_GAPS_PER_REPLICA or n_gaps * len(replicas) > 4 * MAX_GAPS_PER_BATCH:
            if n_gaps > MAX_GAPS_PER_REPLICA:
                raise _no_progress_error(n_gaps)
            return _concat([_simulate_batch(cfg, causes, tau, lost_share[[i]], range(r, r + 1), n_gaps)
                            for i, r in enumerate(replicas)])  # bound memory: one replica at a time


def _no_progress_error(gaps: float) -> ValueError:
    return ValueError(f"the run needs more than {gaps:.3g} failures per replica: the job cannot make progress at "
                      "this failure rate (fewer devices, lower rates, faster restarts or a shorter interval)")


@dataclass
class _Draws:
    gaps: np.ndarray  # (R, n) exposure time between failures
    cause: np.ndarray  # (R, n) int, cause of the failure ending each gap
    repair_s: np.ndarray  # (R, n) repair time of the node that failure takes out


def _replica_rng(seed: int, replica: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(replica, stream))))


def _draw(cfg: SimConfig, causes: CauseTable, replicas: range, n: int) -> _Draws:
    """Per-replica streams: replica r sees the same failures whatever the interval or batch (common random
    numbers, so sweeps over the interval compare like with like)."""
    mtbf = causes.mtbf_s
    cdf = np.cumsum(causes.rate_per_s) / max(causes.total_rate_per_s, 1e-300)
    cdf[-1] = 1.0
    table = _cause_lookup_table(cdf)
    gaps = np.empty((len(replicas), n))
    cause = np.empty((len(replicas), n), dtype=np.int64)
    repair = np.empty((len(replicas), n))
    for i, r in enumerate(replicas):
        if math.isfinite(mtbf):
            gaps[i] = _replica_rng(cfg.seed, r, _GAPS).exponential(mtbf, n)
        else:  # no failures: one gap far longer than any run (finite, so the arithmetic stays exact)
            gaps[i] = NO_FAILURE_GAP_S
        cause[i] = _pick_causes(_replica_rng(cfg.seed, r, _CAUSES).random(n), cdf, table)
        repair[i] = _repair_times(cfg, _replica_rng(cfg.seed, r, _REPAIRS), n)
    return _Draws(gaps, cause, repair)


LOOKUP_BINS = 1 << 16


def _cause_lookup_table(cdf: np.ndarray) -> np.ndarray:
    """Cause index at the left edge of each of LOOKUP_BINS equal bins of [0, 1): an O(1) first guess."""
    edges = np.arange(LOOKUP_BINS) / LOOKUP_BINS
    return np.searchsorted(cdf, edges, side="right")


def _pick_causes(u: np.ndarray, cdf: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Exact inverse-CDF sampling (same result as searchsorted(cdf, u, 'right')), ~5x faster: start from the
    bin's left-edge cause and step right past every boundary at or below u (rarely more than one step)."""
    index = table[np.minimum((u * LOOKUP_BINS).astype(np.int64), LOOKUP_BINS - 1)]
    while True:
        step = u >= cdf[np.minimum(index, len(cdf) - 1)]
        step &= index < len(cdf) - 1
        if not step.any():
            return index
        index = index + step


def _repair_times(cfg: SimConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    mean = cfg.repair_mean_s
    if cfg.repair_distribution == "fixed":
        return np.full(n, mean)
    if cfg.repair_distribution == "exponential":
        return rng.exponential(mean, n)
    sigma = cfg.repair_sigma  # lognormal with the given mean: mu = ln(mean) - sigma^2 / 2
    normal = rng.standard_normal(n, dtype=np.float32)  # float32: repair times need no more precision
    return np.exp(normal * np.float32(sigma) + np.float32(math.log(mean) - sigma * sigma / 2.0)).astype(float)


def _run_batch(cfg, causes: CauseTable, tau, lost_share, d: _Draws) -> ReplicaTotals | None:
    rows = np.arange(d.gaps.shape[0])
    speed = (1.0 - lost_share)[:, None]  # work per second of compute (stragglers, mean field)
    tau_wall = tau / speed
    restart_before = np.zeros_like(d.gaps)  # the restart that opens each gap (none before the first)
    restart_before[:, 1:] = causes.restart_s[d.cause[:, :-1]]
    exposure_end = np.cumsum(d.gaps, axis=1)
    replaces = causes.replaces_node[d.cause]

    if cfg.duration_s is None:
        final, final_len = _final_gap_for_work(cfg, causes, tau, tau_wall, speed, restart_before, d)
        if final is None:
            return None
        waits = _spare_waits(cfg, exposure_end, replaces, d.repair_s, rows, final)
    else:
        if np.any(exposure_end[:, -1] < cfg.duration_s):
            return None
        waits = _spare_waits(cfg, exposure_end, replaces, d.repair_s, rows, None)
        final, final_len, waits = _final_gap_for_horizon(cfg.duration_s, exposure_end, d.gaps, waits, rows)

    gaps = d.gaps.copy()
    gaps[rows, final] = final_len
    col = np.arange(gaps.shape[1])[None, :]
    in_run = col <= final[:, None]
    failed = col < final[:, None]
    seg = _gap_segments(gaps, restart_before, tau_wall, cfg.checkpoint_block_s, cfg.checkpoint_async_s)
    keeps_all = ~failed | ~causes.loses_work[d.cause]  # the last gap, and evictions, lose nothing
    saved_wall = np.where(keeps_all, seg.compute, seg.durable * tau_wall)
    compute = (seg.compute * in_run).sum(axis=1)
    lost = ((seg.compute - saved_wall) * in_run).sum(axis=1)
    n_causes = len(causes.names)
    flat = (rows[:, None] * n_causes + d.cause)[failed]
    counts = np.bincount(flat, minlength=len(rows) * n_causes).reshape(len(rows), n_causes).astype(float)
    spare_wait = waits.sum(axis=1)
    return ReplicaTotals(
        wall_s=(gaps * in_run).sum(axis=1) + spare_wait,
        work_s=((saved_wall * speed) * in_run).sum(axis=1),
        compute_s=compute,
        lost_s=lost,
        straggler_s=compute * lost_share,
        checkpoint_s=(seg.checkpoint * in_run).sum(axis=1),
        restart_s=(seg.restart * in_run).sum(axis=1),
        spare_wait_s=spare_wait,
        interruptions=counts,
        checkpoints=(seg.writes * in_run).sum(axis=1),
        gaps=int((final + 1).sum()),
    )


@dataclass
class _Segments:
    restart: np.ndarray
    compute: np.ndarray
    checkpoint: np.ndarray
    writes: np.ndarray  # checkpoint writes started within the gap
    durable: np.ndarray  # checkpoints completed and durable within the gap


def _gap_segments(gaps, restart_before, tau_wall, block_s, async_s) -> _Segments:
    """Split each gap into restart, compute and checkpoint time; count its durable checkpoints.

    After the restart the job repeats [compute tau, blocking write delta]; checkpoint j (j >= 1) is durable
    once its asynchronous part finishes, at j * (tau + delta) + async_s."""
    restart = np.minimum(gaps, restart_before)
    t = np.maximum(gaps - restart_before, 0.0)
    period = tau_wall + block_s
    full = np.floor(t / period)
    rem = t - full * period
    compute = full * tau_wall + np.minimum(rem, tau_wall)
    checkpoint = full * block_s + np.maximum(rem - tau_wall, 0.0)
    writes = full + (rem > tau_wall)
    durable = np.where(t >= async_s, np.floor((t - async_s) / period), 0.0)
    return _Segments(restart, compute, checkpoint, writes, durable)


def _final_gap_for_work(cfg, causes, tau, tau_wall, speed, restart_before, d: _Draws):
    """The first gap long enough to finish the remaining work, and the time it takes.

    Remaining work r at the start of a gap needs restart + r (at straggler speed) + ceil(r/tau) - 1 blocking
    checkpoints (no checkpoint after the last step)."""
    full_gaps = _gap_segments(d.gaps, restart_before, tau_wall, cfg.checkpoint_block_s, cfg.checkpoint_async_s)
    loses = causes.loses_work[d.cause]
    saved_work = np.where(loses, full_gaps.durable * tau, full_gaps.compute * speed)
    saved_before = np.cumsum(saved_work, axis=1) - saved_work
    remaining = np.maximum(cfg.work_s - saved_before, 0.0)
    checkpoints = np.maximum(np.ceil(remaining / tau - 1e-9) - 1.0, 0.0)
    needed = restart_before + remaining / speed + checkpoints * cfg.checkpoint_block_s
    done = d.gaps >= needed
    if not done.any(axis=1).all():
        return None, None
    final = done.argmax(axis=1)
    rows = np.arange(len(final))
    return final, needed[rows, final]


def _final_gap_for_horizon(horizon_s, exposure_end, gaps, waits, rows):
    """Failures whose wall-clock time falls inside the horizon; the last gap (and wait) cut at the horizon."""
    waits_before = np.cumsum(waits, axis=1) - waits
    failure_wall = exposure_end + waits_before
    final = (failure_wall <= horizon_s).sum(axis=1)  # index of the gap cut by the horizon
    waits = np.where(np.arange(waits.shape[1])[None, :] < final[:, None], waits, 0.0)
    has_prev = final > 0
    prev = np.maximum(final - 1, 0)
    prev_end = np.where(has_prev, failure_wall[rows, prev], 0.0)
    last_wait = np.where(has_prev, np.minimum(waits[rows, prev], horizon_s - prev_end), 0.0)
    waits[rows, prev] = np.where(has_prev, last_wait, waits[rows, prev])
    final_len = np.maximum(horizon_s - prev_end - last_wait, 0.0)
    return final, final_len, waits


def _spare_waits(cfg: SimConfig, exposure_end, replaces, repair_s, rows, final) -> np.ndarray:
    """Idle time after each failure waiting for a replacement unit (node, or UltraServer)."""
    needs = replaces.copy()
    if final is not None:
        needs &= np.arange(needs.shape[1])[None, :] < final[:, None]
    waits = np.zeros_like(exposure_end)
    slots = cfg.spare_slots
    if not needs.any():
        return waits
    if slots == 0:  # no spares: every hardware failure waits for its own node's repair
        return np.where(needs, repair_s, 0.0)
    if not _can_run_out(exposure_end, needs, repair_s, slots):
        return waits
    free_at = np.zeros((len(rows), slots))
    waited = np.zeros(len(rows))
    last = int(np.nonzero(needs.any(axis=0))[0].max()) + 1
    for k in range(last):  # sequential in failures, vectorised across replicas
        need = needs[:, k]
        if not need.any():
            continue
        now = exposure_end[:, k] + waited
        slot = free_at.argmin(axis=1)
        ready = free_at[rows, slot]
        wait = np.where(need, np.maximum(ready - now, 0.0), 0.0)
        free_at[rows, slot] = np.where(need, now + repair_s[:, k], ready)  # failed unit repairs, becomes a spare
        waits[:, k] = wait
        waited += wait
    return waits


def _can_run_out(exposure_end, needs, repair_s, slots) -> bool:
    """Without waiting, are `slots` units ever all in repair at a failure? If not, nobody ever waits.

    In repair just before failure k = (replacing failures before k) - (repairs finished by then). All replicas
    are laid end to end on one time line (offsets larger than any repair), so one sort serves them all."""
    spacing = float(exposure_end[:, -1].max() + repair_s.max()) + 1.0
    offset = np.arange(exposure_end.shape[0])[:, None] * spacing
    t = (exposure_end + offset)[needs]  # row-major: sorted within and across replicas
    if t.size < slots:
        return False
    back = np.sort(t + repair_s[needs])
    in_repair = np.arange(t.size) - np.searchsorted(back, t, side="right")
    return bool(in_repair.max() >= slots)


def _concat(parts: list[ReplicaTotals]) -> ReplicaTotals:
    if len(parts) == 1:
        return parts[0]
    names = [f for f in ReplicaTotals.__dataclass_fields__ if f != "gaps"]
    merged = {name: np.concatenate([getattr(p, name) for p in parts]) for name in names}
    return ReplicaTotals(**merged, gaps=sum(p.gaps for p in parts))
