"""End-to-end helpers: run `paratrain train` as users do (one process, or under torchrun) on a small prepared
dataset, and compare the losses per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.train.data import prepare

SMALL_RUN = {"train.steps": 4, "optim.warmup_steps": 1, "train.eval_every": 0, "train.progress": "false",
             "metrics.tensorboard": "false", "data.max_source_bytes": 200000, "data.vocab_size": 512,
             "model.vocab": 512, "model.layers": 2, "train.global_batch": 8, "train.microbatch": 2,
             "train.seq_len": 64, "checkpoint.save_final": "false", "train.device": '"cpu"'}


def train_args(tmp_path: Path, tag: str, **overrides) -> list[str]:
    """`train` arguments of a small run: its own run dir and summary, shared prepared data. Keys use `__`
    for `.` (train__steps=6); values are TOML literals."""
    values = {**SMALL_RUN, **{k.replace("__", "."): v for k, v in overrides.items()},
              "metrics.run_dir": f'"{tmp_path / tag}"', "data.prepared_dir": f'"{tmp_path / "data"}"'}
    args = ["train"]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return args + ["--summary-json", str(tmp_path / f"{tag}.json")]


def run_single(args: list[str]) -> dict:
    """In this process (preparing the shared data first, so torchrun ranks never race to tokenize)."""
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set" and args[i + 1].startswith("data.")]
    prepare(load_config(None, sets).data, log=lambda *_: None)
    assert main(args) == 0
    return json.loads(Path(args[args.index("--summary-json") + 1]).read_text())


def run_torchrun(nproc: int, args: list[str], timeout_s: int = 300, fork: bool = False,
                 fork_agent: bool = False) -> dict:
    """`torchrun --standalone --nproc-per-node N -m paratrain ARGS`; with fork, the same torchrun with its agent and
    workers forked warm (tests/torchrun_fork.py: ~4 CPU-s of imports less per process); with fork_agent only the
    agent (torchrun's main, ~2.4 CPU-s of imports less), its workers new `python -m paratrain` processes."""
    torchrun_args = ["--standalone", f"--nproc-per-node={nproc}"]
    summary = Path(args[args.index("--summary-json") + 1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if fork or fork_agent:
        import torchrun_fork

        code, log = torchrun_fork.run(torchrun_args, args, env, summary.with_suffix(".log"), timeout_s,
                                      fork_workers=fork)
        assert code == 0, log[-3000:]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "paratrain", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(summary.read_text())


def assert_losses_close(got: list[float], ref: list[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(ref) and all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, ref, strict=True)), \
        (got, ref)
