"""Turn per-replica totals into the numbers a team plans with, each with a Monte-Carlo confidence interval.

Definitions (all shares of wall-clock time):
  goodput                      work kept (fault-free compute of the steps that count) / wall time. Removes
                               restarts, spare waits, checkpoint stalls, lost work and straggler slowdown.
  effective_training_fraction  wall time spent running steps that were kept / wall time: like goodput but
                               straggler-slowed steps count (Meta's "effective training time" counts time
                               spent training; a slow step is still training).
Each metric reports the mean over replicas with a 95% confidence interval of that mean (Student t), and the
5th-95th percentile range of single runs (what one real run may see).
"""

from __future__ import annotations

import math

import numpy as np

from paratrain.sim.analytic import daly_goodput, daly_interval, young_interval
from paratrain.sim.config import DAY_S, HOUR_S
from paratrain.sim.engine import SimRun
from paratrain.sim.failures import total_rate_per_device_hour


def t_quantile_975(dof: int) -> float:
    """Two-sided 95% Student t quantile (Cornish-Fisher expansion; within 0.1% of tables for dof >= 3)."""
    z = 1.959963984540054
    if dof <= 0:
        return math.inf
    g1 = (z**3 + z) / 4.0
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96.0
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384.0
    return z + g1 / dof + g2 / dof**2 + g3 / dof**3


def interval(values: np.ndarray) -> dict:
    """mean, 95% CI of the mean, and the p5-p95 spread of single runs."""
    values = np.asarray(values, dtype=float)
    n = values.size
    lo, hi = float(values.min()), float(values.max())
    # numpy's summation rounds: the mean of 100 equal goodputs came out one ulp below each of them, and the
    # interval clipped to the observed range then no longer held its own mean; the true mean lies in the range
    mean = min(max(float(values.mean()), lo), hi)
    half = t_quantile_975(n - 1) * float(values.std(ddof=1)) / math.sqrt(n) if n > 1 else math.inf
    # A mean cannot lie outside the observed range: clip (matters for rare events such as spare waits).
    low, high = max(mean - half, lo), min(mean + half, hi)
    return {
        "mean": mean,
        "ci95": [low, high],
        "p5": float(np.percentile(values, 5)),
        "p95": float(np.percentile(values, 95)),
    }


def summarize(run: SimRun) -> dict:
    """A JSON-ready report of one simulation."""
    cfg, t = run.cfg, run.totals
    wall = t.wall_s
    fleet_devices = cfg.devices + cfg.spare_node_count * cfg.devices_per_node
    metrics = {
        "goodput": interval(t.work_s / wall),
        "effective_training_fraction": interval((t.compute_s - t.lost_s) / wall),
        "wall_days": interval(wall / DAY_S),
        "useful_compute_days": interval(t.work_s / DAY_S),
        "lost_work_hours": interval(t.lost_s / HOUR_S),
        "lost_work_device_hours": interval(t.lost_s / HOUR_S * cfg.devices),
        "restart_hours": interval(t.restart_s / HOUR_S),
        "checkpoint_stall_hours": interval(t.checkpoint_s / HOUR_S),
        "spare_wait_hours": interval(t.spare_wait_s / HOUR_S),
        "straggler_hours": interval(t.straggler_s / HOUR_S),
        "interruptions": interval(t.interruptions.sum(axis=1)),
    }
    if cfg.price_per_device_hour_usd is not None:
        metrics["cost_usd"] = interval(wall / HOUR_S * fleet_devices * cfg.price_per_device_hour_usd)
    return {
        "inputs": _inputs(run, fleet_devices),
        "samples": cfg.samples,
        "mode": "time_to_train" if cfg.steps is not None else "fixed_window",
        "metrics": metrics,
        "interruptions_by_cause": _by_cause(run),
        "analytic": analytic_block(run),
    }


def _inputs(run: SimRun, fleet_devices: int) -> dict:
    cfg = run.cfg
    return {
        "devices": cfg.devices,
        "devices_per_node": cfg.devices_per_node,
        "nodes": cfg.nodes,
        "nodes_per_domain": cfg.nodes_per_domain,
        "spare_nodes": cfg.spare_node_count,
        "fleet_devices_paid": fleet_devices,
        "step_time_s": cfg.step_time_s,
        "steps": cfg.steps,
        "duration_days": None if cfg.duration_s is None else cfg.duration_s / DAY_S,
        "checkpoint_bytes": cfg.checkpoint_bytes,
        "checkpoint_write_s": cfg.checkpoint_write_s,
        "checkpoint_block_s": cfg.checkpoint_block_s,
        "restore_s": cfg.restore_s,
        "checkpoint_interval_rule": cfg.checkpoint_interval if isinstance(cfg.checkpoint_interval, str) else "fixed",
        "checkpoint_interval_s": run.interval_s,
        "checkpoint_interval_steps": round(run.interval_s / cfg.step_time_s),
        "mean_restart_s": run.causes.mean_restart_s,
        "repair_mean_hours": cfg.repair_mean_s / HOUR_S,
        "straggler_policy": cfg.stragglers.policy,
        "straggler_rate_per_device_hour": cfg.stragglers.rate_per_device_hour,
        "straggler_lost_share_mean": float(run.stragglers.lost_share.mean()),
        "price_per_device_hour_usd": cfg.price_per_device_hour_usd,
        "failure_rate_per_device_hour": total_rate_per_device_hour(cfg.causes),
        "eviction_rate_per_hour": float(run.causes.rate_per_s[~run.causes.loses_work].sum() * HOUR_S),
        "job_mtbf_hours": run.mtbf_s / HOUR_S,  # mean time between interruptions (failures and evictions)
        "notes": list(cfg.notes),
    }


def _by_cause(run: SimRun) -> list[dict]:
    """Simulated interruptions per cause beside the Poisson expectation over the simulated exposure."""
    t = run.totals
    exposure_s = t.wall_s - t.spare_wait_s
    rows = []
    for i, name in enumerate(run.causes.names):
        stats = interval(t.interruptions[:, i])
        rows.append({
            "cause": name,
            "category": run.causes.categories[i],
            "expected": float(run.causes.rate_per_s[i] * exposure_s.mean()),
            "simulated": stats["mean"],
            "ci95": stats["ci95"],
        })
    rows.sort(key=lambda row: -row["expected"])
    return rows


def analytic_block(run: SimRun) -> dict:
    """Young and Daly beside the simulation (their model: exponential failures, one restart time R, no
    stragglers, no spare waits, blocking checkpoints)."""
    cfg = run.cfg
    mtbf, delta, restart = run.mtbf_s, cfg.checkpoint_block_s, run.causes.mean_restart_s
    if not math.isfinite(mtbf) or delta == 0:
        return {"mtbf_s": mtbf, "delta_s": delta, "note": "Young/Daly need failures and a blocking checkpoint"}
    return {
        "mtbf_s": mtbf,
        "delta_s": delta,
        "restart_s": restart,
        "young_interval_s": young_interval(delta, mtbf),
        "daly_interval_s": daly_interval(delta, mtbf),
        "daly_goodput_at_interval": daly_goodput(run.interval_s, delta, restart, mtbf),
        "daly_goodput_at_optimum": daly_goodput(daly_interval(delta, mtbf), delta, restart, mtbf),
    }
