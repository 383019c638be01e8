"""`paratrain verify`: two runs of one job compared step by step and rank by rank (here: two layouts on CPU)."""

from __future__ import annotations

import argparse
import json

import pytest

from paratrain.cli import UserError, main
from paratrain.config import load_config
from paratrain.train.data import prepare
from paratrain.train.verify import compare, plan_runs, trace_run

DATA = ["data.max_source_bytes=200000", "data.vocab_size=384"]


def job(tmp, run: str, *extra: str) -> list[str]:
    return ["model.vocab=384", "model.layers=2", "train.steps=2", "train.global_batch=8", "train.microbatch=2",
            "train.seq_len=32", "train.eval_every=0", "train.progress=false", "metrics.tensorboard=false",
            "checkpoint.save_final=false", 'checkpoint.resume="none"', 'train.device="cpu"',
            f'metrics.run_dir="{tmp / run}"', f'data.prepared_dir="{tmp / "data"}"', *DATA, *extra]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verify")
    prepare(load_config(None, [f'data.prepared_dir="{tmp / "data"}"', *DATA]).data, log=lambda *_: None)
    return tmp


def _trace(sets):
    return trace_run(load_config(None, sets))


def _fake(rank: int, scale: float = 1.0) -> dict:
    steps = [{"step": s, "loss": 5.0 - s, "grad_norm": 2.0, "param_norm": 10.0 * scale, "local_norm": 7.0,
              "local_sum": 0.5} for s in (1, 2)]
    return {"rank": rank, "world_size": 2, "layout": {"dp": 2}, "steps": steps}


def test_compare_flags_the_rank_and_step_that_differ():
    ref = [_fake(0), _fake(1)]
    assert compare(ref, [_fake(0), _fake(1)], 1e-4, same_layout=True)["passed"]
    bad = _fake(1)
    bad["steps"][1]["local_sum"] += 7.0 * 2e-4  # 2e-4 of the shard's norm, on rank 1 at step 2
    out = compare(ref, [_fake(0), bad], 1e-4, same_layout=True)
    assert not out["passed"]
    assert [(r["rank"], r["step"]) for r in out["rows"] if not r["ok"]] == [(1, 2)]
    assert out["worst"]["local_sum"] == pytest.approx(2e-4)
    # another layout: only global quantities, each rank against the reference's rank 0
    other = compare([_fake(0)], [_fake(0, 1.001), _fake(1, 1.001)], 1e-4, same_layout=False)
    assert not other["passed"] and "local_sum" not in other["worst"]


def _args(**kw):
    base = {"config": None, "set": [], "device": "auto", "steps": 2, "nproc": 1, "against_layout": [],
            "against_nproc": None, "rtol": None, "json": False}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, message", [
    ({"device": "cpu"}, r"--device=cpu: the run under test is on the host too"),
    ({"device": "cuda"}, r"train.device='cuda': not available here"),
    ({"against_layout": ["single", "parallel.tp=1"]}, "'single' takes no other overrides"),
    ({"nproc": 3, "set": ["parallel.tp=2"], "against_layout": ["single"]}, r"--nproc=3: parallel: world size 3"),
])
def test_bad_requests_fail_before_any_run(kw, message):
    if kw.get("device") == "cuda":
        from paratrain.device import available_accelerator

        if available_accelerator():
            pytest.skip("this machine has an accelerator: the request is valid here")
    with pytest.raises((UserError, ValueError), match=message):
        plan_runs(_args(**kw))


def test_a_bad_step_count_is_one_line(capsys):
    assert main(["verify", "--steps", "0", "--against-layout", "single"]) == 2
    assert capsys.readouterr().err.strip() == "paratrain verify: error: --steps = 0: must be >= 1"


def test_fsdp_on_two_ranks_agrees_with_the_single_device_run(dist_run, tmp):
    ref = [_trace(job(tmp, "single"))]
    test = dist_run(2, _trace, job(tmp, "fsdp2", "parallel.dp=2", 'parallel.dp_kind="fsdp"'))
    out = compare(ref, test, 1e-4, same_layout=False)
    assert out["passed"], out["worst"]
    assert [r["rank"] for r in out["rows"]] == [0, 0, 1, 1] and out["worst"]["param_norm"] < 1e-6
    assert test[0]["steps"][0]["local_norm"] != test[1]["steps"][0]["local_norm"]  # different shards per rank


def test_cli_compares_two_layouts(tmp, capsys, monkeypatch):
    """`paratrain verify --json` end to end: both runs as the `python -m paratrain.train.verify` workers it starts
    (forked warm from the test session's fork server: tests/torchrun_fork.py python_m_forked, ~4 CPU-s of imports
    less per run), their traces compared."""
    import torchrun_fork

    import paratrain.train.verify as verify

    runs, real_run = [], verify.subprocess.run

    def run(argv, **kw):  # only verify's workers; any other subprocess of this process runs as it would
        if argv[1:3] != ["-m", "paratrain.train.verify"]:
            return real_run(argv, **kw)
        runs.append(argv)
        return torchrun_fork.python_m_forked(argv, **kw)

    monkeypatch.setattr(verify.subprocess, "run", run)
    code = main(["verify", "--against-layout", 'parallel.recompute="full"', "--steps", "1", "--json",
                 *[a for s in job(tmp, "cli") for a in ("--set", s)]])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["passed"] and len(out["rows"]) == 1 and out["rtol"] == 1e-4
    assert [argv[1:3] for argv in runs] == [["-m", "paratrain.train.verify"]] * 2  # the reference, then the test
