"""Straggler tolerance for data-parallel training: policies, straggler detection, eviction requests, and the
test-only fault injection that slows a rank on purpose.

The gradient reduction itself lives in `paratrain.parallel.stale_dp` (it is a data-parallel technique); this
module holds what the training loop and the tests need around it. See docs/staleness.md for the semantics.

Policies (`[staleness] policy`):
- "sync": ordinary synchronous data parallelism (the runtime's DDP/FSDP paths; nothing here is involved).
- "bounded_staleness": a fixed gradient delay of s = max_staleness steps. At optimizer step t every rank applies
  the average over ranks of the gradients computed at step t - s. The all-reduce of step t runs in the background
  while steps t+1 .. t+s compute. Steps t < s apply nothing. s = 0 is the synchronous DDP path, bit for bit.
  `compensation` (s > 0) chooses where step t's gradient is computed: "optimizer_lookahead" (default; AdamW
  replayed on this rank's pending gradients, ~ the weights it will be applied to), "weight_prediction"
  (w_t + s (w_t - w_{t-1})) or "none" (w_t, so a gradient computed at w_{t-s} is applied to w_t); see
  parallel/stale_dp.py.
- "time_budget": each rank processes as many of its microbatches as fit in the step's time budget (at least one);
  gradients are summed over ranks and divided by the number of microbatches processed in total, so the update is
  the mean over the tokens actually processed. Composes with max_staleness (default 0).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# A process exit code (EX_TEMPFAIL from sysexits.h) that says "stopped on purpose after a committed checkpoint so
# that the launcher can replace the straggling host(s) named in eviction_request.json, then resume".
EVICTION_EXIT_CODE = 75
EVICTION_REQUEST_FILE = "eviction_request.json"

# Slack on the automatic time budget (step_budget_s = 0): the healthy ranks' full-batch time plus 10%, so that
# timing noise does not make a healthy rank drop its last microbatch.
AUTO_BUDGET_SLACK = 0.10

class EvictionRequested(SystemExit):
    """Raised on every rank after a committed checkpoint when evict_stragglers found straggling ranks."""

    def __init__(self, ranks: list[int], path: Path):
        super().__init__(EVICTION_EXIT_CODE)
        self.ranks = ranks
        self.path = path

    def __str__(self) -> str:
        return f"eviction of data-parallel ranks {self.ranks} requested ({self.path})"


# -- test-only fault injection ---------------------------------------------------------------------------------


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


# -- straggler detection --------------------------------------------------------------------------------------


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

    def update(self, per_rank_s: list[float]) -> list[int]:
        self.history.append(list(per_rank_s))
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


def write_eviction_request(run_dir: Path, step: int, ranks: list[int], hosts: list[str], ratios: list[float],
                           checkpoint: str) -> Path:
    """The request a launcher acts on: which data-parallel ranks (and hosts) to replace, and where to resume."""
    path = Path(run_dir) / EVICTION_REQUEST_FILE
    body = {"step": step, "ranks": ranks, "hosts": [hosts[r] for r in ranks] if hosts else [],
            "step_time_ratio": [ratios[r] for r in ranks] if ratios else [], "checkpoint": checkpoint,
            "exit_code": EVICTION_EXIT_CODE, "written_unix_s": time.time(), "pid": os.getpid()}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=2))
    tmp.replace(path)
    return path


# -- what the training loop calls (each is a no-op for runners without straggler tolerance) ------------------------


def _stale(runner):
    return runner if hasattr(runner, "staleness_metrics") else None


def step_tokens(runner, default_tokens: int) -> int:
    """Tokens the step's update was computed from (fewer than the global batch under a time budget)."""
    stale = _stale(runner)
    return default_tokens if stale is None else stale.tokens_last_step(default_tokens)


def on_step(runner, record: dict, logger) -> None:
    """Add the staleness/straggler metrics to the step's record; log changes in the set of flagged ranks."""
    stale = _stale(runner)
    if stale is None:
        return
    metrics = stale.staleness_metrics()
    record.update(metrics)
    flagged = metrics.get("stragglers", [])
    if flagged != getattr(stale, "_logged_flags", []):
        ratios = metrics.get("straggler_ratio", [])
        detail = ", ".join(f"rank {r} at {ratios[r]:.2f}x" for r in flagged) if ratios else ""
        logger.write(f"step {metrics['applied_step'] + 1}: stragglers {flagged or 'none'}"
                     + (f" ({detail} the median step time)" if detail else ""))
        stale._logged_flags = flagged


def after_checkpoint(runner, evict: bool, run_dir: Path, step: int, checkpoint: str, logger,
                     wait_for_commit=None) -> None:
    """With evict_stragglers, after a checkpoint save: if any rank is flagged now, wait until the checkpoint has
    committed (`wait_for_commit`, for asynchronous saves), write the eviction request and stop every rank with
    EVICTION_EXIT_CODE (raise EvictionRequested). Every rank flags the same ranks, so all stop together."""
    stale = _stale(runner)
    if stale is None or not evict or not stale.detector.flagged:
        return
    ranks = list(stale.detector.flagged)
    stale.finish()
    if wait_for_commit is not None:
        wait_for_commit()
    path = Path(run_dir) / EVICTION_REQUEST_FILE
    if stale.is_main:
        path = write_eviction_request(run_dir, step, ranks, stale.hosts, stale.detector.window_ratios(), checkpoint)
        logger.write(f"step {step}: requesting eviction of straggling data-parallel ranks {ranks} "
                     f"(exit code {EVICTION_EXIT_CODE}, {path})")
    import torch.distributed as dist

    if dist.is_initialized():  # nobody exits before the request is written (a launcher kills the survivors)
        dist.barrier()
    raise EvictionRequested(ranks, path)


def finish(runner) -> None:
    """Wait for reductions still in flight (their gradients are not applied: the run ends here)."""
    stale = _stale(runner)
    if stale is not None:
        stale.finish()
