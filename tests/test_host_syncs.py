"""A normal training step makes the host wait for the device nowhere, in every layout.

The step the training loop runs (`train.loop.run_step` plus `HostValues`, which copies the step's scalars to the
host asynchronously) is run under `paratrain.device.sync_counter()`, which counts what would make the host wait
for an accelerator: value reads (.item(), float(), bool()), data-dependent shapes, blocking host/device copies
and explicit synchronisations. On these CPU machines nothing actually waits, but the same operations are seen.
The first step is warm-up (FSDP's lazy initialisation, the pipeline's shape inference, stale warm-up); the
next two are counted (one warm-up step is enough in every layout: the second step, once warm-up too, is counted
now). A 2-layer model: every kind of block-level operation runs, at half the cost of 4 layers.
"""

from __future__ import annotations

import pytest
import torch
from parity import global_batch, make_config

from paratrain.device import HostValues, sync_counter, sync_fn
from paratrain.parallel.mesh import init_distributed
from paratrain.train.loop import build_optimizer, build_runner, lr_lambda, run_step
from paratrain.train.profiling import StepTimer

STALE = ['staleness.policy="bounded_staleness"', "staleness.max_staleness=1", 'parallel.dp_kind="ddp"']
LAYOUTS = {
    "ddp": ["parallel.dp=4", 'parallel.dp_kind="ddp"'],
    "fsdp": ["parallel.dp=4"],
    "tp_sp": ["parallel.tp=2", "parallel.sp=true", "parallel.dp=2"],
    "pp": ["parallel.pp=2", "parallel.dp=2", 'parallel.pp_schedule="1f1b"'],
    "cp": ["parallel.cp=2", "parallel.dp=2"],
    "stale": ["parallel.dp=4", *STALE],
}


def _count_syncs(overrides: list[str], warmup: int, steps: int) -> list[list[str]]:
    cfg = make_config(["model.layers=2", *overrides])
    env = init_distributed("cpu")
    runner = build_runner(cfg, env)
    optimizer = build_optimizer(runner, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.train.steps))
    runner.hooks.attach_optimizer(optimizer, scheduler)
    timer = StepTimer(sync=sync_fn(env.device))
    per_rank = cfg.train.global_batch // runner.dp_size
    rows = slice(runner.dp_rank * per_rank, (runner.dp_rank + 1) * per_rank)
    seen, pending = [], None
    for step in range(warmup + steps):
        inputs, targets = (t[rows] for t in global_batch(cfg, step))
        # AdamW's step counters are host tensors on every device (not capturable): reading them waits for nothing
        counter = sync_counter([state["step"] for state in optimizer.state.values() if "step" in state])
        with counter:
            values = HostValues(run_step(runner, optimizer, scheduler, inputs, targets, cfg.optim.grad_clip, timer),
                                env.device)
            timer.take()
        if step >= warmup:
            seen.append(counter.ops)
        if pending is not None:
            assert pending.read()["loss"] > 0  # read one step late, outside the counted step
        pending = values
    runner.hooks.finish()
    return seen


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_normal_step_has_no_host_synchronisation(dist_run, layout):
    for rank, per_step in enumerate(dist_run(4, _count_syncs, LAYOUTS[layout], 1, 2)):
        assert per_step == [[], []], f"{layout}, rank {rank}: the step waits for the device at {per_step}"


def test_the_counter_sees_reads_syncs_and_blocking_copies():
    from paratrain.device import synchronize

    x = torch.randn(4)
    counter = sync_counter()
    with counter:
        float(x.sum())
        bool((x > 0).any())
        x.nonzero()
        synchronize(torch.device("cpu"))
        HostValues({"a": x.sum()}, torch.device("cpu")).read()  # the asynchronous path counts nothing
    assert counter.count == 4, counter.ops
    assert counter.ops[-1] == "synchronize"


def test_batches_reach_the_device_without_a_blocking_copy():
    """to_device: on the host the batch itself; to an accelerator a non-blocking copy from pinned memory (the
    counter would see a blocking one). Tested here with what runs: host to host is no copy at all."""
    from paratrain.device import to_device

    x = torch.arange(6)
    counter = sync_counter()
    with counter:
        assert to_device(x, torch.device("cpu")) is x
    assert counter.count == 0
