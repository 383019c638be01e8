"""Closed-form checkpoint models shown beside the simulation: Young (1974) and Daly (2006).

Notation (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22(3)):
  M      mean time between failures of the whole job (exponential),
  delta  time to write one checkpoint (blocking),
  R      restart time after a failure (detect + relaunch + read the checkpoint),
  tau    compute time between two checkpoints (the checkpoint interval, delta not included),
  T_s    fault-free solve time (the useful work).

In Daly's model failures can strike during compute, during a checkpoint write and during a restart, and the
expected wall time is  T_w = M * exp(R/M) * (exp((tau + delta)/M) - 1) * T_s / tau.  R only multiplies T_w,
so the optimum tau does not depend on R; it does change the goodput T_s / T_w.
"""

from __future__ import annotations

import math


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2 * delta * M)."""
    _check_positive(delta_s=delta_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum: for delta < 2M,
    sqrt(2 delta M) * [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta; otherwise M."""
    _check_positive(delta_s=delta_s, mtbf_s=mtbf_s)
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta_s


def daly_exact_optimum(delta_s: float, mtbf_s: float) -> float:
    """The tau that minimises Daly's wall-time model exactly: root of exp((tau+delta)/M)(1 - tau/M) = 1.

    Daly's formula approximates this; it is what a long simulation of the same model converges to."""
    _check_positive(delta_s=delta_s, mtbf_s=mtbf_s)
    lo, hi = 1e-9 * mtbf_s, mtbf_s  # the bracket: g(lo) > 0 for delta > 0, g(M) = -1 < 0

    def excess(tau: float) -> float:
        return math.exp((tau + delta_s) / mtbf_s) * (1.0 - tau / mtbf_s) - 1.0

    for _ in range(200):  # bisection: monotone, no derivative needed
        mid = 0.5 * (lo + hi)
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def daly_wall_time(work_s: float, tau_s: float, delta_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly's expected wall time to finish `work_s` of fault-free compute."""
    _check_positive(tau_s=tau_s, mtbf_s=mtbf_s)
    m = mtbf_s
    log_wall = math.log(m) + restart_s / m + math.log(math.expm1(min((tau_s + delta_s) / m, 700.0)))
    log_wall += math.log(work_s / tau_s) if work_s > 0 else -math.inf
    return math.exp(log_wall) if log_wall < 700.0 else math.inf  # beyond: the job never finishes


def daly_goodput(tau_s: float, delta_s: float, restart_s: float, mtbf_s: float) -> float:
    """Useful compute / wall time in Daly's model (no stragglers, no waiting for spares)."""
    return 1.0 / daly_wall_time(1.0, tau_s, delta_s, restart_s, mtbf_s)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0")
