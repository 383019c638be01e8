"""Per-step time breakdown: cheap timers every step, and the profiler on sampled steps for communication.

On an accelerator the profiler records the device's activity too, and communication is measured on the device
timeline (`device_comm_seconds`: collective kernels not overlapped by compute), so calibration reads real
communication times on any accelerator; the host-thread measure below is what the CPU runs use.

Timers split every step into data, forward+backward and optimizer time (and the loop times checkpoint saves).
The rest needs the profiler: every `metrics.profile_every` steps one step runs under torch.profiler, and
from the training thread's events come the exposed communication by kind (time inside or waiting for
collectives; for pipelines the point-to-point waits are the pipeline's idle time) and the backward time
(autograd engine functions; forward = forward+backward - backward, each including the communication issued
inside it). Only top-level communication events count, so nested records are not doubled.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path

from paratrain.device import BACKEND_NAMES

# name fragment (lower case) -> kind; first match wins
COMM_KINDS = (
    ("reduce_scatter", "reduce_scatter"), ("reducescatter", "reduce_scatter"),
    ("all_gather", "all_gather"), ("allgather", "all_gather"),
    ("all_reduce", "all_reduce"), ("allreduce", "all_reduce"),
    ("all_to_all", "all_to_all"), ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"), ("send", "p2p"), ("recv", "p2p"), ("c10d::wait", "wait"), ("aten::wait", "wait"),
)


def comm_kind(name: str) -> str | None:
    low = name.lower()
    if not any(tag in low for tag in ("c10d", *BACKEND_NAMES, "wait", "fsdp::", "send", "recv")):
        return None
    for fragment, kind in COMM_KINDS:
        if fragment in low:
            return kind
    return None


def exposed_comm_seconds(events) -> dict[str, float]:
    """Seconds the training thread spent in top-level communication events, by kind."""
    main = _training_thread(events)
    if main is None:
        return {}
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e.thread != main or (kind := comm_kind(e.name)) is None:
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if comm_kind(parent.name) is not None:
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            out[kind] += e.cpu_time_total / 1e6
    return dict(out)


def device_comm_seconds(events) -> dict[str, float]:
    """Exposed communication on the accelerator's own timeline (kineto events of non-host devices): per kind, the
    time collective kernels ran while no compute kernel ran on the same device. Host timers cannot see this:
    with asynchronous collectives the host returns at once and waits read about zero. {} without device events."""
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type() != DeviceType.CPU]
    comm: dict[tuple, list[tuple[int, int, str]]] = defaultdict(list)
    compute: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for e in kernels:
        where = (_device_type_name(e), e.device_index())
        span = (e.start_ns(), e.start_ns() + e.duration_ns())
        if (kind := comm_kind(e.name())) is not None:
            comm[where].append((*span, kind))
        else:
            compute[where].append(span)
    out: dict[str, float] = defaultdict(float)
    for where, spans in comm.items():
        busy = _merged(compute[where])
        for start, end, kind in spans:
            covered = sum(max(0, min(end, b) - max(start, a)) for a, b in busy)
            out[kind] += (end - start - covered) / 1e9
    return dict(out)


def _device_type_name(event) -> str:
    return str(event.device_type()).rsplit(".", 1)[-1].lower()  # the enum member name, lower case: a grouping key


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _training_thread(events) -> int | None:
    """The thread that ran the step: on CPU the autograd engine runs backward on the calling thread, so it is
    the thread with the most backward time. Only without any backward (a forward-only step) the busiest thread;
    a background thread (an asynchronous checkpoint upload, the data loader) can be busier than the step."""
    busy: dict[int, float] = defaultdict(float)
    backward: dict[int, float] = defaultdict(float)
    for e in events:
        if e.cpu_parent is None:
            busy[e.thread] += e.cpu_time_total
            if e.name.startswith("autograd::engine::evaluate_function"):
                backward[e.thread] += e.cpu_time_total
    pick = backward or busy
    return max(pick, key=pick.get) if pick else None


def backward_seconds(events) -> float:
    """Seconds the training thread spent running the autograd engine's backward functions (on CPU the engine
    runs on the calling thread; the communication issued inside backward is included)."""
    main = _training_thread(events)
    return sum(e.cpu_time_total for e in events if e.cpu_parent is None and e.thread == main
               and e.name.startswith("autograd::engine::evaluate_function")) / 1e6


class StepTimer:
    """Accumulates named phases of one step; `profile()` wraps a step in the profiler when asked.

    On the host work is synchronous, so every step's phases are timed exactly with no waiting. On an accelerator
    (`sync` given) a phase boundary needs the device to catch up, so phases are timed only on profiled steps
    (where the profiler waits anyway); normal steps record none and wait for nothing."""

    def __init__(self, sync=None):
        self.phases: dict[str, float] = {}
        self._sync = sync
        self._profiling = False
        self._profiler = None
        self.traces: list[str] = []  # Chrome trace files written by profile()

    @contextlib.contextmanager
    def phase(self, name: str):
        timed = self._sync is None or self._profiling
        if timed and self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if timed:
                if self._sync is not None:
                    self._sync()
                self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    @contextlib.contextmanager
    def profile(self, enabled: bool, trace_path: str | Path | None = None):
        """Run the block under torch.profiler when `enabled`; with `trace_path`, also write the step as a Chrome
        trace (JSON: chrome://tracing, https://ui.perfetto.dev)."""
        if not enabled:
            yield
            return
        from torch.profiler import profile, supported_activities

        self._profiling = True
        try:  # the host's activity and the accelerator's (CUDA, XPU, PrivateUse1 = Neuron, ...) where present
            with profile(activities=list(supported_activities())) as prof:
                yield
        finally:
            self._profiling = False
        if trace_path is not None:
            Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace_path))
            self.traces.append(str(trace_path))
        events = prof.events()
        on_device = device_comm_seconds(prof.profiler.kineto_results.events())
        comm = on_device if on_device else exposed_comm_seconds(events)  # host-timed where no device timeline
        self.phases.update({f"comm_{k}_s": v for k, v in comm.items()})
        if (backward := backward_seconds(events)) > 0:
            self.phases["backward"] = backward

    def take(self) -> dict[str, float]:
        out, self.phases = self.phases, {}
        return out
