"""Physical invariants of the planner, the cost figures, the simulator and the serving model on scenarios nobody
fitted: every catalog system, dense and MoE presets, explicit layouts and searches. A representative grid (the
wide sweep is benchmarks/plan_invariants_sweep.py, its result in docs/planner.md "Invariants")."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from paratrain.cli import main
from paratrain.hardware.catalog import get_catalog, write_catalog_file
from paratrain.model.config import PRESETS
from paratrain.plan import serve
from paratrain.plan.api import Layout, estimate, search
from paratrain.plan.moe import expert_params_per_layer
from paratrain.plan.options import Options
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


@pytest.mark.parametrize("name", TRAINING_SYSTEMS)
def test_every_system_reports_bounded_mfu_finite_times_and_honest_memory(name):
    """MFU and HFU in (0, 1], HFU >= MFU; every time finite and >= 0; the worst device holds at least its share of
    the model's state (some rank holds at least the average); `fits` is memory <= the catalog's usable memory,
    itself at most the device's HBM."""
    system = _system(name)
    for model, seq, tp, pp, kind in (("llama2-7b", 4096, 8, 1, "ddp"), ("llama3.1-405b", 8192, 8, 4, "fsdp"),
                                     ("mixtral-8x7b", 32768, 4, 2, "fsdp")):
        if not _fits_layout(system, tp):
            continue
        nodes = 4
        dp = nodes * system.devices_per_node // (tp * pp)
        lay = Layout(tp=tp, pp=pp, sp=True, microbatch=1, recompute="selective", dp_kind=kind,
                     zero_stage=1 if kind == "ddp" else 3)
        est = estimate(model, system, nodes, seq, dp * 4, lay)
        where = f"{name} {model} tp{tp} pp{pp} {kind}"
        assert 0 < est.mfu <= est.hfu <= 1, where
        assert math.isfinite(est.step_time_s) and est.step_time_s > 0, where
        assert all(math.isfinite(v) and v >= 0 for v in est.time_breakdown_s.values()), where
        assert est.memory_per_device_bytes >= STATE_BYTES * PRESETS[model].num_params() / est.devices, where
        assert est.fits == (est.memory_per_device_bytes <= est.memory_capacity_bytes), where
        assert est.memory_capacity_bytes <= system.chip.hbm_bytes / system.devices_per_chip, where
        assert est.tokens_per_s * est.step_time_s == pytest.approx(dp * 4 * seq, rel=1e-9), where


@pytest.mark.parametrize("name", ["trn1.32xlarge", "trn2-ultraserver", "p5.48xlarge", "dgx-b200"])
def test_more_replicas_change_only_data_parallel_traffic_placement_and_optimizer(name):
    """More data-parallel replicas at a fixed per-replica batch: the per-replica work is the same, the sharded
    optimizer step only shrinks, and what the step gains or loses is the DP traffic's exposed part, the pipeline
    sends (stages further apart once the replicas fill a node) and that optimizer step, nothing else."""
    system = _system(name)
    for model, tp, pp, cp, kind, zero in (("llama2-7b", 8, 4, 1, "ddp", 1), ("llama3-70b", 4, 2, 2, "fsdp", 3),
                                          ("mixtral-8x7b", 8, 1, 1, "ddp", 0)):
        prev = None
        for nodes in (1, 2, 8, 64):
            dp = nodes * system.devices_per_node // (tp * pp * cp)
            if dp < 1:
                continue
            lay = Layout(tp=tp, pp=pp, cp=cp, sp=True, microbatch=1, recompute="selective", dp_kind=kind,
                         zero_stage=zero)
            est = estimate(model, system, nodes, 4096, dp * 8, lay)
            if prev is not None:
                a, b = prev.time_breakdown_s, est.time_breakdown_s
                for part in PER_REPLICA:
                    assert b[part] == pytest.approx(a[part], rel=1e-9, abs=1e-12), (name, model, nodes, part)
                assert b["optimizer"] <= a["optimizer"] * (1 + 1e-12)
                explained = sum(b[k] - a[k] for k in ("dp_exposed", "pp_comm", "optimizer"))
                assert est.step_time_s - prev.step_time_s == pytest.approx(explained, rel=1e-6, abs=1e-9)
            prev = est


