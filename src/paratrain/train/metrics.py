"""Step metrics: loss, lr, tokens/s, MFU, memory -> JSONL, TensorBoard and a console progress bar."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.device import matmul_dtype, peak_memory_bytes, synchronize  # noqa: F401 (re-exported)

PEAK_SIZES = (256, 512, 1024, 2048)  # square matmuls; on CPUs the fastest size varies with the cache and the load


def measure_peak_flops(device: torch.device, sizes=PEAK_SIZES, rounds: int = 3, min_time_s: float = 0.1) -> float:
    """Achievable dense matmul FLOP/s of this process on `device`: the best of `rounds` interleaved rounds
    over several sizes, each timed for at least `min_time_s` (a single short probe read 0.02-0.10 TFLOP/s on
    the same 2-core machine under load; the best of several sizes and rounds is what the hardware can do).
    fp32 on the host, bf16 on an accelerator (paratrain.device.matmul_dtype); the same timing code as `paratrain probe` (calibrate.probe.probe_matmul)."""
    from paratrain.train.predict import probe_matmul

    return max(probe_matmul(list(sizes), str(device), repeats=2, rounds=rounds, min_time_s=min_time_s).values()) * 1e12


def peak_cache_path() -> Path:
    """$PARATRAIN_CACHE_DIR/peak_flops.json (default ~/.cache/paratrain): one file per machine and user."""
    root = os.environ.get("PARATRAIN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "paratrain"
    return Path(root) / "peak_flops.json"


@dataclass
class PeakFlops:
    """The peak FLOP/s of one rank that MFU is measured against, where it comes from, and (for a probed
    peak) where it is stored. Model FLOPs of a step are a lower bound of the FLOPs the hardware ran, so a
    step faster than a probed peak proves the probe under-measured: `observe` raises the peak to that rate
    and says so (MFU above 1 is never printed); above a catalog peak it reports the contradiction."""

    flops: float
    label: str
    source: str  # "catalog" or "probe"
    cache_key: str = ""
    _warned: bool = False

    def observe(self, model_flops_per_s: float) -> str | None:
        if model_flops_per_s <= self.flops:
            return None
        old = self.flops
        if self.source == "probe":
            self.flops = model_flops_per_s
            self.label = self.label.split(";")[0] + "; raised to the fastest step's model FLOP rate"
            _store_peak(self.cache_key, self.flops, "raised: a training step ran at this model FLOP rate")
            return (f"note: a step ran at {model_flops_per_s / 1e12:.4f} TFLOP/s of model FLOPs, above the probed "
                    f"peak {old / 1e12:.4f}: the probe under-measured this machine; peak raised to that rate and "
                    f"stored in {peak_cache_path()}")
        if self._warned:
            return None
        self._warned = True
        return (f"warning: a step ran at {model_flops_per_s / 1e12:.4f} TFLOP/s of model FLOPs, above the peak "
                f"{old / 1e12:.4f} of {self.label}: that peak or the model's FLOP count is wrong for this device "
                f"(MFU above 1 is logged as measured)")


def machine_peak_flops(device: torch.device, local_ranks: int = 1) -> PeakFlops:
    """This machine's peak for one rank, measured once per (host, device, threads, ranks on the host, torch)
    and cached, so every run of the machine divides by the same number."""
    key = (f"{platform.node()} {device.type} threads={torch.get_num_threads()} local_ranks={local_ranks} "
           f"torch={torch.__version__}")
    cached = _read_cache().get(key)
    label = "peak of this machine measured by a matmul probe"
    if cached:
        return PeakFlops(float(cached["flops"]), f"{label} ({cached['how']}, {peak_cache_path()})", "probe", key)
    flops = measure_peak_flops(device)
    how = f"best of {len(PEAK_SIZES)} sizes x 3 rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    _store_peak(key, flops, how)
    return PeakFlops(flops, f"{label} ({how}, stored in {peak_cache_path()})", "probe", key)


def _read_cache() -> dict:
    try:
        return json.loads(peak_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store_peak(key: str, flops: float, how: str) -> None:
    """Atomic (several ranks may write at once); a cache that cannot be written only costs a re-probe."""
    path = peak_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = {"flops": max(flops, float(data.get(key, {}).get("flops", 0.0))), "how": how}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


class Tracker:
    """An experiment tracker the logger also writes to: Weights & Biases or MLflow, each optional (imported
    only when configured). `module` is the imported package (tests pass a stand-in object)."""

    def __init__(self, kind: str, module, name: str, run_name: str, run_dir: Path, config: dict):
        self.kind, self.module = kind, module
        if kind == "wandb":
            self.run = module.init(project=name, name=run_name, dir=str(run_dir), config=config)
        else:
            module.set_experiment(name)
            self.run = module.start_run(run_name=run_name)
            module.log_params({k: v for k, v in _flat(config).items() if len(str(v)) < 500})

    def log(self, step: int, values: dict) -> None:
        scalars = scalars_of(values)
        if self.kind == "wandb":
            self.run.log(scalars, step=step)
        else:
            self.module.log_metrics(scalars, step=step)

    def close(self) -> None:
        if self.kind == "wandb":
            self.run.finish()
        else:
            self.module.end_run()


def scalars_of(values: dict) -> dict[str, int | float]:
    """The numeric entries of a metrics record; a list of numbers (e.g. moe_tokens_per_expert) as one scalar per
    element, `key/i`, as tensorboard and the trackers take them."""
    out = {}
    for k, v in values.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[k] = v
        elif isinstance(v, list | tuple) and v and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v):
            out.update({f"{k}/{i}": x for i, x in enumerate(v)})
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def tracker_modules(metrics_cfg) -> dict:
    """The tracker packages the config asks for, imported now, so a missing one fails before any work."""
    wanted = {"wandb": metrics_cfg.wandb_project, "mlflow": metrics_cfg.mlflow_experiment}
    out = {}
    for kind, name in wanted.items():
        if not name:
            continue
        try:
            out[kind] = __import__(kind)
        except ImportError:
            key = "wandb_project" if kind == "wandb" else "mlflow_experiment"
            raise ValueError(f"metrics.{key}='{name}': the {kind} package is not installed; allowed: "
                             f"pip install {kind}, or metrics.{key}=\"\"") from None
    return out


class MetricsLogger:
    """Writes on the main rank only; other ranks get a logger that does nothing. Every record carries the
    wall-clock time (time_unix_s) and the seconds since the logger started (elapsed_s). Text goes to stderr,
    so stdout holds only what the command prints (the summary, or JSON with --json)."""

    def __init__(self, run_dir: str | Path, enabled: bool, jsonl: bool = True, tensorboard: bool = True,
                 total_steps: int = 0, progress: bool = True, trackers: list[Tracker] | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._jsonl = self._tb = self._bar = None
        self._trackers = list(trackers or [])
        self._t0 = time.perf_counter()
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional at run time
                self._tb = None
        if progress and total_steps:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="train", unit="step", file=sys.stderr,
                             dynamic_ncols=True, leave=True)

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time_unix_s": round(time.time(), 3),
                  "elapsed_s": round(time.perf_counter() - self._t0, 4), **values}
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb:
            for key, val in scalars_of(values).items():
                self._tb.add_scalar(key, val, step)
        for tracker in self._trackers:
            tracker.log(step, values)

    def advance(self, n: int, postfix: dict) -> None:
        if self._bar is not None:
            self._bar.update(n)
            self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()})

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def abandon(self) -> None:
        """Close for a run that stops before its first step (its start-up error is the one line on stderr):
        the progress bar is cleared, not left behind."""
        if self._bar is not None:
            self._bar.leave = False
        self.close()

    def close(self) -> None:
        for h in (self._bar, self._tb, self._jsonl, *self._trackers):
            if h is not None:
                h.close()
        self._trackers = []


def supersede_records(path: Path, after_step: int, log=print) -> int:
    """A run resumed at `after_step` recomputes the steps after it: move their records (from the attempt that
    was lost) out of metrics.jsonl into metrics.superseded.jsonl, so each step has one record and nothing is
    thrown away. Rewritten in place: a logger holding the file open in append mode writes on at the new end."""
    if not path.exists():
        return 0
    keep, moved = [], []
    with open(path, "r+") as fh:
        for line in fh:
            try:
                step = json.loads(line).get("step", 0)
            except ValueError:  # a line torn by a kill: keep it where it is
                step = 0
            (moved if step > after_step else keep).append(line)
        if moved:
            fh.seek(0)
            fh.writelines(keep)
            fh.truncate()
    if moved:
        with open(path.with_name("metrics.superseded.jsonl"), "a") as out:
            out.writelines(moved)
        log(f"metrics: {len(moved)} record(s) of steps after {after_step} (recomputed now) moved from {path.name} "
            f"to metrics.superseded.jsonl")
    return len(moved)
