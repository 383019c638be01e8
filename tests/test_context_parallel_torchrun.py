"""End to end, as users run it: `torchrun --nproc-per-node 2 -m paratrain train --set parallel.cp=2` against the
single-process run of the same config on the same prepared data (loss per step within 1e-5 relative).
The one local torchrun test whose workers start as plain `python -m paratrain` processes, started by torchrun's
agent as it starts them for users (the other torchrun tests fork them from a warm agent, tests/torchrun_fork.py);
the agent itself (torchrun's main, the same arguments) is forked from the session's fork server (~2.4 CPU-s of
imports less). `paratrain launch` in test_multinode_netns.py runs the whole path, agent included, on two hosts."""

import pytest
from e2e import assert_losses_close, run_single, run_torchrun, train_args

# one microbatch of the step's 4 rows (CP splits each sequence over the ranks; accumulation is not what this
# launch tests, and every microbatch costs both ranks their ring exchanges)
CP_RUN = {"train__steps": 3, "train__eval_every": 2, "train__eval_batches": 1, "train__global_batch": 4,
          "train__microbatch": 4}


@pytest.mark.slow  # ~40 s on 2 cores: tokenizer training, a single-process run and a 2-rank torchrun
def test_torchrun_cp2_matches_single_process(tmp_path):
    ref = run_single(train_args(tmp_path, "single", **CP_RUN))
    got = run_torchrun(2, train_args(tmp_path, "cp2", **CP_RUN, parallel__cp=2), fork_agent=True)
    assert got["layout"] == {"pp": 1, "dp": 1, "cp": 2, "tp": 1} and got["world_size"] == 2
    assert len(got["losses"]) == 3
    assert_losses_close(got["losses"], ref["losses"])