@pytest.mark.parametrize("name", ["trn1.32xlarge", "trn2.48xlarge", "trn3-ultraserver", "p4d.24xlarge",
                                  "p5en.48xlarge", "grand-teton-h100"])
def test_faster_or_lower_latency_links_never_make_a_step_slower(name):
    """The same system with its links' bandwidth doubled, or their latency halved (a copied hardware file), never
    runs a layout slower, at one node and across nodes, nor makes the search's best slower."""
    system = _system(name)
    fast, quick = _scaled_links(system, bw=2.0), _scaled_links(system, latency=0.5)
    for model, tp, pp, cp, kind in (("llama2-7b", 8, 1, 1, "ddp"), ("llama3-70b", 8, 4, 1, "fsdp"),
                                    ("llama3-70b", 2, 2, 4, "hsdp"), ("mixtral-8x7b", 4, 2, 1, "ddp")):
        for nodes in (1, 16):
            dp = nodes * system.devices_per_node // (tp * pp * cp)
            if dp < 1 or (kind == "hsdp" and dp * cp <= system.devices_per_node // tp):
                continue
            lay = Layout(tp=tp, pp=pp, cp=cp, sp=True, microbatch=1, recompute="selective", dp_kind=kind,
                         zero_stage=0 if kind == "ddp" else 3)
            base = estimate(model, system, nodes, 32768 if cp > 1 else 4096, dp * 4, lay).step_time_s
            for better in (fast, quick):
                assert estimate(model, better, nodes, 32768 if cp > 1 else 4096, dp * 4, lay).step_time_s \
                    <= base * (1 + 1e-12), (name, model, nodes, tp, pp, cp, kind)
    best = search("llama3-70b", system, 8, 4096, 256, top=1, max_microbatch=2).candidates[0].step_time_s
    assert search("llama3-70b", fast, 8, 4096, 256, top=1, max_microbatch=2).candidates[0].step_time_s <= best


@pytest.mark.parametrize("name", ["trn1n.32xlarge", "trn2-ultraserver", "p4de.24xlarge", "p6-b200.48xlarge"])
def test_more_recompute_is_never_faster_nor_larger(name):
    system = _system(name)
    for model, tp, pp, kind in (("llama3-8b", 4, 1, "fsdp"), ("llama3-70b", 8, 4, "ddp"), ("qwen3-30b-a3b", 2, 2, "fsdp")):
        dp = 2 * system.devices_per_node // (tp * pp)
        if dp < 1:
            continue
        runs = [estimate(model, system, 2, 8192, dp * 4, Layout(tp=tp, pp=pp, sp=True, microbatch=1, recompute=rc,
                                                                dp_kind=kind))
                for rc in ("none", "selective", "full")]
        times = [r.step_time_s for r in runs]
        memory = [r.memory_per_device_bytes for r in runs]
        assert times == sorted(times) and memory == sorted(memory, reverse=True), (name, model, times, memory)


@pytest.mark.parametrize("name", [n for n in TRAINING_SYSTEMS
                                  if (c := get_catalog().systems[n].chip).fp8_tflops
                                  and c.fp8_tflops > 1.01 * c.bf16_tflops])
def test_fp8_is_faster_where_the_chip_has_an_fp8_peak(name):
    """On a chip whose FP8 peak exceeds its BF16 peak the step is faster in FP8 once the GEMMs are large (70B, TP 8,
    8k tokens, the cast weight kept across microbatches as Transformer Engine keeps it). With small GEMMs (7B at
    TP 8, microbatch 1) the per-tensor amax + cast of every input can cost more than the matmuls gain, as
    torchao's float8 benchmarks show for small shapes: not asserted (docs/planner.md "Invariants")."""
    system = _system(name)
    opts = Options.for_system(system, stack="megatron")
    lay = Layout(tp=8, pp=4, sp=True, microbatch=1, recompute="selective", dp_kind="ddp", zero_stage=1)
    dp = 8 * system.devices_per_node // 32
    bf16, fp8 = (estimate("llama3-70b", system, 8, 8192, dp * 8, lay, options=replace(opts, fp8=f)) for f in (0, 1))
    assert fp8.step_time_s < bf16.step_time_s, name
    # the activations kept in FP8 are smaller (the cached FP8 weight copies add memory: not compared)
    assert 0 < fp8.mfu <= 1
    assert fp8.memory_breakdown_bytes["activations"] < bf16.memory_breakdown_bytes["activations"]


def test_plan_candidates_are_what_estimate_says_and_cost_is_time_x_price_x_nodes():
    """`plan`'s ranked layouts, re-estimated one by one, give the same step time and memory; they fit; the cost per
    hour is nodes x the catalog's price, cost per million tokens and per run follow from the throughput."""
    for name, model, nodes, seq in (("trn1.32xlarge", "llama2-13b", 16, 4096), ("p5.48xlarge", "mixtral-8x7b", 8, 8192),
                                    ("p4d.24xlarge", "llama3.2-3b", 2, 32768)):
        system = _system(name)
        res = search(model, system, nodes, seq, 256, top=3, train_tokens=1e11)
        assert res.candidates, name
        price = system.prices.on_demand_usd_per_hour
        for c in res.candidates:
            assert c.fits and c.memory_per_device_bytes <= c.memory_capacity_bytes
            again = estimate(model, system, nodes, seq, 256, c.layout)
            assert again.step_time_s == pytest.approx(c.step_time_s, rel=1e-9)
            assert again.memory_per_device_bytes == pytest.approx(c.memory_per_device_bytes, rel=1e-9)
            assert c.cost_usd_per_hour == pytest.approx(nodes * price, rel=1e-12)
            assert c.cost_usd_per_million_tokens == pytest.approx(c.cost_usd_per_hour / 3600 / c.tokens_per_s * 1e6)
            assert c.cost_usd_per_run == pytest.approx(c.cost_usd_per_hour * c.time_to_train_s / 3600)
            assert c.time_to_train_s == pytest.approx(1e11 / c.tokens_per_s)


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


@pytest.mark.parametrize("name", ["inf2.48xlarge", "trn2.48xlarge", "p5.48xlarge", "p6-b200.48xlarge"])
def test_serving_latency_never_falls_with_a_longer_prompt(name):
    system = _system(name)
    for model, tp, weights in (("llama3-8b", 2, "bf16"), ("llama3-70b", 8, "fp8"), ("mixtral-8x7b", 8, "bf16")):
        if tp > system.devices_per_node:
            continue
        rep = serve.Replica(tp=tp, weights=weights)
        runs = [serve.estimate(model, system, rep, 8, prompt, 128) for prompt in (16, 512, 2048, 8192, 32768)]
        for key in ("ttft_s", "itl_s", "prefill_s", "decode_step_s"):
            values = [getattr(r, key) for r in runs]
            assert all(math.isfinite(v) and v > 0 for v in values)
            assert values == sorted(values), (name, model, key, values)


def test_json_is_pure_json_without_nan_for_a_system_without_price(capsys):
    """--json prints one JSON document, no NaN/Infinity (not JSON), null where there is no price."""
    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))

    argv = ["--model", "llama3-70b", "--hardware", "trn2-ultraserver", "--nodes", "2", "--seq", "8192",
            "--global-batch", "64", "--json"]
    assert main(["estimate", *argv, "--tp", "8", "--pp", "4", "--sp", "--microbatch", "1"]) == 0
    est = strict(capsys.readouterr().out)
    assert est["cost_usd_per_hour"] is None and est["step_time_s"] > 0
    assert main(["plan", *argv, "--top", "2"]) == 0
    assert strict(capsys.readouterr().out)["best"]["fits"] is True


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


