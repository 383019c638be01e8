"""Physical invariants of the planner, the cost figures, the simulator and the serving model on scenarios nobody
fitted: every catalog system, dense and MoE presets, explicit layouts and searches. A representative grid (the
wide sweep is benchmarks/plan_invariants_sweep.py, its result in docs/planner.md "Invariants")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from paratrain.cli import main
from paratrain.hardware.catalog import get_catalog
from paratrain.model.config import PRESETS
from paratrain.plan.api import Layout, estimate
from paratrain.plan.moe import expert_params_per_layer
from paratrain.sim.config import SimConfig
from paratrain.sim.engine import simulate
from paratrain.sim.failures import llama3_causes, scale_rates
from paratrain.sim.results import interval, summarize

TRAINING_SYSTEMS = sorted(s for s, v in get_catalog().systems.items() if v.chip.name != "inferentia2")
# bytes of state per parameter with fp32 gradients and an fp32 master copy + Adam moments (the planner's default)
STATE_BYTES = 2 + 4 + 12
# the parts of a step that do not depend on the number of data-parallel replicas at a fixed per-replica batch
PER_REPLICA = ("compute", "tp_comm", "cp_comm", "ep_comm", "head", "bubble", "fp8_cast")


def _system(name):
    return get_catalog().systems[name]


def _scaled_links(system, bw=1.0, latency=1.0):
    """The same system with every tier's bandwidth times bw and its latency times latency (a copied hardware file)."""
    tiers = tuple(replace(t, interconnect=replace(t.interconnect, bw_gbytes_per_s=t.interconnect.bw_gbytes_per_s * bw,
                                                  latency_us=t.interconnect.latency_us * latency))
                  for t in system.tiers)
    return replace(system, tiers=tiers)


def _fits_layout(system, tp):
    return tp <= system.devices_per_node


def test_deepseek_stages_after_the_first_hold_the_expert_state_of_all_their_layers():
    """DeepSeek-V3's first 3 layers are dense, the rest MoE: a pipeline stage after the first holds the routed
    experts of every one of its layers, not the average layer's 58/61 of them (the bookkeeping the invariant
    sweep caught: the planner had counted average layers on every rank)."""
    model = PRESETS["deepseek-v3"]
    lay = Layout(tp=1, pp=4, ep=32, microbatch=1, recompute="full", dp_kind="fsdp", pp_layers=(13, 16, 16, 16))
    nodes, dp = 16, 16 * 8 // 4
    est = estimate(model, "p5en.48xlarge", nodes, 1024, dp * 4, lay)
    per_moe_layer = expert_params_per_layer(model) * model.layers / model.moe_layers
    edp = dp / 32  # tp x cp x dp / (ep x etp): the expert-data-parallel ranks that shard a ZeRO-3 expert
    experts = 16 * per_moe_layer / 32 * 2 / edp  # bf16 weights of the 16 MoE layers of a later stage
    assert est.memory_breakdown_bytes["weights"] >= experts
    assert est.memory_per_device_bytes >= STATE_BYTES * model.num_params() / est.devices


def test_simulator_goodput_in_unit_interval_and_monotone_in_failures_and_checkpoint_cost():
    """Goodput in [0, 1] with a 95% interval that holds its own mean; never higher with more failures nor with a
    dearer checkpoint (same seed: common random numbers)."""
    def goodput(rate, ckpt):
        cfg = SimConfig(devices=16384, step_time_s=5.0, steps=5000, checkpoint_bytes=ckpt,
                        causes=scale_rates(llama3_causes(), rate), samples=20, seed=3)
        return summarize(simulate(cfg))["metrics"]["goodput"]

    by_rate = [goodput(rate, 1e12) for rate in (0.0, 0.5, 2.0, 8.0)]
    by_ckpt = [goodput(1.0, ckpt) for ckpt in (0.0, 1e12, 1e14)]
    for g in by_rate + by_ckpt:
        assert 0.0 <= g["ci95"][0] <= g["mean"] <= g["ci95"][1] <= 1.0, g
    means = [g["mean"] for g in by_rate]
    assert means == sorted(means, reverse=True) and means[-1] < means[0]
    means = [g["mean"] for g in by_ckpt]
    assert means == sorted(means, reverse=True) and means[-1] < means[0]


def test_interval_holds_its_mean_when_every_sample_is_equal():
    """numpy's mean of equal values can round one ulp below them; the interval clipped to the observed range must
    still contain the mean it reports (0.99999000009999 x 100: a failure-free run's goodput)."""
    values = np.full(100, 0.999990000099999)
    assert float(values.mean()) < values[0]  # the rounding this guards against
    out = interval(values)
    assert out["ci95"][0] <= out["mean"] <= out["ci95"][1]


@pytest.mark.parametrize("argv, names", [
    (["estimate", "--seq", "0"], "--seq"),
    (["estimate", "--nodes", "-2"], "--nodes"),
    (["estimate", "--hardware", "no-such-system"], "no-such-system"),
    (["estimate", "--tp", "3"], "pp*cp*tp"),
    (["estimate", "--microbatch", "3"], "microbatch"),
    (["plan", "--global-batch", "0"], "--global-batch"),
    (["plan", "--hardware", "trn2.48xlarge", "--objective", "cost"], "spot $"),
])
def test_bad_input_gets_one_clear_line(capsys, argv, names):
    base = {"--model": "llama2-7b", "--hardware": "p5.48xlarge", "--nodes": "2", "--seq": "4096",
            "--global-batch": "64"}
    given = dict(zip(argv[1::2], argv[2::2], strict=False))
    rest = [x for k, v in base.items() if k not in given for x in (k, v)]
    assert main([argv[0], *rest, *argv[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and names in err[0], err
