"""Router metrics (model/moe.py `moe_metrics`) describe the global batch of a step: every microbatch, summed over
the ranks that see other tokens (dp, ep among them) and the pipeline stages that hold other layers
(`Runner.reduce_layer_sums`), not rank 0's share. Each layout's ranks train on different rows of one global batch;
the logged numbers must equal the single process's on the whole batch (same microbatches, so the routing is the
same: counts exactly, entropy within 1e-6 relative).
"""

from __future__ import annotations

import pytest

MOE = ['model.preset="tiny-moe"', "model.layers=3", "model.aux_loss_coef=0.1", "model.capacity_factor=1.0"]
# EP2 x FSDP on 2 ranks, with full recomputation (a recomputed forward must not count its tokens again);
# PP2 x EP2 on 4 ranks (layer 1 on stage 0, layer 2 on stage 1: the stages' slots are summed over pp)
LAYOUTS = [(2, ['parallel.ep=2', 'parallel.dp_kind="fsdp"', 'parallel.recompute="full"']),
           (4, ['parallel.ep=2', 'parallel.pp=2', 'parallel.dp_kind="ddp"']),
           # etp=1 x TP2 x SP: each tp rank routes half of every sequence (its statistics summed over tp)
           (4, ['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=1', 'parallel.sp=true', 'parallel.dp_kind="ddp"'])]


def _step_metrics(overrides: list[str], world: int) -> tuple[dict, dict]:
    """One forward/backward of this rank's rows; (metrics over all ranks, this rank's own metrics)."""
    import torch.utils.checkpoint
    from parity import global_batch, make_config

    from paratrain.model.moe import moe_metrics, reset_router_stats
    from paratrain.parallel.mesh import DistEnv, init_distributed
    from paratrain.train.loop import build_runner

    cfg = make_config(overrides)
    if world == 1:
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        cfg = cfg.model_copy(update={"parallel": type(cfg.parallel)()})
    else:
        env = init_distributed("cpu")
    runner = build_runner(cfg, env)
    x, y = global_batch(cfg, 0)
    rows = cfg.train.global_batch // runner.dp_size
    sl = slice(runner.dp_rank * rows, (runner.dp_rank + 1) * rows)
    reset_router_stats(runner.parts)
    # without early stop the recompute replays the whole block, router statistics included (torch stops once
    # the saved tensors are back, before them: the guard in MoE.record_routing would go untested)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        runner.forward_backward(x[sl], y[sl])
    return (moe_metrics(runner.parts, cfg.model_shape(), runner.reduce_layer_sums),
            moe_metrics(runner.parts, cfg.model_shape()))


def _check(got: dict, want: dict) -> None:
    assert got["moe_tokens_per_expert"] == want["moe_tokens_per_expert"]
    assert got["moe_dropped_tokens"] == want["moe_dropped_tokens"] > 0  # capacity 1.0 drops on these batches
    assert got["moe_load_imbalance"] == want["moe_load_imbalance"]
    assert got["moe_router_entropy"] == pytest.approx(want["moe_router_entropy"], rel=1e-6)


@pytest.mark.parametrize("world, layout", LAYOUTS, ids=["ep2_fsdp_recompute", "pp2_ep2", "ep2_tp2_etp1_sp"])
def test_router_metrics_describe_the_global_batch(dist_run, world, layout):
    want, _ = _step_metrics(MOE, 1)
    # every assignment of the step's 8 rows x 32 tokens x top 2, in the two MoE layers, kept or dropped
    assert sum(want["moe_tokens_per_expert"]) + want["moe_dropped_tokens"] == 8 * 32 * 2 * 2
    per_rank = dist_run(world, _step_metrics, MOE + layout, world)
    for got, own in per_rank:
        _check(got, want)
        # not vacuous: a rank alone saw a share of the tokens (or of the layers)
        assert sum(own["moe_tokens_per_expert"]) < sum(want["moe_tokens_per_expert"])


def test_router_metrics_of_one_routing_add_up():
    """router_metrics (one routing) and the additive RouterStats agree: two forwards count twice."""
    import torch

    from paratrain.model.config import ModelConfig
    from paratrain.model.moe import MoE, metrics_of, router_metrics

    torch.manual_seed(0)
    block = MoE(ModelConfig(layers=1, hidden=16, heads=2, vocab=32, num_experts=4, experts_per_token=2,
                            moe_ffn_hidden=8, capacity_factor=1.0))
    x = torch.randn(2, 10, 16)
    block(x)
    one = router_metrics(block.last_routing, 4)
    block(x)
    two = metrics_of(block.router_stats.counts.tolist(), float(block.router_stats.entropy_sum))
    assert two["tokens_per_expert"] == [2 * c for c in one["tokens_per_expert"]]
    assert two["dropped_tokens"] == 2 * one["dropped_tokens"] > 0
    assert two["router_entropy"] == pytest.approx(one["router_entropy"], rel=1e-6)


def _train_ep2(sets: list[str]) -> tuple[dict, str]:
    import contextlib
    import io

    from paratrain.config import load_config
    from paratrain.train.loop import train

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        summary = train(load_config(None, sets))
    return summary, err.getvalue()


def test_an_expert_parallel_run_reports_its_layout_and_the_global_router_counts(dist_run, tmp_path):
    """`paratrain train`'s loop under EP2 x FSDP on 2 ranks: the summary, the checkpoint manifest and the start-up
    banner carry ep, etp and edp beside pp/dp/cp/tp; metrics.jsonl counts every assignment of the global batch
    (4 rows x 32 tokens x top 2 in the one MoE layer), not rank 0's half."""
    import json

    sets = ['model.preset="tiny-moe"', "model.layers=2", "model.vocab=320", "data.vocab_size=300",
            "data.max_source_bytes=60000", f'data.prepared_dir="{tmp_path / "data"}"', "train.steps=2",
            "train.log_every=1", "train.global_batch=4", "train.microbatch=2", "train.seq_len=32",
            "train.progress=false", 'train.device="cpu"', "metrics.tensorboard=false",
            f'metrics.run_dir="{tmp_path / "run"}"', "parallel.ep=2", 'parallel.dp_kind="fsdp"']
    (summary, log), _ = dist_run(2, _train_ep2, sets)
    layout = {"pp": 1, "dp": 2, "cp": 1, "tp": 1, "ep": 2, "etp": 1, "edp": 1}
    assert summary["layout"] == layout
    assert "layout      dp 2 x ep 2 on 2 rank(s)" in log and "rank 0: dp0 ep0, rank 1: dp1 ep1" in log, log
    manifest = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/MANIFEST.json")).read_text())
    assert manifest["layout"] == layout
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert sum(r["moe_tokens_per_expert"]) + r["moe_dropped_tokens"] == 4 * 32 * 2
