"""End to end, as users run it: `torchrun --nproc-per-node 4 -m paratrain train` with TP2 x DP2 + SP (and
selective recompute), against the single-process run of the same config on the same prepared data."""

import json
import os
import subprocess
import sys

import pytest

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.train.data import prepare

STEPS = 4


def _common(tmp_path, tag):
    return ["--set", f"train.steps={STEPS}", "--set", "optim.warmup_steps=1", "--set", "train.eval_every=0",
            "--set", "train.progress=false", "--set", f'metrics.run_dir="{tmp_path / tag}"',
            "--set", "metrics.tensorboard=false", "--set", f'data.prepared_dir="{tmp_path / "data"}"',
            "--set", "data.max_source_bytes=200000", "--set", "data.vocab_size=512", "--set", "model.vocab=512",
            "--set", "model.layers=2", "--set", "train.global_batch=8", "--set", "train.microbatch=2",
            "--set", "train.seq_len=64", "--set", "checkpoint.save_final=false", "--set", "train.device=\"cpu\"",
            "--summary-json", str(tmp_path / f"{tag}.json")]


@pytest.mark.slow
def test_torchrun_tp2_dp2_sp_matches_single_process(tmp_path):
    single = ["train", *_common(tmp_path, "single")]
    prepare(load_config(None, [a for a in single[2::2] if "=" in a and a.startswith("data.")]).data,
            log=lambda *_: None)
    assert main(single) == 0
    layout = ["--set", "parallel.tp=2", "--set", "parallel.dp=2", "--set", "parallel.sp=true",
              "--set", "parallel.dp_kind=\"fsdp\"", "--set", "parallel.recompute=\"selective\""]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
           "-m", "paratrain", "train", *_common(tmp_path, "tp2dp2"), *layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = json.loads((tmp_path / "single.json").read_text())
    got = json.loads((tmp_path / "tp2dp2.json").read_text())
    assert got["layout"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 2} and got["world_size"] == 4
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], ref["losses"])
