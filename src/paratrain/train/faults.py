"""Test-only fault injection, passed in explicitly: `train(cfg, faults=FaultInjector(...))`,
`CheckpointManager(..., faults=...)`. Inert by default (no kills, no hooks); nothing is read from module state.

The CLI builds one from the environment (`FaultInjector.from_env`, once, before any work), so that end-to-end
tests can kill real processes:
PARATRAIN_FAULT_KILL="<point>:<step>[:<rank>[:<attempt>]][,<point>:<step>...]" sends SIGKILL to this process
(no cleanup, no flush, exactly what a lost node looks like) when it reaches <point> at <step>, on <rank> only
if given, in torchrun attempt <attempt> only (default 0, the first: TORCHELASTIC_RESTART_COUNT unset or 0), so
that the restarted job gets past the point. Several comma-separated kills make one job fail several times,
e.g. "after_step:3:1,save_shards:4:1:1": rank 1 dies after step 3, then (first restart) while saving step 4.
Points:
  after_step        after the optimizer step <step> (before a checkpoint of that step)
  save_begin        inside the save of <step>, before any byte is written
  save_shards       inside the save of <step>: this rank's files written, not yet reported to the others
  save_written      inside the save of <step>: every rank's files written and checksummed, manifest not yet

Hooks: in-process callbacks for tests, `FaultInjector(hooks={"after_step": [fn]})`; fn(step, rank) runs at
the point.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

ENV_KILL = "PARATRAIN_FAULT_KILL"
POINTS = ("after_step", "save_begin", "save_shards", "save_written")


@dataclass(frozen=True)
class Kill:
    point: str
    step: int
    rank: int | None = None  # None: every rank
    attempt: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT when it fires

    def matches(self, point: str, step: int, rank: int, attempt: int) -> bool:
        return ((self.point, self.step, self.attempt) == (point, step, attempt)
                and self.rank in (None, rank))


def parse_kills(spec: str) -> list[Kill]:
    """The kills of a PARATRAIN_FAULT_KILL value, or one ValueError naming the variable, the value and the form."""
    allowed = f"expected <point>:<step>[:<rank>[:<attempt>]], comma-separated, with point one of {POINTS}"
    kills = []
    for item in spec.split(","):
        fields = item.strip().split(":")
        if not 2 <= len(fields) <= 4 or fields[0] not in POINTS:
            raise ValueError(f"{ENV_KILL}={spec!r}: {allowed}")
        try:
            numbers = [int(f) for f in fields[1:]]
        except ValueError:
            raise ValueError(f"{ENV_KILL}={spec!r}: step, rank and attempt must be integers; {allowed}") from None
        rank = numbers[1] if len(numbers) > 1 else None
        attempt = numbers[2] if len(numbers) > 2 else 0
        kills.append(Kill(fields[0], numbers[0], rank, attempt))
    return kills


@dataclass
class FaultInjector:
    kills: list[Kill] = field(default_factory=list)
    hooks: Mapping[str, list[Callable[[int, int], None]]] = field(default_factory=dict)
    attempt: int = 0  # this process's torchrun attempt (TORCHELASTIC_RESTART_COUNT)

    def __post_init__(self):
        unknown = sorted(set(self.hooks) - set(POINTS))
        if unknown:
            raise ValueError(f"fault hooks at {unknown}: allowed points {POINTS}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FaultInjector:
        """The kills PARATRAIN_FAULT_KILL asks for (none if unset), for the attempt torchrun says this is."""
        spec = environ.get(ENV_KILL, "")
        return cls(kills=parse_kills(spec) if spec else [],
                   attempt=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))

    def point(self, point: str, step: int, rank: int) -> None:
        for fn in self.hooks.get(point, ()):
            fn(step, rank)
        if any(k.matches(point, step, rank, self.attempt) for k in self.kills):
            # said first: a launcher that forks its workers reports the first rank it sees fail, not the killed one
            print(f"{ENV_KILL}: SIGKILL of rank {rank} at {point} of step {step} (attempt {self.attempt})",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
