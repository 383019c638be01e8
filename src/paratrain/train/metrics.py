"""Step metrics: loss, lr, tokens/s, MFU, memory -> JSONL, TensorBoard and a console progress bar."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from paratrain.device import matmul_dtype, peak_memory_bytes, synchronize  # noqa: F401 (re-exported)


def measure_peak_flops(device: torch.device, size: int = 1024, repeats: int = 8) -> float:
    """Achievable dense matmul FLOP/s of this process on `device` (a short probe, used when no catalog
    entry names the peak). fp32 on the host, bf16 on an accelerator (paratrain.device.matmul_dtype)."""
    dtype = matmul_dtype(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


class MetricsLogger:
    """Writes on the main rank only; other ranks get a logger that does nothing."""

    def __init__(self, run_dir: str | Path, enabled: bool, jsonl: bool = True, tensorboard: bool = True,
                 total_steps: int = 0, progress: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._jsonl = self._tb = self._bar = None
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
        record = {"step": step, **values}
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb:
            for key, val in values.items():
                if isinstance(val, int | float):
                    self._tb.add_scalar(key, val, step)

    def advance(self, n: int, postfix: dict) -> None:
        if self._bar is not None:
            self._bar.update(n)
            self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()})

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for h in (self._bar, self._tb, self._jsonl):
            if h is not None:
                h.close()
