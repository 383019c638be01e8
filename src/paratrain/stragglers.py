"""Straggler detection: the one rule, shared by the runtime and the simulator (torch-free, imports nothing of
paratrain).

- The runtime (parallel/stale_dp.py) feeds `StragglerDetector` every rank's work time of each reduced step; the
  training loop evicts the ranks it flags (train/staleness.py, docs/staleness.md).
- The simulator (sim/stragglers.py, policy evict_replace) asks `steps_to_flag` how many slow steps the same
  detector needs to flag a rank slowed by a factor f, and evicts only what it would flag.
`FaultInjection` makes a straggler on purpose (tests and benchmarks: `staleness.test_fault_injection`).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

# The detector's defaults (the trainer's staleness.straggler_threshold / straggler_window, and the simulator's)
DEFAULT_THRESHOLD = 1.5  # a rank 1.5x slower than the typical one over the window is a straggler
DEFAULT_WINDOW = 10  # steps


def lower_median(values) -> float:
    """The median; for an even count the lower of the two middle values. With 2 ranks the reference is then the
    faster one, so a rank twice as slow as its only peer is recognised (the plain median would sit between)."""
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


class StragglerDetector:
    """Flags ranks whose step time, over the last `window` steps, exceeds `threshold` x the ranks' median.

    Input per step: every rank's own work time (all-gathered), normalised to a full local batch, so a rank that
    processed fewer microbatches under a time budget is still seen as slow. A rank's window statistic is the
    median of its times over the window (robust to one-off spikes); the reference is the lower median of the
    ranks' statistics. Every rank feeds the same all-gathered numbers, so every rank flags the same ranks.
    """

    def __init__(self, world: int, threshold: float, window: int):
        self.world = world
        self.threshold = threshold
        self.history: deque[list[float]] = deque(maxlen=window)
        self.flagged: list[int] = []

    def update(self, per_rank_s) -> list[int]:
        self.history.append([float(x) for x in per_rank_s])
        if len(self.history) < self.history.maxlen or self.world < 2:
            self.flagged = []
            return self.flagged
        per_rank = np.median(np.asarray(self.history), axis=0)
        reference = lower_median(per_rank)
        self.flagged = [r for r in range(self.world) if per_rank[r] > self.threshold * reference]
        return self.flagged

    def window_ratios(self) -> list[float]:
        """Each rank's window median over the reference (1.0 = typical); empty until the window is full."""
        if len(self.history) < self.history.maxlen:
            return []
        per_rank = np.median(np.asarray(self.history), axis=0)
        reference = lower_median(per_rank) or 1.0
        return [float(x / reference) for x in per_rank]


def steps_to_flag(factor: float, threshold: float, window: int) -> int | None:
    """Slow steps after which the detector, its window full of healthy steps, flags one rank running `factor` x
    slower than its peers; None when it never does (factor <= threshold). Computed by running the detector."""
    detector = StragglerDetector(2, threshold, window)
    for _ in range(window):
        detector.update([1.0, 1.0])
    for k in range(1, window + 1):
        if detector.update([1.0, factor]):
            return k
    return None


@dataclass(frozen=True)
class FaultInjection:
    """A deliberate slowdown, for tests and benchmarks only (`staleness.test_fault_injection`; empty = none).

    - "slowdown=2.0,rank=1": rank 1 sleeps (slowdown - 1) x each microbatch's compute time after it, i.e. it runs
      at 1/slowdown of its speed (a persistently slow chip).
    - "sleep_s=0.05,probability=0.3,rank=-1,seed=0": before each step, each chosen rank (-1 = every rank,
      independently) sleeps sleep_s with the given probability (jitter: OS noise, a slow host for a moment).
      The draws are seeded by (seed, rank, step), so a run is reproducible.
    - "base_s=0.05" (combinable with the above): every rank's microbatch also takes base_s more (emulated device
      time, benchmarks only), so that a policy's effect is measured against a known compute time rather than the
      CPU share a shared machine happens to give; `slowdown` scales the whole microbatch time, emulation included.
    """

    rank: int = -1
    slowdown: float = 1.0
    sleep_s: float = 0.0
    probability: float = 0.0
    seed: int = 0
    base_s: float = 0.0

    KEYS = ("rank", "slowdown", "sleep_s", "probability", "seed", "base_s")

    @classmethod
    def parse(cls, spec: str) -> FaultInjection | None:
        """'' -> None; otherwise 'key=value,...' with keys in KEYS. Errors name the field and what is allowed."""
        if not spec.strip():
            return None
        where = f"staleness.test_fault_injection='{spec}'"
        values: dict = {}
        for item in spec.split(","):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in cls.KEYS:
                raise ValueError(f"{where}: '{item}' is not key=value with key one of {', '.join(cls.KEYS)}")
            try:
                values[key] = int(raw) if key in ("rank", "seed") else float(raw)
            except ValueError:
                raise ValueError(f"{where}: {key}={raw!r} is not a number") from None
        fault = cls(**values)
        if fault.slowdown < 1.0:
            raise ValueError(f"{where}: slowdown={fault.slowdown}: allowed: >= 1 (1 = no slowdown)")
        if not 0.0 <= fault.probability <= 1.0 or fault.sleep_s < 0 or fault.base_s < 0:
            raise ValueError(f"{where}: allowed: 0 <= probability <= 1, sleep_s >= 0, base_s >= 0")
        if fault.rank < -1:
            raise ValueError(f"{where}: rank={fault.rank}: allowed: a data-parallel rank, or -1 for every rank")
        return fault

    def applies_to(self, dp_rank: int) -> bool:
        return self.rank in (-1, dp_rank)

    def before_step(self, step: int, dp_rank: int) -> None:
        if self.sleep_s <= 0 or not self.applies_to(dp_rank):
            return
        if random.Random(f"{self.seed}/{dp_rank}/{step}").random() < self.probability:
            time.sleep(self.sleep_s)

    def after_microbatch(self, dp_rank: int, compute_s: float) -> None:
        if self.base_s > 0:
            time.sleep(self.base_s)
            compute_s += self.base_s
        if self.slowdown > 1.0 and self.applies_to(dp_rank):
            time.sleep((self.slowdown - 1.0) * compute_s)
