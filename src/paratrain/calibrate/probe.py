"""`paratrain probe`: measure this machine and write a hardware file the planner reads like any catalog entry.

What is measured, each the way the training runtime uses the machine (one compute thread per rank on CPU):
- dense matmul throughput by size (square fp32 on CPU, bf16 on CUDA): peak and the size-dependent curve;
- memory bandwidth (a large tensor copy: read + write);
- collectives of the process-group backend in use (gloo on CPU, NCCL on CUDA): all-reduce, reduce-scatter,
  all-gather and send/recv by message size and group size, fitted to t = latency + volume / bandwidth with
  the ring volumes of the planner (2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter / all-gather, 1 for p2p).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np

from paratrain.device import (
    CPU,
    HOST_BACKEND,
    all_gather_single,
    backend_for,
    is_host,
    matmul_dtype,
    reduce_scatter_single,
    sync_fn,
)

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "send_recv")


def ring_volume_factor(kind: str, n: int) -> float:
    """Bytes each rank sends per byte of the message, for a ring algorithm (the planner's model)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


@dataclass
class ProbeResult:
    device: str
    threads_per_rank: int
    matmul_tflops_by_size: dict[int, float] = field(default_factory=dict)
    memory_bw_gbytes_per_s: float = 0.0
    collectives: list[dict] = field(default_factory=list)  # {kind, group, bytes, time_s}
    fits: dict[str, dict] = field(default_factory=dict)  # kind -> {latency_us, bw_gbytes_per_s}
    cores: int = 1  # cores the ranks ran on (more ranks than cores time-share them)
    link_fit: dict = field(default_factory=dict)  # the planner's link model fitted to every collective

    @classmethod
    def from_json(cls, data: dict) -> ProbeResult:
        """Back from `probe_json` (refit the saved measurements with the current fitting code)."""
        res = cls(device=data["device"], threads_per_rank=data["threads_per_rank"],
                  matmul_tflops_by_size={int(k): v for k, v in data["matmul_tflops_by_size"].items()},
                  memory_bw_gbytes_per_s=data["memory_bw_gbytes_per_s"], collectives=data["collectives"],
                  cores=data.get("cores", os.cpu_count() or 1))
        res.fits = {k: f for k in COLLECTIVES if (f := fit_alpha_beta(res.collectives, k))}
        res.link_fit = fit_link(res.collectives, res.cores)
        return res

    @property
    def peak_tflops(self) -> float:
        return max(self.matmul_tflops_by_size.values())


def _time_best(fn, repeats: int, sync=lambda: None, min_time_s: float = 0.0) -> float:
    """Best time of `repeats` calls, repeated further until `min_time_s` has passed (after one warm-up)."""
    fn()
    sync()
    best = float("inf")
    start, n = time.perf_counter(), 0
    while n < repeats or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def probe_matmul(sizes: list[int], device: str = CPU, repeats: int = 5, rounds: int = 1,
                 min_time_s: float = 0.0) -> dict[int, float]:
    """TFLOP/s by square matmul size: the best over `rounds` rounds that each time every size (interleaved,
    so a burst of load on a shared machine does not spoil all the measurements of one size)."""
    import torch

    dtype = matmul_dtype(torch.device(device))
    sync = sync_fn(torch.device(device)) or (lambda: None)
    mats = {n: (torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype))
            for n in sizes}
    out = dict.fromkeys(sizes, 0.0)
    for _ in range(rounds):
        for n, (a, b) in mats.items():
            t = _time_best(lambda a=a, b=b: a @ b, repeats, sync, min_time_s)
            out[n] = max(out[n], 2 * n**3 / t / 1e12)
    return out


def probe_memory_bandwidth(device: str = CPU, megabytes: int = 256, repeats: int = 5) -> float:
    import torch

    n = megabytes * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    sync = sync_fn(torch.device(device)) or (lambda: None)
    t = _time_best(lambda: dst.copy_(src), repeats, sync)
    return 2 * src.numel() * 4 / t / 1e9  # read + write


