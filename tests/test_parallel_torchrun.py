"""End to end, as users run it: `torchrun --nproc-per-node 4 -m paratrain train` with TP2 x DP2 + SP (and
selective recompute), against the single-process run of the same config on the same prepared data."""

import pytest
from e2e import assert_losses_close, run_single, run_torchrun, train_args


@pytest.mark.slow
def test_torchrun_tp2_dp2_sp_matches_single_process(tmp_path):
    ref = run_single(train_args(tmp_path, "single"))
    got = run_torchrun(4, train_args(tmp_path, "tp2dp2", parallel__tp=2, parallel__dp=2, parallel__sp="true",
                                     parallel__dp_kind='"fsdp"', parallel__recompute='"selective"'))
    assert got["layout"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 2} and got["world_size"] == 4
    assert_losses_close(got["losses"], ref["losses"])
