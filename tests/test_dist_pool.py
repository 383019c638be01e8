import pytest
import torch
import torch.distributed as dist


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_world_size(), float(t)


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom")
    return "fine"


@pytest.mark.parametrize("world", [2, 4])
def test_pool_runs_collectives(dist_run, world):
    out = dist_run(world, _allreduce_rank)
    assert out == [(world, sum(range(world)))] * world


def test_pool_reports_rank_errors_and_recovers(dist_run):
    with pytest.raises(RuntimeError, match="rank 1: ValueError: boom"):
        dist_run(2, _fail_on_rank_one)
    assert dist_run(2, _allreduce_rank) == [(2, 1.0)] * 2
