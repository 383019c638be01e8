"""Name the rank that stopped. A rank that hangs (stuck I/O, a deadlock, SIGSTOP, a dying node) leaves every
other rank blocked in its next collective until train.collective_timeout_s, with an error that names nobody.
Each rank records its progress (a counter and the step) in the process group's key-value store at a few points
per step; rank 0 runs a thread that reads them and, when one rank is behind the others and has not moved for
train.watchdog_s, logs which rank, where it stopped and since when. Why our own: torch's NCCL flight recorder
covers NCCL only, and gloo reports just the timeout.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

STACK_DUMP_SIGNAL = "SIGUSR2"  # SIGUSR1 and SIGTERM are the preemption notice (train/preemption.py)
PHASES = ("data_loading", "compute")  # where a step is marked: its batch read, its step queued
KEY = "paratrain/progress/{rank}"


class Watchdog:
    def __init__(self, rank: int, world_size: int, stall_s: float, log: Callable[[str], None]):
        self.rank, self.world_size, self.stall_s, self.log = rank, world_size, stall_s, log
        self.enabled = stall_s > 0 and world_size > 1 and dist.is_initialized()
        self.store = dist.distributed_c10d._get_default_store() if self.enabled else None
        self.counter = 0
        if self.store is not None:  # a record of an earlier run in the same process group is not progress
            self.store.delete_key(KEY.format(rank=rank))
        self.warnings: list[str] = []
        self._stop = threading.Event()
        self._thread = None
        if self.enabled and rank == 0:
            self._thread = threading.Thread(target=self._watch, name="paratrain-watchdog", daemon=True)
            self._thread.start()

    def mark(self, step: int, phase: str) -> None:
        """This rank finished `phase` of `step` (cheap: one small store write)."""
        if self.store is not None:
            self.counter += 1
            self.store.set(KEY.format(rank=self.rank), f"{self.counter} {step} {phase} {time.time():.3f}")

    def _read(self) -> dict[int, tuple[int, int, str, float]]:
        keys = [KEY.format(rank=r) for r in range(self.world_size)]
        if not self.store.check(keys):  # some rank has not reported yet
            return {}
        out = {}
        for r, value in enumerate(self.store.multi_get(keys)):
            counter, step, phase, t = value.decode().split()
            out[r] = (int(counter), int(step), phase, float(t))
        return out

    def _watch(self) -> None:
        named: set[tuple[int, int]] = set()
        while not self._stop.wait(max(self.stall_s / 4, 0.05)):
            try:
                progress = self._read()
            except Exception:  # noqa: BLE001 - the store going away at shutdown is not a finding
                return
            if not progress:
                continue
            ahead = max(c for c, *_ in progress.values())
            now = time.time()
            for r, (counter, step, phase, t) in sorted(progress.items()):
                if counter < ahead and now - t > self.stall_s and (r, counter) not in named:
                    named.add((r, counter))
                    others = sorted({s for q, (_, s, _, _) in progress.items() if q != r})
                    msg = (f"WARNING: watchdog: rank {r} has not moved for {now - t:.0f} s: it last finished "
                           f"the {phase} of step {step} and stopped there, while the other ranks reached step "
                           f"{'/'.join(map(str, others))}; they wait for it in a collective (train."
                           "collective_timeout_s). A hung or dying process on that rank's node")
                    self.warnings.append(msg)
                    self.log(msg)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@contextlib.contextmanager
def stack_dumps_on_signal(name: str = STACK_DUMP_SIGNAL, file=None) -> Iterator[None]:
    """While inside: `kill -USR2 <pid>` prints every thread's Python stack to stderr, the rank goes on. Where a
    hung rank waits (a collective, the store, I/O) is then one signal away, with no debugger attached; torch's
    own flight recorder covers NCCL only. faulthandler writes from the C signal handler, so it answers while
    the main thread is blocked inside a gloo or NCCL call. `file`: where to (default stderr, the rank's log)."""
    signum = getattr(signal, name, None)
    target = _with_descriptor(file or sys.stderr, sys.__stderr__)
    if signum is None or target is None:  # a platform without it (Windows), or nowhere to write: nothing to install
        yield
        return
    faulthandler.register(signum, file=target, all_threads=True)
    try:
        yield
    finally:
        faulthandler.unregister(signum)


def _with_descriptor(*files):
    """The first of `files` backed by an OS file descriptor (faulthandler writes to the descriptor from the signal
    handler): a caller's captured stderr (pytest's capsys, an io.StringIO) has none, the process's own has."""
    for f in files:
        try:
            f.fileno()
            return f
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
            continue
    return None