def _collective_worker(rank, world, store_path, sizes, repeats, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(HOST_BACKEND, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    rows = []
    for nbytes in sizes:
        numel = max(nbytes // 4, world)
        numel -= numel % world
        x = torch.ones(numel)
        out_full = torch.empty(numel)
        out_shard = torch.empty(numel // world)
        ops = {
            "all_reduce": lambda x=x: dist.all_reduce(x),
            "reduce_scatter": lambda x=x, o=out_shard: reduce_scatter_single(o, x),
            "all_gather": lambda o=out_full, s=out_shard: all_gather_single(o, s),
        }
        if world == 2:
            ops["send_recv"] = lambda x=x: dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
        for kind, op in ops.items():
            dist.barrier()
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                best = min(best, time.perf_counter() - t0)
            # The slowest rank defines a collective's time.
            t = torch.tensor([best])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows.append({"kind": kind, "group": world, "bytes": numel * 4, "time_s": float(t)})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def probe_collectives(group_sizes: list[int], sizes: list[int], repeats: int = 5) -> list[dict]:
    """Fork `n` gloo ranks per group size (fork: no re-import of torch) and time each collective."""
    ctx = mp.get_context("fork")
    rows: list[dict] = []
    for world in group_sizes:
        queue = ctx.Queue()
        store = os.path.join(tempfile.mkdtemp(prefix="paratrain-probe-"), "store")
        procs = [ctx.Process(target=_collective_worker, args=(r, world, store, sizes, repeats, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows.extend(queue.get(timeout=600))
        for p in procs:
            p.join(timeout=60)
    return rows


def fit_alpha_beta(rows: list[dict], kind: str) -> dict:
    """Least squares of t = latency + volume_bytes / bw over all group and message sizes of one collective."""
    sel = [r for r in rows if r["kind"] == kind]
    if len(sel) < 2:
        return {}
    vol = np.array([ring_volume_factor(kind, r["group"]) * r["bytes"] for r in sel])
    t = np.array([r["time_s"] for r in sel])
    # Weight by 1/t so small and large messages count alike (relative error), as the planner is judged.
    A = np.stack([np.ones_like(vol), vol], axis=1) / t[:, None]
    coef, *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    latency_s, inv_bw = max(coef[0], 0.0), max(coef[1], 1e-15)
    return {"latency_us": float(latency_s * 1e6), "bw_gbytes_per_s": float(1 / inv_bw / 1e9), "points": len(sel)}


def fit_link(rows: list[dict], cores: int) -> dict:
    """The planner's link model (plan.collectives.collective_time_s on one tier) fitted to the measured all-reduce,
    reduce-scatter and all-gather times, by non-negative least squares on relative error:

        t = f * steps(n) * (latency + (share - 1) * timeshare_step) + f * (n - 1) / n * bytes * share / bw

    f = 2 for all-reduce, 1 for reduce-scatter / all-gather; share = max(1, n / cores) ranks take turns on one
    core: each step also waits for the next rank to be scheduled (on 2 cores, gloo's 4 KiB all-reduce takes
    0.1 ms on 2 ranks and ~2 ms on 4), and each rank gets 1/share of a core to copy and reduce. send/recv is
    left out: gloo's point-to-point is a plain copy, ~5x faster per byte than its collectives. With no group
    larger than the core count the time-sharing term is not identifiable and stays 0."""
    from scipy.optimize import nnls

    from paratrain.plan.collectives import ring_steps

    cols, t = [], []
    for r in rows:
        if r["kind"] == "send_recv":
            continue
        n = r["group"]
        share = max(1.0, n / cores)
        f = 2.0 if r["kind"] == "all_reduce" else 1.0
        steps = f * float(ring_steps(n))
        cols.append([steps, steps * (share - 1.0), f * (n - 1) / n * r["bytes"] * share])
        t.append(r["time_s"])
    if len(t) < 2:
        return {}
    A, t = np.array(cols), np.array(t)
    shared = bool((A[:, 1] > 0).any())
    if not shared:
        A = A[:, [0, 2]]
    coef, _ = nnls(A / t[:, None], np.ones_like(t))
    pred = A @ coef
    return {"latency_us": float(coef[0] * 1e6), "timeshare_step_us": float(coef[1] * 1e6) if shared else 0.0,
            "bw_gbytes_per_s": float(1 / max(coef[-1], 1e-15) / 1e9), "points": len(t), "cores": cores,
            "mape": float(np.mean(np.abs(pred / t - 1)))}


def run_probe(device: str = CPU, group_sizes=(2, 4), quick: bool = False, log=print) -> ProbeResult:
    import torch

    threads = 1 if is_host(device) else torch.get_num_threads()
    if is_host(device):
        torch.set_num_threads(1)  # as a training rank runs
    res = ProbeResult(device=device, threads_per_rank=threads, cores=os.cpu_count() or 1)
    sizes = [128, 256, 512, 1024] if quick else [128, 256, 512, 1024, 2048]
    log("probing matmul throughput ...")
    res.matmul_tflops_by_size = probe_matmul(sizes, device, repeats=3 if quick else 5, rounds=2 if quick else 3,
                                             min_time_s=0.05 if quick else 0.1)
    log("probing memory bandwidth ...")
    res.memory_bw_gbytes_per_s = probe_memory_bandwidth(device, 64 if quick else 256)
    if is_host(device) and group_sizes:
        msg = [2**12, 2**16, 2**20, 2**22] if quick else [2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24]
        log(f"probing gloo collectives for groups {list(group_sizes)} ...")
        res.collectives = probe_collectives(list(group_sizes), msg, repeats=3 if quick else 5)
        res.fits = {k: f for k in COLLECTIVES if (f := fit_alpha_beta(res.collectives, k))}
        res.link_fit = fit_link(res.collectives, res.cores)
    return res


def hardware_toml(res: ProbeResult, name: str = "local", ranks: int | None = None) -> str:
    """A catalog file (chips/interconnects/systems tables) describing this machine as measured.

    On a CPU the "chip" is one core running one rank's compute thread: a node has as many chips as the machine
    has cores (`ranks` overrides), and more ranks than cores share them (see calibrate.fit.sized_for)."""
    on_host = is_host(res.device)
    ranks = ranks or res.cores if on_host else ranks or 1
    chips = min(ranks, res.cores) if on_host else ranks  # more ranks than cores share them
    while ranks % chips:
        chips -= 1
    import tomli_w

    link_fit = res.link_fit or res.fits.get("all_reduce", {})
    bw = link_fit.get("bw_gbytes_per_s", 1.0)
    lat = link_fit.get("latency_us", 100.0)
    timeshare = link_fit.get("timeshare_step_us", 0.0)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    src = f"measured by `paratrain probe` on {platform.node()} ({platform.processor() or platform.machine()}), {when}"
    chip = f"{name}-{res.device}"
    link = f"{name}-{backend_for(res.device)}"
    peak = res.peak_tflops
    big = max(res.matmul_tflops_by_size)
    doc = {
        "chips": {chip: {
            "display_name": f"{platform.machine()} {res.device} rank ({res.threads_per_rank} thread)",
            "vendor": "local", "status": "measured",
            # The catalog's peak field holds the measured best matmul rate (fp32 on CPU): MFU on this machine is
            # relative to what a rank can reach, not to a datasheet.
            "bf16_tflops": round(peak, 6), "hbm_bytes": _memory_bytes(),
            "hbm_bw_gbytes_per_s": round(res.memory_bw_gbytes_per_s, 3), "cores_per_chip": 1,
            "source": src,
            "efficiency": {"matmul_eff_max": round(res.matmul_tflops_by_size[big] / peak, 4),
                           "kernel_overhead_s": _kernel_overhead_s(res), "memory_bw_eff": 1.0,
                           "source": src + " (initial values; `paratrain calibrate` refines them)"},
        }},
        "interconnects": {link: {
            "display_name": f"{backend_for(res.device)}{' over shared memory / loopback' if on_host else ''} (measured)",
            "endpoint": "device", "bw_gbytes_per_s": round(bw, 4), "latency_us": round(lat, 2), "bw_eff": 1.0,
            "timeshare_step_us": round(timeshare, 2),
            "source": src + (" (the planner's ring model fitted to all collectives and group sizes, `fit_link`)"
                             if res.link_fit else " (all-reduce alpha-beta fit)"),
        }},
        "systems": {name: {
            "display_name": f"this machine ({platform.node()})", "chip": chip, "chips_per_node": chips,
            "devices_per_chip": ranks // chips, "device_unit": f"{res.device} rank",
            "tiers": [{"name": "intra-node", "interconnect": link, "domain_devices": ranks},
                      {"name": "scale-out", "interconnect": link, "domain_devices": 0}],
            "source": src,
            "prices": {"source": "local machine: no hourly price"},
            "efficiency": {"dp_overlap": 0.0, "tp_overlap": 0.0, "memory_usable_fraction": 0.8,
                           "source": "initial: gloo collectives run on the compute thread's cores, so no overlap "
                                     "is assumed; `paratrain calibrate` fits dp_overlap"},
        }},
    }
    return tomli_w.dumps(doc)


def probe_json(res: ProbeResult) -> dict:
    """The raw measurements (kept beside the hardware file: the catalog schema holds only the model's fields)."""
    return {"device": res.device, "threads_per_rank": res.threads_per_rank, "cores": res.cores,
            "link_fit": res.link_fit,
            "matmul_tflops_by_size": {str(k): v for k, v in res.matmul_tflops_by_size.items()},
            "memory_bw_gbytes_per_s": res.memory_bw_gbytes_per_s, "collective_fits": res.fits,
            "collectives": res.collectives}


def write_probe(res: ProbeResult, out: str, name: str, ranks: int | None) -> Path:
    """The hardware file `out` (for the planner) and the raw measurements beside it (<out>.probe.json)."""
    import json

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hardware_toml(res, name, ranks))
    path.with_suffix(".probe.json").write_text(json.dumps(probe_json(res), indent=2))
    return path


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * 2**30


def _kernel_overhead_s(res: ProbeResult) -> float:
    """Fixed per-matmul cost that makes small matmuls slow: from the smallest vs largest size measured.

    With t(n) = 2n^3/peak_eff + overhead, overhead = t_small - 2 n_small^3 / rate_large.
    """
    small, large = min(res.matmul_tflops_by_size), max(res.matmul_tflops_by_size)
    t_small = 2 * small**3 / (res.matmul_tflops_by_size[small] * 1e12)
    ideal = 2 * small**3 / (res.matmul_tflops_by_size[large] * 1e12)
    return float(max(t_small - ideal, 0.0))