def test_selective_recompute_holds_one_layers_replayed_scores_with_unfused_attention():
    """Selective recompute replays the attention core in backward: with unfused attention (NxD on Trn1) that layer's
    s x s scores are held again, so at long sequences selective needs more memory than full recompute's one
    rebuilt block only by what it keeps per layer, and never less than the scores of that one layer (found by the
    invariant sweep: at 131k tokens full recompute reported 114 GiB, selective 53 GiB without them)."""
    model, seq = PRESETS["llama3.2-3b"], 131072
    runs = {rc: estimate(model, "trn1.32xlarge", 8, seq, 64, Layout(tp=8, sp=True, microbatch=1, recompute=rc,
                                                                     dp_kind="ddp", zero_stage=1))
            for rc in ("none", "selective", "full")}
    memory = [runs[rc].memory_per_device_bytes for rc in ("none", "selective", "full")]
    assert memory == sorted(memory, reverse=True)
    scores = seq * 2 * model.heads * seq / 8  # one layer's bf16 softmax output on a TP 8 rank
    assert runs["selective"].memory_breakdown_bytes["activations"] >= scores


def test_a_faster_chip_never_makes_a_moe_fsdp_step_slower():
    """The routed experts' FSDP traffic hides in what the dense part's traffic leaves of the compute window: the
    dense traffic that is exposed (after the compute) does not occupy that window. Counting the dense part's whole
    time against it made DeepSeek-V3 under FSDP on 8 p4de nodes 0.2 s slower with a chip twice as fast (the
    invariant sweep's 'chip x2 peak: never slower')."""
    system = _system("p4de.24xlarge")
    chip = system.chip
    fast = replace(system, chip=replace(chip, bf16_tflops=2 * chip.bf16_tflops))
    for lay in (Layout(tp=1, microbatch=1, dp_kind="fsdp", zero_stage=3),
                Layout(tp=1, ep=8, microbatch=1, dp_kind="fsdp", zero_stage=3)):
        base, quick = (estimate("deepseek-v3", s, 8, 2048, 512, lay) for s in (system, fast))
        assert quick.step_time_s <= base.step_time_s, lay
        assert quick.time_breakdown_s["dp_exposed"] - base.time_breakdown_s["dp_exposed"] \
            <= (base.time_breakdown_s["compute"] + base.time_breakdown_s["head"]
                - quick.time_breakdown_s["compute"] - quick.time_breakdown_s["head"])


