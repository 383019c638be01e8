"""End to end, as users run it: `torchrun --nproc-per-node 2 -m paratrain train --set parallel.cp=2` against the
single-process run of the same config on the same prepared data (loss per step within 1e-5 relative)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.train.data import prepare

STEPS = 3


def _free_port() -> int:
    # An explicit port: with --master-port 0, the workers' rendezvous hung on this machine (torch 2.13).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _common(tmp_path, tag):
    return ["--set", f"train.steps={STEPS}", "--set", "optim.warmup_steps=1", "--set", "train.eval_every=2",
            "--set", "train.eval_batches=1", "--set", "train.progress=false",
            "--set", f'metrics.run_dir="{tmp_path / tag}"', "--set", "metrics.tensorboard=false",
            "--set", f'data.prepared_dir="{tmp_path / "data"}"', "--set", "data.max_source_bytes=200000",
            "--set", "data.vocab_size=512", "--set", "model.vocab=512", "--set", "model.layers=2",
            "--set", "train.global_batch=4", "--set", "train.microbatch=2", "--set", "train.seq_len=64",
            "--set", "checkpoint.save_final=false", "--set", "train.device=\"cpu\"",
            "--summary-json", str(tmp_path / f"{tag}.json")]


@pytest.mark.slow  # ~40 s on 2 cores: tokenizer training, a single-process run and a 2-rank torchrun
def test_torchrun_cp2_matches_single_process(tmp_path):
    single = ["train", *_common(tmp_path, "single")]
    prepare(load_config(None, [a for a in single[2::2] if "=" in a and a.startswith("data.")]).data,
            log=lambda *_: None)
    assert main(single) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()),
           "-m", "paratrain", "train", *_common(tmp_path, "cp2"), "--set", "parallel.cp=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = json.loads((tmp_path / "single.json").read_text())
    got = json.loads((tmp_path / "cp2.json").read_text())
    assert got["layout"] == {"pp": 1, "dp": 1, "cp": 2, "tp": 1} and got["world_size"] == 2
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], ref["losses"])
