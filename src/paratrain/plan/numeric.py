"""numpy helpers for the planner's one-layout path (estimate, calibration fits): the same results as numpy's
vectorised calls, without their per-call overhead on 0-d inputs."""

from __future__ import annotations

import numpy as np


def select(condlist, choicelist, default=0):
    """np.select(condlist, choicelist, default). When every input is 0-d (one layout: an estimate, each of a
    calibration fit's ~10^3 predictions per run) the first true condition's choice, cast as np.select casts it
    (a 0-d array of the result dtype of the choices and default), without np.select's broadcasting: ~30 us a
    call, ~10 calls an estimate. Arrays (the layout search) and non-boolean conditions go to np.select itself."""
    # as np.select: Python int, float and complex stay weakly typed (NEP 50) in the result dtype
    values = [x if type(x) in (int, float, complex) else np.asarray(x) for x in (*choicelist, default)]
    conds = [np.asarray(c) for c in condlist]
    if (any(np.ndim(v) for v in values) or any(c.ndim or c.dtype != bool for c in conds)
            or len(conds) != len(choicelist)):
        return np.select(condlist, choicelist, default)
    dtype = np.result_type(*values)
    for cond, value in zip(conds, values, strict=False):
        if cond:
            return np.asarray(value, dtype=dtype)
    return np.asarray(values[-1], dtype=dtype)