def test_no_fitting_layout_beats_the_search():
    """Random valid layouts (tp, pp, microbatch, ZeRO/FSDP, schedule, chunks, SP, recompute) that fit, estimated one
    by one with the same timing options, are never faster than `plan`'s best: the search misses none."""
    from benchmarks.plan_invariants_sweep import random_layout

    rng = random.Random(0)
    for name, model, nodes in (("trn2.48xlarge", "llama3-70b", 8), ("dgx-b200", "mixtral-8x7b", 4)):
        system = _system(name)
        opts = Options.for_system(system, system_stack=False)
        best = search(model, system, nodes, 4096, 256, top=1, options=opts, any_stack=True).candidates[0]
        devices, tried = nodes * system.devices_per_node, 0
        while tried < 25:
            lay = random_layout(rng, devices, [1, 2, 4, 8, 16], [1, 2, 3, 4, 8], [2])
            if lay is None:
                continue
            try:
                est = estimate(model, system, nodes, 4096, 256, lay, options=opts)
            except ValueError:
                continue
            if est.fits:
                tried += 1
                assert est.step_time_s >= best.step_time_s * (1 - 1e-9), (name, lay, best.layout)


def test_a_copied_hardware_file_with_faster_links_plans_no_slower(tmp_path, capsys):
    """The user's way to try a faster network: copy the system into a hardware file with every link twice as fast
    (catalog.write_catalog_file, `--hardware FILE`); `plan`'s best is then never slower."""
    system = _system("trn1.32xlarge")
    links = [replace(t.interconnect, name=f"{t.interconnect.name}-x2", bw_gbytes_per_s=2 * t.interconnect.bw_gbytes_per_s)
             for t in system.tiers]
    fast = replace(system, name="trn1-x2", tiers=tuple(replace(t, interconnect=lk) for t, lk in zip(system.tiers, links,
                                                                                                      strict=True)))
    path = write_catalog_file(tmp_path / "trn1-x2.toml", interconnects=links, systems=[fast])
    best = {}
    for hardware in ("trn1.32xlarge", str(path)):
        assert main(["plan", "--model", "llama3-70b", "--hardware", hardware, "--nodes", "16", "--seq", "8192",
                     "--global-batch", "256", "--top", "1", "--json"]) == 0
        best[hardware] = json.loads(capsys.readouterr().out)["best"]["step_time_s"]
    assert best[str(path)] <= best["trn1.32xlarge"]
