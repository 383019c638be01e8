"""Test-only fault injection. Inert unless PARATRAIN_FAULT_KILL is set or a test registers a hook.

PARATRAIN_FAULT_KILL="<point>:<step>[:<rank>]" sends SIGKILL to this process (no cleanup, no flush, exactly what
a lost node looks like) when it reaches <point> at <step>, on <rank> only if given. Points:
  after_step        after the optimizer step <step> (before a checkpoint of that step)
  save_shards       inside the save of <step>: this rank's files written, not yet reported to the others
  save_written      inside the save of <step>: every rank's files written and checksummed, manifest not yet
It fires only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT unset or 0), so the restarted
job gets past the point.

HOOKS: in-process callbacks for tests, `HOOKS[point].append(fn)`; fn(step, rank) runs at the point.
Extra points for hooks: save_begin (before any byte of <step> is written).
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from collections.abc import Callable

ENV_KILL = "PARATRAIN_FAULT_KILL"
POINTS = ("after_step", "save_begin", "save_shards", "save_written")
HOOKS: dict[str, list[Callable[[int, int], None]]] = defaultdict(list)


def fault_point(point: str, step: int, rank: int) -> None:
    for fn in HOOKS.get(point, ()):
        fn(step, rank)
    spec = os.environ.get(ENV_KILL)
    if spec and _matches(spec, point, step, rank) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def _matches(spec: str, point: str, step: int, rank: int) -> bool:
    fields = spec.split(":")
    if len(fields) not in (2, 3) or fields[0] not in POINTS:
        raise ValueError(f"{ENV_KILL}={spec!r}: expected <point>:<step>[:<rank>] with point one of {POINTS}")
    return fields[0] == point and int(fields[1]) == step and (len(fields) == 2 or int(fields[2]) == rank)
