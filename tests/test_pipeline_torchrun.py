"""End to end, as users run it: `torchrun --nproc-per-node 2 -m paratrain train --set parallel.pp=2` on a small
prepared dataset, against the single-process run of the same config; then the PP2 checkpoint resumed by a
single process (layer names are global, so the checkpoint reshards by name) continues exactly like the
uninterrupted single-process run. Constant LR so that runs of different lengths share the schedule. torchrun
forks its workers from a warm agent (tests/torchrun_fork.py); the plain `-m paratrain` worker path stays covered
by test_context_parallel_torchrun.py and test_multinode_netns.py."""

import pytest
from e2e import assert_losses_close, run_single, run_torchrun, train_args

PP_STEPS, TOTAL_STEPS = 4, 6


def _args(tmp_path, tag, steps, **extra):
    return train_args(tmp_path, tag, train__steps=steps, optim__warmup_steps=0, optim__schedule='"constant"',
                      model__layers=4, checkpoint__save_final="true",
                      checkpoint__dir=f'"{tmp_path / tag / "ckpt"}"', **extra)


@pytest.mark.slow
def test_torchrun_pp2_matches_single_process_and_resumes_in_one_process(tmp_path):
    ref = run_single(_args(tmp_path, "single", TOTAL_STEPS))
    got = run_torchrun(2, _args(tmp_path, "pp2", PP_STEPS, parallel__pp=2, parallel__pp_schedule='"1f1b"'), fork=True)
    assert got["layout"] == {"pp": 2, "dp": 1, "cp": 1, "tp": 1} and got["world_size"] == 2
    assert_losses_close(got["losses"], ref["losses"][:PP_STEPS])

    cont = run_single(_args(tmp_path, "resumed", TOTAL_STEPS) + ["--resume-from", got["checkpoint"]])
    assert_losses_close(cont["losses"], ref["losses"][PP_STEPS:])
