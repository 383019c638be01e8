"""Straggler tolerance for data-parallel training, the training loop's side: the step record's staleness metrics,
eviction requests.

The gradient reduction itself lives in `paratrain.parallel.stale_dp` (it is a data-parallel technique), the
delay compensation in `paratrain.parallel.compensation`, straggler detection and the test-only fault injection
in `paratrain.stragglers` (shared with the simulator); the loop reaches the runner through its explicit hooks
(`runner.hooks`, parallel/runner.py `StepHooks`). See docs/staleness.md for the semantics.

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
import time
from pathlib import Path

# A process exit code (EX_TEMPFAIL from sysexits.h) that says "stopped on purpose after a committed checkpoint so
# that the launcher can replace the straggling host(s) named in eviction_request.json, then resume".
EVICTION_EXIT_CODE = 75
EVICTION_REQUEST_FILE = "eviction_request.json"


class EvictionRequested(SystemExit):
    """Raised on every rank after a committed checkpoint when evict_stragglers found straggling ranks."""

    def __init__(self, ranks: list[int], path: Path):
        super().__init__(EVICTION_EXIT_CODE)
        self.ranks = ranks
        self.path = path

    def __str__(self) -> str:
        return f"eviction of data-parallel ranks {self.ranks} requested ({self.path})"


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


# -- what the training loop calls, on the runner's hooks (parallel/runner.py StepHooks) --------------------------


class StragglerLog:
    """Adds the staleness/straggler metrics to each step's record and logs changes in the set of flagged ranks
    (the loop holds one per run: what was logged last is its state, not the runner's)."""

    def __init__(self):
        self.logged: list[int] = []

    def on_step(self, hooks, record: dict, logger) -> None:
        metrics = hooks.step_metrics()
        if not metrics:
            return
        record.update(metrics)
        flagged = metrics.get("stragglers", [])
        if flagged != self.logged:
            ratios = metrics.get("straggler_ratio", [])
            detail = ", ".join(f"rank {r} at {ratios[r]:.2f}x" for r in flagged) if ratios else ""
            logger.write(f"step {metrics['applied_step'] + 1}: stragglers {flagged or 'none'}"
                         + (f" ({detail} the median step time)" if detail else ""))
            self.logged = flagged


def after_checkpoint(hooks, evict: bool, run_dir: Path, step: int, checkpoint: str, logger, is_main: bool,
                     wait_for_commit=None) -> None:
    """With evict_stragglers, after a checkpoint save: if any rank is flagged now, wait until the checkpoint has
    committed (`wait_for_commit`, for asynchronous saves), write the eviction request and stop every rank with
    EVICTION_EXIT_CODE (raise EvictionRequested). Every rank flags the same ranks, so all stop together."""
    ranks = list(hooks.stragglers()) if evict else []
    if not ranks:
        return
    hooks.finish()
    if wait_for_commit is not None:
        wait_for_commit()
    path = Path(run_dir) / EVICTION_REQUEST_FILE
    if is_main:
        path = write_eviction_request(run_dir, step, ranks, hooks.hosts(), hooks.straggler_ratios(), checkpoint)
        logger.write(f"step {step}: requesting eviction of straggling data-parallel ranks {ranks} "
                     f"(exit code {EVICTION_EXIT_CODE}, {path})")
    import torch.distributed as dist

    if dist.is_initialized():  # nobody exits before the request is written (a launcher kills the survivors)
        dist.barrier()
    raise EvictionRequested(ranks, path)
