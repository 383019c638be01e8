"""Preemption notices: SIGTERM (Slurm, Kubernetes, torchrun forwarding a scheduler's stop, a spot instance's
two-minute notice) and SIGUSR1 (Slurm's `--signal=USR1@90`) make the run save at the next step boundary and exit
0, so that the scheduler's requeue resumes it from that checkpoint.

The handler only records the signal; the loop asks `requested(step)` once per step, and the ranks agree on the
step to stop at (see `requested`), since a notice may reach only some of them. The save must finish within
`checkpoint.preempt_deadline_s` of the notice (default 90 s, under the two minutes a spot instance gets): the
log says how long it took, and warns beforehand when the last save took longer than the time left.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

SIGNALS = ("SIGTERM", "SIGUSR1")
STOP_KEY = "paratrain/preempt_stop_step"


class Preemption:
    def __init__(self, deadline_s: float, log: Callable[[str], None], slack: int = 2):
        self.deadline_s = deadline_s
        self.log = log
        # ranks of a synchronous run are at most one step apart; stale data parallelism adds max_staleness
        self.slack = slack
        multi = dist.is_initialized() and dist.get_world_size() > 1
        self.store = dist.distributed_c10d._get_default_store() if multi else None
        if self.store is not None:  # a notice of an earlier run in the same process group is not ours
            self.store.delete_key(STOP_KEY)
        self.stop_step: int | None = None
        self.signal = ""  # the name of the first notice received, "" while none
        self.received_at = 0.0  # time.monotonic() of that notice
        self._previous: dict[int, object] = {}

    def install(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
            return self
        for name in SIGNALS:
            num = getattr(signal, name)
            self._previous[num] = signal.signal(num, self._on_signal)
        return self

    def _on_signal(self, signum, _frame) -> None:
        if not self.signal:
            self.signal = signal.Signals(signum).name
            self.received_at = time.monotonic()

    def restore(self) -> None:
        for num, handler in self._previous.items():
            signal.signal(num, handler)
        self._previous.clear()

    def requested(self, step: int) -> bool:
        """True on every rank at the same step boundary once any rank received a notice. Agreement without a
        barrier (stale data parallelism lets ranks drift apart; a per-step all-reduce would lock them together):
        the first rank to see a notice proposes a stop step `slack` steps ahead in the process group's
        key-value store (compare-and-set: the first proposal wins); every rank checks for it each step."""
        if self.store is None:
            return bool(self.signal)
        if self.stop_step is None:
            if self.signal:
                self.store.compare_set(STOP_KEY, "", str(step + self.slack))
            if self.store.check([STOP_KEY]):
                self.stop_step = int(self.store.get(STOP_KEY).decode())
                if not self.signal:  # another rank got the notice: count the deadline from now
                    self.signal, self.received_at = "notice on another rank", time.monotonic()
        return self.stop_step is not None and step >= self.stop_step

    def elapsed_s(self) -> float:
        return time.monotonic() - self.received_at if self.signal else 0.0
