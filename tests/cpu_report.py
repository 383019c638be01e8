"""pytest plugin: CPU seconds (user + sys) per test, counting this process and every child process.

`pytest --cpu-report=cpu.json` writes one row per test with the CPU its setup, call and teardown used, plus the
collection (imports) and the end of the session. Wall time is noise on a shared machine; CPU time is what the
suite's budget (600 CPU-s on 2 cores) is about. Summarise with `python benchmarks/suite_cpu.py cpu.json`.

What is counted for a test:
- this process: resource.getrusage(RUSAGE_SELF) delta;
- children that finished during the test (subprocess/torchrun, and their own waited-for children):
  RUSAGE_CHILDREN delta;
- descendants that stay alive across tests (forkservers and the gloo pool's ranks they fork): the delta of
  utime + stime + cutime + cstime in /proc/<pid>/stat since the previous test. When such a process is reaped its
  whole life lands in its parent's reaped-children time, so the part already charged to earlier tests is
  subtracted then.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, bool, float, float]]:
    """pid -> (parent pid, is a zombie, user, sys CPU seconds of itself + its reaped children), every process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; fields[0] is the state
        utime, stime, cutime, cstime = (int(x) * _TICK_S for x in fields[11:15])
        out[int(name)] = (int(fields[1]), fields[0] == "Z", utime + cutime, stime + cstime)
    return out


def _live_descendants(procs: dict[int, tuple[int, bool, float, float]]) -> dict[int, tuple[float, float]]:
    """pid -> (user, sys) of every live descendant of this process: children, and their children (the ranks a
    multiprocessing fork server forks are its children, not ours). A zombie is left out: its CPU shows up in its
    parent's reaped-children time once reaped."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        _ppid, zombie, user, system = procs[pid]
        if not zombie:
            out[pid] = (user, system)
        todo.extend(children.get(pid, []))
    return out


def _rusage_s(who: int) -> tuple[float, float]:
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime


def _sub(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return a[0] - b[0], a[1] - b[1]


class CpuMeter:
    def __init__(self) -> None:
        self.self_s = _rusage_s(resource.RUSAGE_SELF)
        self.children_s = _rusage_s(resource.RUSAGE_CHILDREN)
        self.live = _live_descendants(_processes())

    def lap(self) -> dict[str, float]:
        """CPU since the previous lap: self_s, children_s, live_children_s, their sum cpu_s, and sys_s (the
        part of cpu_s spent in the kernel)."""
        self_s = _rusage_s(resource.RUSAGE_SELF)
        children_s = _rusage_s(resource.RUSAGE_CHILDREN)
        procs = _processes()
        live = _live_descendants(procs)
        parts = {"self_s": _sub(self_s, self.self_s), "children_s": _sub(children_s, self.children_s),
                 "live_children_s": (0.0, 0.0)}
        for pid, v in self.live.items():
            # gone or a zombie: its whole life lands in its parent's reaped-children time (ours: RUSAGE_CHILDREN;
            # a live descendant's: counted below), and the part seen so far was charged before
            if pid not in live and (pid not in procs or procs[pid][1]):
                parts["children_s"] = _sub(parts["children_s"], v)
        for pid, v in live.items():
            du, ds = _sub(v, self.live.get(pid, (0.0, 0.0)))
            parts["live_children_s"] = (parts["live_children_s"][0] + du, parts["live_children_s"][1] + ds)
        row = {k: u + s for k, (u, s) in parts.items()}
        row["cpu_s"] = sum(row.values())
        row["sys_s"] = sum(s for _, s in parts.values())
        self.self_s, self.children_s, self.live = self_s, children_s, live
        return row


class CpuReport:
    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: list[dict] = []
        self.meter: CpuMeter | None = None
        self.wall0 = time.monotonic()

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session) -> None:
        # Everything before the first test (interpreter start, imports during collection) is one row.
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.rows.append({"nodeid": "<collection>", "cpu_s": r.ru_utime + r.ru_stime, "sys_s": r.ru_stime,
                          "wall_s": 0.0})
        self.meter = CpuMeter()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall = time.monotonic()
        yield
        row = self.meter.lap()
        row.update(nodeid=item.nodeid, wall_s=time.monotonic() - wall)
        self.rows.append(row)
        self._write()  # after every test: a run killed by a timeout still leaves its table

    def pytest_sessionfinish(self, session) -> None:
        if self.meter is None:
            return
        row = self.meter.lap()
        row.update(nodeid="<session end>", wall_s=0.0)
        self.rows.append(row)
        self._write()

    def _write(self) -> None:
        total = {"cpu_s": sum(r["cpu_s"] for r in self.rows), "sys_s": sum(r["sys_s"] for r in self.rows),
                 "wall_s": time.monotonic() - self.wall0,
                 "loadavg": open("/proc/loadavg").read().split()[:3]}
        with open(self.path + ".tmp", "w") as f:
            json.dump({"total": total, "tests": self.rows}, f, indent=1)
        os.replace(self.path + ".tmp", self.path)


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-report", metavar="PATH", default=None,
                     help="write CPU seconds (user+sys, this process and its children) per test to PATH (JSON)")


def pytest_configure(config) -> None:
    path = config.getoption("--cpu-report")
    if path:
        config.pluginmanager.register(CpuReport(path), "paratrain-cpu-report")
