"""End to end, as users run it: `torchrun --nproc-per-node 2 -m paratrain train --set parallel.pp=2` on a small
prepared dataset, against the single-process run of the same config; then the PP2 checkpoint resumed by a
single process (layer names are global, so the checkpoint reshards by name) continues exactly like the
uninterrupted single-process run. Constant LR so that runs of different lengths share the schedule."""

import json
import os
import subprocess
import sys

import pytest

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.train.data import prepare

PP_STEPS, TOTAL_STEPS = 4, 6


def _common(tmp_path, tag, steps):
    return ["--set", f"train.steps={steps}", "--set", "optim.warmup_steps=0", "--set", 'optim.schedule="constant"',
            "--set", "train.eval_every=0", "--set", "train.progress=false",
            "--set", f'metrics.run_dir="{tmp_path / tag}"', "--set", "metrics.tensorboard=false",
            "--set", f'data.prepared_dir="{tmp_path / "data"}"', "--set", "data.max_source_bytes=200000",
            "--set", "data.vocab_size=512", "--set", "model.vocab=512", "--set", "model.layers=4",
            "--set", "train.global_batch=8", "--set", "train.microbatch=2", "--set", "train.seq_len=64",
            "--set", "train.device=\"cpu\"", "--set", f'checkpoint.dir="{tmp_path / tag / "ckpt"}"',
            "--summary-json", str(tmp_path / f"{tag}.json")]


def _close(a: list[float], b: list[float], rtol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_torchrun_pp2_matches_single_process_and_resumes_in_one_process(tmp_path):
    single = ["train", *_common(tmp_path, "single", TOTAL_STEPS)]
    prepare(load_config(None, [a for a in single[2::2] if "=" in a and a.startswith("data.")]).data,
            log=lambda *_: None)
    assert main(single) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "paratrain", "train", *_common(tmp_path, "pp2", PP_STEPS),
           "--set", "parallel.pp=2", "--set", 'parallel.pp_schedule="1f1b"']
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = json.loads((tmp_path / "single.json").read_text())
    got = json.loads((tmp_path / "pp2.json").read_text())
    assert got["layout"] == {"pp": 2, "dp": 1, "cp": 1, "tp": 1} and got["world_size"] == 2
    assert _close(got["losses"], ref["losses"][:PP_STEPS]), (got["losses"], ref["losses"])

    resumed = ["train", *_common(tmp_path, "resumed", TOTAL_STEPS), "--resume-from", got["checkpoint"]]
    assert main(resumed) == 0
    cont = json.loads((tmp_path / "resumed.json").read_text())
    assert _close(cont["losses"], ref["losses"][PP_STEPS:]), (cont["losses"], ref["losses"])
