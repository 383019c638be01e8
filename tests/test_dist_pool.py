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


def _die_on_rank_one():
    import os
    import signal

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # what a crash in native code (gloo, a kernel) looks like to the pool
    return "fine"


def test_pool_reports_a_dead_rank_at_once_with_its_signal_and_recovers(dist_run):
    """A rank that dies (not raises) is reported with its exit code as soon as the pool sees it (the "died" error,
    not the task timeout's TimeoutError); the pool is rebuilt for the next task. The suite reruns a test once when
    this is its failure (pyproject.toml: --only-rerun), since a native crash inside torch/gloo is not a result of
    the test's code."""
    with pytest.raises(RuntimeError, match=r"pool rank\(s\) died: exit codes \{1: -11\}"):
        dist_run(2, _die_on_rank_one)
    assert dist_run(2, _allreduce_rank) == [(2, 1.0)] * 2
