"""End to end, as users run it: `torchrun --nproc-per-node 2 -m paratrain train` of the tiny MoE model with
expert parallelism (parallel.ep=2, FSDP over the dense weights), against the single-process run of the same
config on the same prepared data: every step's loss within 1e-5, and the router metrics logged. torchrun forks
its workers from a warm agent (tests/torchrun_fork.py); the plain `-m paratrain` worker path stays covered by
test_context_parallel_torchrun.py and test_multinode_netns.py."""

import json

import pytest
from e2e import assert_losses_close, run_single, run_torchrun, train_args

MOE = dict(model__preset='"tiny-moe"', model__aux_loss_coef=0.1, model__capacity_factor=1.0,
           train__log_every=1)


@pytest.mark.slow
def test_torchrun_ep2_matches_single_process(tmp_path):
    ref = run_single(train_args(tmp_path, "single", **MOE))
    got = run_torchrun(2, train_args(tmp_path, "ep2", parallel__ep=2, parallel__dp_kind='"fsdp"', **MOE), fork=True)
    assert got["layout"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 1, "ep": 2, "etp": 1, "edp": 1} and got["world_size"] == 2
    assert_losses_close(got["losses"], ref["losses"])
    steps = [r for r in map(json.loads, (tmp_path / "ep2" / "metrics.jsonl").read_text().splitlines())
             if "loss" in r]
    assert steps and all(sum(r["moe_tokens_per_expert"]) > 0 for r in steps)
    assert any(r["moe_dropped_tokens"] > 0 for r in steps)  # capacity 1.0 drops on these batches
