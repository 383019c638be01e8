"""A persistent pool of gloo ranks for multi-process tests.

Launching torchrun per test costs 5-12 s (import torch in every rank). Instead, N workers per world size are
forked once from a multiprocessing fork server that imported torch.distributed and paratrain (PRELOAD); each joins
a gloo process group and then runs test functions sent to it. Not forked from the pytest process itself: by the
time a pool is made, pytest has run in-process training (checkpoint, watchdog and lease threads, torch's thread
pools), and a child forked from a multi-threaded parent inherits whatever state those threads held; CI saw a
pool rank die of heap corruption ("malloc(): unaligned tcache chunk detected"). The fork server is a fresh,
single-threaded interpreter, so every rank starts from the same clean, warm state.

A test sends a module-level function, its arguments and the environment; every rank runs it and the pool returns
the per-rank results (or re-raises the first rank's error).

The process group has a timeout, and the parent waits with a timeout, so a failing rank cannot hang the suite:
on failure the pool is torn down and rebuilt for the next test.

Every rank shares equal process groups (tests/dist_pool.py `_share_groups`): each DeviceMesh asks for new gloo
groups, and every gloo group owns a transport device whose event-loop thread wakes every 10 ms, idle or not. A
worker that kept the ~130 groups of test_parallel.py's meshes burnt ~0.1 core just waiting (strace -c: ~7,000
epoll_wait/s in one idle worker), and six idle workers cost more CPU than the tests they ran. Destroying the
groups after a case is not an option: DTensor's sharding-propagation caches compare meshes by value and hand the
next, equal mesh the destroyed groups ("Could not resolve the process group registered under the name 47").
Between tasks the ranks are paused (SIGSTOP; `DistPool._pause`): even with shared groups, the idle ranks of the
2- and 4-rank pools burnt 0.027 CPU-s per second of the session while other tests ran; paused, 0.
Tried and not kept: one gloo transport device for all of a rank's groups (each device's loop thread wakes every
10 ms): idle ranks 0.028 -> 0.012 CPU-s per second, but the tasks dearer (the 8-rank pipeline test and
test_layouts_match_single_device, side by side twice in both orders: 63 -> 71 CPU-s).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

# What the fork server imports once, so every rank starts warm (torch._inductor.config:
# torch.use_deterministic_algorithms imports it, 0.7 CPU-s per rank; pytest: each rank imports pytest.__main__,
# spawn's main-module fixup, and the test modules). paratrain.cli and torch.distributed.run: the torchrun agents
# tests/torchrun_fork.py forks from the same server.
PRELOAD = ["torch._inductor.config", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "paratrain.model.llama", "paratrain.train.loop", "paratrain.cli", "torch.distributed.run", "pytest"]
TASK_TIMEOUT_S = float(os.environ.get("PARATRAIN_TEST_TIMEOUT_S", "240"))


def _worker(rank: int, world_size: int, store_path: str, tasks, results, sys_path: list[str]) -> None:
    _die_with_parent()
    sys.path[:] = sys_path  # the test modules the tasks come from
    torch.set_num_threads(1)
    own_env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
    os.environ.update(own_env)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=TASK_TIMEOUT_S / 2))
    _share_groups()
    while True:
        item = tasks.get()
        if item is None:
            break
        try:
            fn, args, kwargs, env = pickle.loads(item)  # inside: a function the worker cannot import is an error
            os.environ.clear()  # the test's environment as it is now (the fork server's is the session's start)
            os.environ.update({**env, **own_env})
            out = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - ship every failure to the parent
            out = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            results.put((rank, pickle.dumps(out)))
        except Exception as exc:  # noqa: BLE001 - unpicklable result
            results.put((rank, pickle.dumps(("error", f"rank {rank}: result not picklable: {exc}"))))
    dist.destroy_process_group()


PAUSE_IDLE = sys.platform.startswith("linux")  # where a rank can be told to die with its parent (prctl)


def _die_with_parent() -> None:
    """A paused (SIGSTOPped) rank can act on nothing but SIGKILL: have the kernel send it that when the fork
    server dies (the fork server exits when pytest does, however pytest ends), so no stopped rank is left over."""
    if not PAUSE_IDLE:
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the fork server died before the call above
        os._exit(1)


def _share_groups() -> None:
    """In a pool rank: `new_group` returns the group made earlier for the same ranks and options, so meshes built
    one after another (one per test case) reuse their groups instead of adding gloo threads. Safe because every
    rank runs the same calls in the same order (a hit or a miss happens on all ranks alike, so the group counter
    stays in step), and groups with the same ranks are one communicator anyway (torch's own DeviceMesh hands out
    the default group for a dimension that spans the world). Groups made with options objects are not shared."""
    from torch.distributed import device_mesh
    from torch.distributed import distributed_c10d as c10d

    original = c10d.new_group
    made: dict = {}

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                  group_desc=None, device_id=None, sort_ranks=True):
        key = (None if ranks is None else tuple(sorted(ranks) if sort_ranks else ranks), timeout, backend,
               use_local_synchronization, device_id)
        pg = made.get(key) if pg_options is None else None
        if pg is None or (pg is not c10d.GroupMember.NON_GROUP_MEMBER and pg not in c10d._world.pg_map):
            pg = original(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                          use_local_synchronization=use_local_synchronization, group_desc=group_desc,
                          device_id=device_id, sort_ranks=sort_ranks)
            if pg_options is None:
                made[key] = pg
        return pg

    c10d.new_group = dist.new_group = device_mesh.new_group = new_group


def forkserver():
    """The session's multiprocessing fork server (started on first use, with PRELOAD imported)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class DistPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.broken = False  # set when a rank failed or hung: ranks may be out of step, so rebuild
        self._ctx = forkserver()
        self._tmp = tempfile.mkdtemp(prefix=f"paratrain-pool{world_size}-")
        store = os.path.join(self._tmp, "store")
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._results = self._ctx.Queue()
        self._procs = [self._ctx.Process(target=_worker,
                                         args=(r, world_size, store, self._tasks[r], self._results, sys.path),
                                         daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return [result of rank 0, rank 1, ...]."""
        payload = pickle.dumps((fn, args, kwargs, dict(os.environ)))
        self._signal_ranks(signal.SIGCONT)
        for q in self._tasks:
            q.put(payload)
        out: list = [None] * self.world_size
        errors = []
        for _ in range(self.world_size):
            rank, data = self._next_result()
            status, value = pickle.loads(data)
            if status == "error":
                errors.append(value)
            out[rank] = value
        if errors:
            self.broken = True
            raise RuntimeError("\n".join(sorted(errors)))
        self._pause()
        return out

    def _pause(self) -> None:
        """Stop the ranks until the next task (SIGSTOP; run and close send SIGCONT). Every rank has answered, so
        none is inside a collective. Why: each gloo group's transport thread wakes every 10 ms, idle or not; the
        idle ranks of the 2- and 4-rank pools burnt ~0.03 CPU-s per second over the whole session (~15 CPU-s of
        the suite), while other tests ran."""
        if PAUSE_IDLE:
            self._signal_ranks(signal.SIGSTOP)

    def _signal_ranks(self, sig: int) -> None:
        if not PAUSE_IDLE:
            return
        for p in self._procs:
            try:
                os.kill(p.pid, sig)
            except (ProcessLookupError, TypeError):  # already gone (reported by _next_result / get_pool)
                pass

    def _next_result(self) -> tuple[int, bytes]:
        """The next rank's answer; a rank that died (a crash in native code, the OOM killer) is reported at once
        with its exit code rather than after the task timeout."""
        deadline = time.monotonic() + TASK_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return self._results.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
            dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
            if dead:
                self.broken = True
                raise RuntimeError(f"pool rank(s) died: exit codes {dead} (negative: killed by that signal)")
        self.broken = True
        raise TimeoutError(f"a rank did not answer within {TASK_TIMEOUT_S} s")

    def close(self) -> None:
        self._signal_ranks(signal.SIGCONT)
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self._tmp, ignore_errors=True)  # the rendezvous file (every session left one in /tmp)


_POOLS: dict[int, DistPool] = {}
BIG_WORLD = 8  # a pool this large is used by a few tests only: closed as soon as another size is asked for


def get_pool(world_size: int) -> DistPool:
    pool = _POOLS.get(world_size)
    if pool is not None and (pool.broken or not all(p.is_alive() for p in pool._procs)):
        _POOLS.pop(world_size).close()
        pool = None
    for big in [w for w in _POOLS if w >= BIG_WORLD and w != world_size]:
        _POOLS.pop(big).close()
    if pool is None:
        # At most two pools of the common sizes alive (2 cores, and idle ranks hold memory), and a big one only
        # while it is in use: making room for it would close the small pools the next tests need again (a
        # fresh pool pays its ranks' cold start: test_layouts_match_single_device[4-none], the first 4-rank
        # task, costs ~6 CPU-s more than [4-selective] right after it).
        small = [w for w in _POOLS if w < BIG_WORLD]
        while world_size < BIG_WORLD and len(small) >= 2:
            _POOLS.pop(small.pop(0)).close()
        pool = DistPool(world_size)
    _POOLS.pop(world_size, None)
    _POOLS[world_size] = pool  # last used last: the least recently used small pool is closed first
    return pool


@atexit.register
def _resume_all() -> None:
    """multiprocessing's own exit handler (registered before this one, so run after it) SIGTERMs and joins the
    ranks: a stopped rank would keep that join waiting."""
    for pool in _POOLS.values():
        pool._signal_ranks(signal.SIGCONT)


def close_all() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def shutdown() -> None:
    """At the end of the session: close the pools and stop the fork server, waiting for it, so the CPU its ranks
    used is counted in this process's children (`time pytest`, the CI's CPU budget) instead of leaving with an
    orphan. multiprocessing has no public call for this; `_stop` is the one its own tests use."""
    from multiprocessing import forkserver

    close_all()
    forkserver._forkserver._stop()
