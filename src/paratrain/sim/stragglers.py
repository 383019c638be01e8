"""Stragglers: how much of the job's compute time a straggler policy loses, per Monte-Carlo replica.

A synchronous job runs at 1 / max(f) of full speed while slow devices with factors f are active, so the lost
share of time is g = 1 - 1/max(f). With hundreds of thousands of devices episodes overlap, so the loss is the
integral of g over the upper envelope of all active episodes. It is computed exactly for slowdowns quantised
to LEVELS values of g (rounded down, so the loss is never overstated by more than 1/LEVELS of g): by the
layer-cake identity, integral of g(t) dt = sum over levels u of du * |union of episodes with g >= u|, and
the length of a union of intervals is one sort plus a running maximum, vectorised over all replicas at once.

The loss share is then applied to the failure simulation as a slower effective step ("mean field"): straggler
episodes (minutes) are short against checkpoint intervals and runs (hours to months) and independent of
failures, so the mean is right; run-to-run spread comes from each replica's own straggler draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from paratrain.sim.config import HOUR_S, StragglerConfig
from paratrain.stragglers import steps_to_flag

LEVELS = 64
# Cap on episodes simulated per replica: the loss share is a time average of a stationary process, so a window
# holding this many episodes estimates it to ~1-2%; longer runs reuse that window's share (its spread across
# replicas is then slightly wider than a full-length run's would be: conservative).
MAX_EPISODES_PER_REPLICA = 5_000


@dataclass(frozen=True)
class StragglerOutcome:
    lost_share: np.ndarray  # per replica: share of compute wall time that makes no progress
    episodes_per_s: float  # job-level episode rate
    evictions_per_s: float  # job-level rate of evict_replace evictions (0 for other policies)
    window_s: float  # simulated window per replica


def level_factors() -> np.ndarray:
    """The slowdown factor at the lower edge of each lost-share level j (g = j / LEVELS, f = 1 / (1 - g))."""
    return 1.0 / (1.0 - np.arange(LEVELS) / LEVELS)


def act_after_s(cfg: StragglerConfig, step_time_s: float) -> np.ndarray:
    """evict_replace, per lost-share level: how long after an episode starts it is acted on -- once the runtime's
    detector has flagged it (paratrain.stragglers.steps_to_flag slow steps, each f x step_time_s long, at the
    level's lower-edge factor: never earlier than a finer factor would be) and it has lasted evict_after_s; inf
    for the levels the detector never flags (f <= detect_threshold)."""
    factors = level_factors()
    steps = [steps_to_flag(f, cfg.detect_threshold, cfg.detect_window) for f in factors]
    detect_s = np.array([np.inf if k is None else k * f * step_time_s for k, f in zip(steps, factors, strict=True)])
    return np.maximum(cfg.evict_after_s, detect_s)


def level_probabilities(cfg: StragglerConfig) -> np.ndarray:
    """P(an episode's lost share g = 1 - 1/f falls in level j), f = 1 + (median - 1) lognormal(0, sigma); the
    levels above LEVELS - 1 (g = 1) cannot occur."""
    edges = np.append(level_factors(), np.inf)  # f bounds of each level
    if cfg.slowdown_sigma == 0:
        f = cfg.slowdown_median
        return ((edges[:-1] <= f) & (f < edges[1:])).astype(float)
    normal = NormalDist()
    with np.errstate(divide="ignore"):
        z = np.log((edges - 1.0) / (cfg.slowdown_median - 1.0)) / cfg.slowdown_sigma
    cdf = np.array([0.0 if v == -np.inf else 1.0 if v == np.inf else normal.cdf(v) for v in z])
    return np.diff(cdf)


def eviction_rate_per_s(cfg: StragglerConfig, devices: int, step_time_s: float) -> float:
    """Evictions are the episodes the detector flags that last until they are acted on (`act_after_s`): a
    thinned Poisson process (durations exponential, independent of the slowdown)."""
    if cfg.policy != "evict_replace" or cfg.rate_per_device_hour == 0:
        return 0.0
    episodes = devices * cfg.rate_per_device_hour / HOUR_S
    kept = np.exp(-act_after_s(cfg, step_time_s) / cfg.mean_duration_s)  # 0 where never flagged
    return float(episodes * np.sum(level_probabilities(cfg) * kept))


def simulate_stragglers(
    cfg: StragglerConfig,
    devices: int,
    step_time_s: float,
    checkpoint_period_s: float,
    horizon_s: float,
    samples: int,
    rng: np.random.Generator,
) -> StragglerOutcome:
    episodes_per_s = devices * cfg.rate_per_device_hour / HOUR_S
    evictions = eviction_rate_per_s(cfg, devices, step_time_s)
    if episodes_per_s == 0:
        return StragglerOutcome(np.zeros(samples), 0.0, 0.0, 0.0)
    # Episodes may start before the window and still be active in it: start the draw 8 mean durations early.
    lead_s = 8.0 * cfg.mean_duration_s
    window_s = min(horizon_s, MAX_EPISODES_PER_REPLICA / episodes_per_s)
    counts = rng.poisson(episodes_per_s * (window_s + lead_s), size=samples)
    replica = np.repeat(np.arange(samples), counts)
    start = rng.uniform(-lead_s, window_s, size=replica.size)
    duration = rng.exponential(cfg.mean_duration_s, size=replica.size)
    factor = 1.0 + (cfg.slowdown_median - 1.0) * rng.lognormal(0.0, cfg.slowdown_sigma, size=replica.size)
    lost_per_s = 1.0 - 1.0 / factor
    start, end = _apply_policy(cfg, start, duration, lost_per_s, step_time_s, checkpoint_period_s, rng)
    lost_s = _envelope_integral(replica, start, end, lost_per_s, window_s, samples)
    return StragglerOutcome(lost_s / window_s, episodes_per_s, evictions, window_s)


def _apply_policy(cfg, start, duration, lost_per_s, step_time_s, checkpoint_period_s, rng):
    """The part of each episode during which the job is actually slowed, under the chosen policy."""
    end = start + duration
    if cfg.policy == "bounded_staleness":
        # The slow rank falls behind at lost_per_s steps per step time; tolerated until it is s steps behind.
        absorbed_s = cfg.staleness_steps * step_time_s / lost_per_s
        start = start + absorbed_s
    elif cfg.policy == "evict_replace":
        # Flagged by the runtime's detector and persisting for evict_after_s (act_after_s, per level as the loss
        # integral quantises), evicted at the next checkpoint (uniform phase within the period).
        level = np.minimum(np.floor(lost_per_s * LEVELS).astype(np.int64), LEVELS - 1)
        evict_at = start + act_after_s(cfg, step_time_s)[level] + rng.uniform(0.0, checkpoint_period_s,
                                                                                 size=start.size)
        end = np.minimum(end, evict_at)
    return start, end


def _envelope_integral(replica, start, end, lost_per_s, window_s, samples) -> np.ndarray:
    """Per replica: integral over [0, window] of max lost_per_s among active episodes (quantised)."""
    start = np.clip(start, 0.0, window_s)
    end = np.clip(end, 0.0, window_s)
    keep = end > start
    replica, start, end, lost_per_s = replica[keep], start[keep], end[keep], lost_per_s[keep]
    if replica.size == 0:
        return np.zeros(samples)
    level = np.floor(lost_per_s * LEVELS).astype(np.int64)  # episode counts at levels 1..level
    # Lay the replicas end to end on one time line so one sort serves all of them.
    offset = replica * (window_s * 2.0)
    order = np.argsort(start + offset, kind="stable")
    replica, start, end, level = replica[order], start[order] + offset[order], end[order] + offset[order], level[order]
    lost_s = np.zeros(samples)
    for k in range(1, LEVELS + 1):  # levels are nested: each pass keeps only the episodes still at or above k
        keep = level >= k
        if not keep.all():
            start, end, replica, level = start[keep], end[keep], replica[keep], level[keep]
        if start.size == 0:
            break
        covered_until = np.maximum.accumulate(end)
        previous = np.concatenate(([-np.inf], covered_until[:-1]))
        new_cover = np.maximum(0.0, end - np.maximum(start, previous))
        lost_s += np.bincount(replica, weights=new_cover, minlength=samples) / LEVELS
    return lost_s
