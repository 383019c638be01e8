"""`paratrain estimate` / `paratrain plan`: interfaces, JSON, config writing, errors, and the headline result."""

from __future__ import annotations

import dataclasses
import json
import tomllib

import pytest

from paratrain.cli import main
from paratrain.hardware.catalog import resolve_system
from paratrain.plan.api import Layout, estimate, search
from paratrain.plan.software import Software, software_options

SEVEN_B = ["--model", "llama2-7b", "--hardware", "trn1.32xlarge", "--nodes", "128", "--seq", "4096",
           "--global-batch", "1024"]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_trn1_7b_best_plan_is_tp8_pp1_sp_dp512(capsys):
    """The source documents' result, from the search (no special case): TP 8, PP 1, SP on, DP 512."""
    data = _json(capsys, ["plan", *SEVEN_B, "--top", "5", "--json"])
    best = data["best"]["layout"]
    assert (best["tp"], best["pp"], best["sp"], best["dp"]) == (8, 1, True, 512)
    assert data["best"]["devices"] == 4096 and len(data["candidates"]) == 5
    times = [c["step_time_s"] for c in data["candidates"]]
    assert times == sorted(times)
    assert data["search"]["evaluated"] > 100


def test_trn1_7b_result_holds_across_global_batches():
    for gbs in (512, 2048, 4096):
        best = search("llama2-7b", "trn1.32xlarge", 128, 4096, gbs, top=1).candidates[0].layout
        assert (best.tp, best.pp, best.sp) == (8, 1, True), gbs


@pytest.mark.parametrize("usable", [0.5, 0.6, 0.7, 0.8])
def test_trn1_7b_result_is_not_tuned_to_the_memory_fraction(usable):
    """The headline does not hinge on Trn1's usable-memory fraction (0.5, an inference from one NxDT config):
    anywhere from 0.5 to 0.8 the planner still ranks TP 8, PP 1, SP, DP 512 first."""
    base = resolve_system("trn1.32xlarge")
    system = dataclasses.replace(base, efficiency=dataclasses.replace(base.efficiency, memory_usable_fraction=usable))
    best = search("llama2-7b", system, 128, 4096, 1024, top=1).candidates[0].layout
    assert (best.tp, best.pp, best.sp, best.dp) == (8, 1, True, 512)


def test_estimate_json_fields(capsys):
    data = _json(capsys, ["estimate", *SEVEN_B, "--tp", "8", "--pp", "1", "--sp", "--recompute", "selective",
                          "--microbatch", "1", "--json"])
    for key in ("step_time_s", "tokens_per_s", "mfu", "hfu", "memory_per_device_bytes", "cost_usd_per_hour"):
        assert isinstance(data[key], float), key
    assert {"tp", "pp", "dp", "sp", "microbatch", "recompute", "pp_schedule"} <= set(data["layout"])
    assert data["layout"]["dp"] == 512
    assert data["cost_usd_per_hour"] == pytest.approx(128 * 21.50)
    assert data["tokens_per_s"] == pytest.approx(1024 * 4096 / data["step_time_s"])
    assert set(data["memory_breakdown_bytes"]) == {"weights", "grads", "optimizer", "activations"}


def test_estimate_text_output(capsys):
    assert main(["estimate", *SEVEN_B, "--tp", "8", "--sp", "--microbatch", "1"]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "memory/device" in out


def test_plan_table_of_a_moe_model_shows_ep_and_etp(capsys):
    """A MoE search varies ep and etp: the table has their columns (else two rows can read the same), and each
    row's values are the candidate's; a dense model's table has none."""
    assert main(["plan", "--model", "tiny-moe", "--hardware", "dgx-h100", "--nodes", "1", "--seq", "512",
                 "--global-batch", "64", "--top", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[1].split()
    assert head[7:9] == ["ep", "etp"]
    rows = [line.split() for line in lines[2:22]]
    best = search("tiny-moe", "dgx-h100", 1, 512, 64, top=20).candidates
    assert [(int(r[7]), int(r[8])) for r in rows] == [(c.layout.ep, c.layout.etp) for c in best]
    assert len({tuple(r[1:-3]) for r in rows}) == len(rows)  # every row's layout reads differently
    assert main(["plan", *SEVEN_B, "--top", "3"]) == 0
    assert "ep" not in capsys.readouterr().out.splitlines()[1].split()


def test_write_config_round_trips(tmp_path, capsys):
    path = tmp_path / "planned.toml"
    assert main(["plan", *SEVEN_B, "--top", "1", "--write-config", str(path)]) == 0
    capsys.readouterr()
    cfg = tomllib.loads(path.read_text())
    assert cfg["model"]["preset"] == "llama2-7b"
    assert cfg["parallel"]["tp"] == 8 and cfg["parallel"]["pp"] == 1 and cfg["parallel"]["sp"] is True
    assert cfg["parallel"]["pp_schedule"] in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
    assert cfg["train"] == {"seq_len": 4096, "global_batch": 1024, "microbatch": cfg["train"]["microbatch"]}
    from paratrain.config import load_config

    loaded = load_config(path)
    assert loaded.parallel.tp == 8 and loaded.train.seq_len == 4096
    assert "Timed as" not in path.read_text()  # the system's own timing: no other stack named


def test_write_config_of_a_plan_timed_as_another_stack_says_so(tmp_path, capsys):
    """plan --stack fsdp2 times torchtitan's kernels and per-op recompute; the config it writes is trained by
    paratrain's runtime, so its header names the stack the prediction is for."""
    path = tmp_path / "planned.toml"
    assert main(["plan", "--model", "llama3-8b", "--hardware", "p5.48xlarge", "--nodes", "2", "--seq", "8192",
                 "--global-batch", "64", "--stack", "fsdp2", "--top", "1", "--write-config", str(path)]) == 0
    capsys.readouterr()
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any("Timed as the fsdp2 stack" in line for line in header), header


def test_model_toml_file(tmp_path, capsys):
    path = tmp_path / "m.toml"
    path.write_text('arch = "gpt"\nlayers = 24\nhidden = 2048\nheads = 16\nvocab = 51200\nmax_seq = 2048\n')
    data = _json(capsys, ["estimate", "--model", str(path), "--hardware", "p4d.24xlarge", "--nodes", "2",
                          "--seq", "2048", "--global-batch", "32", "--tp", "2", "--json"])
    assert data["model"] == "m" and data["layout"]["dp"] == 8


@pytest.mark.parametrize("argv,expect", [
    (["--tp", "3"], "world size 4096 is not a multiple of pp*cp*tp = 1*1*3 = 3"),
    (["--tp", "8", "--dp", "7"], "world size 4096 != pp*dp*cp*tp = 1*7*1*8"),
    (["--tp", "8", "--microbatch", "3"], "train.microbatch=3 must divide the per-rank batch global_batch/dp = 2"),
    (["--tp", "1", "--sp"], "parallel.sp=true needs parallel.tp > 1"),
    (["--tp", "8", "--pp", "2", "--pp-schedule", "zbv", "--virtual-stages", "4"], "parallel.virtual_stages=4 with parallel.pp_schedule='zbv': the V schedules place exactly 2"),
    (["--tp", "8", "--virtual-stages", "0"], "--virtual-stages = 0: must be >= 1"),
    (["--tp", "8", "--train-tokens", "-3"], "--train-tokens = -3.0: must be > 0"),
])
def test_bad_layouts_fail_with_one_line(capsys, argv, expect):
    assert main(["estimate", *SEVEN_B, *argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,expect", [
    (["--top", "0"], "--top = 0: must be >= 1"),
    (["--max-microbatch", "0"], "--max-microbatch = 0: must be >= 1"),
    (["--train-tokens", "2e12", "--max-days", "-1"], "--max-days = -1.0: must be > 0"),
    (["--max-days", "30"], "--max-days needs --train-tokens"),
])
def test_bad_plan_flags_fail_with_one_line(capsys, argv, expect):
    assert main(["plan", *SEVEN_B, *argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1


def test_unknown_hardware_and_model(capsys):
    assert main(["plan", "--model", "llama2-7b", "--hardware", "trn9", "--nodes", "1", "--seq", "4096",
                 "--global-batch", "8"]) == 2
    assert "unknown system" in capsys.readouterr().err
    assert main(["plan", "--model", "nope", "--hardware", "p5.48xlarge", "--nodes", "1", "--seq", "4096",
                 "--global-batch", "8"]) == 2
    assert "not a preset" in capsys.readouterr().err


def test_cost_objective_prefers_cheaper_tokens():
    by_time = search("llama2-7b", "p4d.24xlarge", 64, 4096, 1024, top=1).candidates[0]
    by_cost = search("llama2-7b", "p4d.24xlarge", 64, 4096, 1024, top=1, objective="cost").candidates[0]
    assert by_cost.cost_usd_per_million_tokens <= by_time.cost_usd_per_million_tokens
    capped = search("llama2-7b", "p4d.24xlarge", 64, 4096, 1024, top=1, objective="cost", train_tokens=2e12,
                    max_time_s=30 * 86400).candidates[0]
    assert capped.time_to_train_s <= 30 * 86400 and capped.cost_usd_per_run > 0


def test_search_respects_stack_and_constraints():
    res = search("llama2-7b", "trn1.32xlarge", 16, 4096, 1024, top=50)
    assert all(c.layout.dp_kind == "ddp" and c.layout.zero_stage in (0, 1) for c in res.candidates)
    res = search("llama2-7b", "p5.48xlarge", 8, 4096, 256, top=20, constraints={"tp": [4], "recompute": ["full"]})
    assert res.candidates and all(c.layout.tp == 4 and c.layout.recompute == "full" for c in res.candidates)


def test_search_ranks_what_estimate_computes():
    best = search("llama3-8b", "p5.48xlarge", 4, 8192, 128, top=1).candidates[0]
    again = estimate("llama3-8b", "p5.48xlarge", 4, 8192, 128, best.layout)
    assert again.step_time_s == pytest.approx(best.step_time_s)
    assert again.memory_per_device_bytes == pytest.approx(best.memory_per_device_bytes)


def test_layout_not_fitting_is_reported():
    est = estimate("llama2-70b", "p4d.24xlarge", 1, 4096, 8, Layout(tp=8))
    assert not est.fits and "does not fit" in est.notes[0]


def test_plan_without_any_fitting_layout_says_why(capsys):
    assert main(["plan", "--model", "llama3.1-405b", "--hardware", "p4d.24xlarge", "--nodes", "1", "--seq", "8192",
                 "--global-batch", "8"]) == 2
    assert "fits in memory" in capsys.readouterr().err
    # 4,608 devices, at most tp 32 x pp 32 without data parallelism, and a global batch of 7 leaves dp 1 or 7
    assert main(["plan", "--model", "llama2-7b", "--hardware", "trn3-ultraserver", "--nodes", "8", "--seq", "4096",
                 "--global-batch", "7"]) == 2
    assert "no valid layout" in capsys.readouterr().err


# ---- NeuronX Distributed's shipped layouts under `plan --stack nxd` ---------------------------------------
NXD_SHIPPED = [  # aws-neuron/neuronx-distributed-training examples/conf: model, system, nodes, seq, gbs, tp, pp
    ("llama3-70b", "trn1.32xlarge", 16, 8192, 1024, 32, 8),      # hf_llama3_70B_config.yaml
    ("llama3.1-405b", "trn1.32xlarge", 64, 8192, 256, 32, 32),   # hf_llama3.1_405B_trn1_config.yaml
    ("llama3-70b", "trn2.48xlarge", 8, 8192, 1024, 32, 4),        # hf_llama3_70B_trn2_config.yaml
]


@pytest.fixture(scope="module")
def nxd_searches():
    from paratrain.plan.api import search

    return {case: search(*case[:5], top=10**6, stack="nxd") for case in NXD_SHIPPED}


@pytest.mark.parametrize("case", NXD_SHIPPED, ids=lambda c: f"{c[0]}-{c[1]}-tp{c[5]}-pp{c[6]}")
def test_nxd_shipped_layouts_are_found_and_fit(nxd_searches, case):
    res = nxd_searches[case]
    assert all(c.layout.dp_kind == "ddp" and c.layout.zero_stage in (0, 1) for c in res.candidates)  # NxD: ZeRO-1
    shipped = [c for c in res.candidates if (c.layout.tp, c.layout.pp) == case[5:]]
    assert shipped and shipped[0].fits


@pytest.mark.parametrize("case", NXD_SHIPPED, ids=lambda c: f"{c[0]}-{c[1]}")
def test_nxd_shipped_layouts_rank_within_5_percent_of_the_best(nxd_searches, case):
    """Under NxD's own rules: TP collectives on the NeuronLink torus (a TP group on fewer chips than the whole
    torus drives half its links), the backward's TP collectives beside the GEMMs that do not need them
    (LinearWithAsyncCommunication), and selective recompute with or without the MLP block (NxDT's
    activations_checkpoint_recompute_mlp, which the shipped Llama 3 70B config uses)."""
    res = nxd_searches[case]
    shipped = [c for c in res.candidates if (c.layout.tp, c.layout.pp) == case[5:]][0]
    assert shipped.step_time_s <= 1.05 * res.candidates[0].step_time_s


def test_nxd_trn2_8b_shipped_layout_fits():
    """NxDT's hf_llama3_8B_trn2_config.yaml: Llama 3 8B on one trn2.48xlarge, TP16 PP1, SP, ZeRO-1, no activation
    checkpointing, seq 8192, mb 1, gbs 1024 must fit Trn2's usable memory (a lower bound on its fraction, with the
    70B trn2 config's; docs/planner.md, acctrn2). Its rank is not asserted: the search puts TP8 PP2 17% ahead."""
    from paratrain.plan.api import Layout, estimate

    lay = Layout(tp=16, pp=1, sp=True, dp_kind="ddp", zero_stage=1, microbatch=1, recompute="none")
    est = estimate("llama3-8b", "trn2.48xlarge", 1, 8192, 1024, lay, stack="nxd")
    assert est.fits


NXD_8B_SHIPPED = [  # model, system, nodes, seq, gbs, tp, pp, recompute: NxDT examples/conf (2.26) and NxD's script
    ("llama3-8b", "trn1.32xlarge", 4, 8192, 1024, 32, 1, "selective"),   # hf_llama3_8B_config.yaml
    ("llama3-8b", "trn1.32xlarge", 32, 8192, 1024, 32, 1, "selective"),  # hf_llama3.1_8B_config.yaml, tp_zero1_llama31_8B
    ("llama3-8b", "trn2.48xlarge", 1, 8192, 1024, 16, 1, "none"),        # hf_llama3_8B_trn2_config.yaml
]


@pytest.fixture(scope="module")
def nxd_8b_searches():
    return {case: search(*case[:5], top=10**6, stack="nxd") for case in NXD_8B_SHIPPED}


def _as_shipped(res, case):
    return [c for c in res.candidates if (c.layout.tp, c.layout.pp, c.layout.recompute, c.layout.microbatch)
            == (*case[5:7], case[7], 1) and not c.recompute_mlp]


@pytest.mark.parametrize("case", NXD_8B_SHIPPED, ids=lambda c: f"{c[1]}-{c[2]}n-tp{c[5]}")
def test_nxd_8b_shipped_layouts_are_found_and_fit(nxd_8b_searches, case):
    """AWS's Llama 3 / 3.1 8B layouts (TP32 on trn1, TP16 on trn2, PP1, SP, ZeRO-1, mb 1, kv_replicator 4 / 2) are
    in the nxd search and fit. Their rank is not asserted: see the next test and docs/planner.md (acc8b)."""
    shipped = _as_shipped(nxd_8b_searches[case], case)
    assert shipped and all(c.fits for c in shipped)


def _measured_mfu(rows):
    """Each NxD calibration row's model-FLOP rate as measured: the planner's MFU for the row's layout scaled by
    predicted / measured step time (the same FLOP count on both sides)."""
    from paratrain.plan.options import Options

    out = []
    for r in rows:
        lay = Layout(tp=int(r["tp"]), pp=1, sp=True, dp_kind="ddp", zero_stage=1, microbatch=1, recompute=r["recompute"])
        system = resolve_system(r["system"])
        opts = Options.for_system(system, stack="nxd", attention=r["attention"])
        est = estimate(r["model"], system, int(r["nodes"]), int(r["seq"]), int(r["global_batch"]), lay, opts)
        out.append(est.mfu * est.step_time_s / (int(r["global_batch"]) / float(r["measured"])))
    return sum(out) / len(out)


def test_nxd_8b_planners_tp8_lead_stays_below_what_aws_measured_on_trn1(nxd_8b_searches):
    """Why the search may rank AWS's 8B TP32 layout far behind its best (a TP 8 layout): AWS's own trn1 tables
    (benchmarks/data/calibration_runs.csv, set neuron_trn1_nxd) show NxD's TP 8 run (Llama 2 7B, flash, SDK
    2.20-2.21) reaching about 1.7x (1.5-2.0x row by row) the model-FLOP rate of its TP 32 runs (Llama 3.1 8B, SDK 2.20-2.24). The planner's
    lead of its best 8B layout over the layout as shipped must not claim more than that measured ratio."""
    import csv
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "calibration_runs.csv"
    rows = [r for r in csv.DictReader(path.open()) if r["set"] == "neuron_trn1_nxd"]
    tp8 = _measured_mfu([r for r in rows if r["tp"] == "8" and r["attention"] == "flash"])
    tp32 = _measured_mfu([r for r in rows if r["tp"] == "32"])
    assert tp8 > 1.4 * tp32  # the data: 0.35 against 0.21
    for case in NXD_8B_SHIPPED[:2]:
        res = nxd_8b_searches[case]
        shipped = min(c.step_time_s for c in _as_shipped(res, case))
        assert res.candidates[0].step_time_s < shipped <= (tp8 / tp32) * res.candidates[0].step_time_s


def test_nxd_search_times_selective_recompute_with_and_without_the_mlp(nxd_searches):
    from paratrain.plan.api import estimate
    from paratrain.plan.options import Options

    res = nxd_searches[NXD_SHIPPED[0]]
    flagged = [c for c in res.candidates if c.recompute_mlp]
    assert flagged and all(c.layout.recompute == "selective" for c in flagged)
    c = flagged[0]
    system = resolve_system("trn1.32xlarge")
    again = estimate(*NXD_SHIPPED[0][:5], c.layout, Options.for_system(system, stack="nxd", recompute_mlp=True))
    assert again.recompute_mlp and again.step_time_s == pytest.approx(c.step_time_s, rel=1e-9)
    plain = estimate(*NXD_SHIPPED[0][:5], c.layout, stack="nxd")
    assert not plain.recompute_mlp and plain.step_time_s < c.step_time_s  # replaying the MLP costs time
    assert plain.memory_per_device_bytes > c.memory_per_device_bytes  # and saves its gate/up outputs
    from paratrain.model.config import load_model_config
    from paratrain.plan.config_writer import training_config

    with pytest.raises(ValueError, match="activations_checkpoint_recompute_mlp"):  # the runtime cannot run it
        training_config(c, load_model_config("llama3-70b"), "llama3-70b", system.devices_per_node)


def test_stack_flag_restricts_the_search_and_sets_how_it_runs(capsys):
    assert main(["plan", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "4", "--seq", "4096",
                 "--global-batch", "256", "--stack", "nxd", "--top", "50", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {c["layout"]["dp_kind"] for c in out["candidates"]} == {"ddp"}
    assert {c["layout"]["zero_stage"] for c in out["candidates"]} <= {0, 1}
    assert out["best"]["attention_flops_convention"] == "causal"
    assert out["best"]["mfu"] <= out["best"]["hfu"] <= 1
    assert main(["plan", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "4", "--seq", "4096",
                 "--global-batch", "256", "--stack", "fsdp2", "--top", "50", "--json"]) == 0
    kinds = {c["layout"]["dp_kind"] for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert kinds <= {"ddp", "fsdp", "hsdp"} and "fsdp" in kinds
    with pytest.raises(SystemExit) as exc:  # argparse: one line naming the allowed stacks, exit 2
        main(["plan", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "4", "--seq", "4096",
              "--global-batch", "256", "--stack", "jax"])
    assert exc.value.code == 2 and "nxd" in capsys.readouterr().err
    with pytest.raises(ValueError, match="stack = 'jax'"):
        search("llama2-7b", "p5.48xlarge", 4, 4096, 256, stack="jax")


def test_gpu_usable_memory_is_hbm_less_the_cuda_context_and_nccl_buffers_per_group():
    """GPUs: HBM as the device reports it less the CUDA context (287,047,680 bytes with lazy loading, pytorch PR
    #86509) and 688 MiB of NCCL buffers per communicator the rank uses (NVIDIA/nccl issue #964): the world group
    plus one per parallel dimension it communicates in (TP, DP over dp x cp, CP, PP, HSDP's replica group), so a
    3D layout has less room than pure data parallelism; no fraction on top (fragmentation is not sized)."""
    from paratrain.plan.memory import process_groups

    p5 = resolve_system("p5.48xlarge")
    context, per_group = 287_047_680, 688 * 2**20
    assert (p5.efficiency.runtime_reserved_bytes, p5.efficiency.comm_buffer_bytes_per_group) == (context, per_group)
    assert p5.efficiency.memory_usable_fraction == 1.0
    for layout, groups in ((Layout(tp=1, dp=16), 2), (Layout(tp=8, pp=2, sp=True), 3), (Layout(tp=4, pp=2, sp=True), 4),
                           (Layout(tp=4, cp=2, dp=2), 4),
                           (Layout(dp_kind="hsdp", zero_stage=3), 3)):
        est = estimate("llama2-7b", "p5.48xlarge", 2, 4096, 32, dataclasses.replace(layout, microbatch=1))
        assert est.memory_capacity_bytes == p5.device_memory_bytes - context - groups * per_group, layout
    assert process_groups(8, 16, 128, 1, 128) == 4.0  # Llama 3 405B at 16,384 GPUs: world, TP, DP, PP
    assert process_groups(1, 2, 8, 1, 8, ep=8) == 4.0  # MoE, EP 8 = DP 8: + the all-to-all group, no expert DP
    assert process_groups(2, 8, 32, 1, 32, ep=32) == 6.0  # TP 2 x DP 32 over EP 32: expert DP 2 as well
    assert resolve_system("trn1.32xlarge").efficiency.comm_buffer_bytes_per_group == 0  # Neuron: DMA rings, KBs


def test_usable_memory_is_hbm_less_runtime_reservations_times_the_usable_fraction():
    """Neuron: 96 MiB microcode per physical NeuronCore (Neuron docs, device-memory.rst): one per trn1 rank, two
    per trn2 rank (LNC=2); the usable fraction applies to the rest."""
    for name, physical in (("trn1.32xlarge", 1), ("trn2.48xlarge", 2)):
        system = resolve_system(name)
        assert system.efficiency.runtime_reserved_bytes == physical * 96 * 2**20
        est = estimate("llama2-7b", name, 1, 4096, 32, Layout(tp=8, sp=True))
        expect = (system.device_memory_bytes - physical * 96 * 2**20) * system.efficiency.memory_usable_fraction
        assert est.memory_capacity_bytes == pytest.approx(expect)


def test_bf16_sr_flag_plans_pure_bf16_and_refuses_what_it_cannot_be(capsys, tmp_path):
    """--bf16-sr (Neuron's Autocast:BF16+SR): 4 bytes of optimizer state per parameter, bf16 gradients; with
    --grad-bytes 4 or --write-config (the trainer keeps fp32 masters) one clear error, exit 2."""
    base = ["estimate", "--model", "llama2-7b", "--hardware", "trn1.32xlarge", "--nodes", "16", "--seq", "4096",
            "--global-batch", "1024", "--tp", "8", "--sp", "--recompute", "selective", "--zero-stage", "0", "--json"]
    assert main(base) == 0
    mixed = json.loads(capsys.readouterr().out)
    assert main([*base, "--bf16-sr"]) == 0
    sr = json.loads(capsys.readouterr().out)
    assert sr["memory_breakdown_bytes"]["optimizer"] == pytest.approx(mixed["memory_breakdown_bytes"]["optimizer"] / 3)
    assert sr["memory_breakdown_bytes"]["grads"] == pytest.approx(mixed["memory_breakdown_bytes"]["grads"] / 2)
    assert main([*base, "--bf16-sr", "--grad-bytes", "4"]) == 2
    assert "--grad-bytes 4 with --bf16-sr" in capsys.readouterr().err
    assert main([*base, "--bf16-sr", "--write-config", str(tmp_path / "x.toml")]) == 2
    assert "--write-config with --bf16-sr" in capsys.readouterr().err and not (tmp_path / "x.toml").exists()


def test_trn1_without_stack_is_timed_as_nxd_and_any_stack_generically():
    """The catalog's trn1 stack runs as NxD (stack.runs_as): a plain estimate times the backward TP overlap and the
    pipeline's pair all-gathers as --stack nxd does, with the system's own attention kernel (unfused); --any-stack
    (choices NxD lacks, e.g. FSDP under native PyTorch) times generically."""
    from paratrain.plan.options import Options

    system = resolve_system("trn1.32xlarge")
    assert system.stack.runs_as == "nxd"
    lay = Layout(tp=8, pp=4, sp=True, recompute="selective", microbatch=1)
    plain = estimate("llama2-13b", system, 32, 4096, 1024, lay)
    nxd = estimate("llama2-13b", system, 32, 4096, 1024, lay, Options.for_system(system, stack="nxd", attention="unfused"))
    generic = estimate("llama2-13b", system, 32, 4096, 1024, lay, Options.for_system(system, system_stack=False))
    assert plain.step_time_s == pytest.approx(nxd.step_time_s, rel=1e-12)
    assert generic.time_breakdown_s["tp_comm"] > plain.time_breakdown_s["tp_comm"]  # no backward overlap there
    best = search("llama2-7b", system, 16, 4096, 256, top=1, any_stack=True).candidates[0]
    assert best.step_time_s == pytest.approx(estimate("llama2-7b", system, 16, 4096, 256, best.layout, Options.for_system(
        system, system_stack=False)).step_time_s, rel=1e-9)


# ---- software flags: the same mapping as the accuracy benchmark's csv columns (plan.software) -------------------
BENCH = __import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "planner_accuracy.py"
H100_8B = ["estimate", "--model", "llama3-8b", "--hardware", "dgx-h100", "--nodes", "16", "--seq", "8192",
           "--global-batch", "512", "--tp", "2", "--sp", "--dp-kind", "ddp", "--zero-stage", "1", "--recompute",
           "selective", "--microbatch", "1", "--stack", "megatron", "--fp8", "--json"]
H100_8B_ROW = {"stack": "megatron", "attention": "flash", "precision": "fp8", "compile": "1", "tp_overlap": "1",
               "recompute": "selective"}  # eval_runs.csv columns of the same run, empty ones left out


@pytest.fixture(scope="module")
def bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags,columns", [
    (["--fp8-recipe", "delayed"], {"fp8_recipe": "delayed"}),
    (["--attention-kernel", "fa2"], {"attention_kernel": "fa2"}),
    (["--grad-bucket-mb", "8"], {"bucket_mb": "8"}),
    (["--grad-bytes", "4"], {"reduce_bytes": "4"}),
    (["--dp-overlap", "0"], {"dp_overlap": "0"}),
    (["--tp-comm-overlap", "off"], {"tp_overlap": "0"}),
    (["--cross-entropy", "mcore_fused"], {"cross_entropy": "mcore_fused"}),
    (["--cross-entropy", "mcore"], {"cross_entropy": "mcore"}),
])
def test_software_flag_moves_the_estimate_as_the_benchmark_column(capsys, bench, flags, columns):
    """Each software flag of estimate gives the step time the benchmark's column gives the same run (one mapping,
    plan.software), and moves it (else the test could not fail)."""
    system = resolve_system("dgx-h100")
    lay = Layout(tp=2, sp=True, dp_kind="ddp", zero_stage=1, recompute="selective", microbatch=1)

    def benchmark(cols):
        return estimate("llama3-8b", system, 16, 8192, 512, lay, bench._eval_options(system, H100_8B_ROW | cols))

    base = _json(capsys, H100_8B)["step_time_s"]
    flagged = _json(capsys, [*H100_8B, *flags])["step_time_s"]
    assert base == pytest.approx(benchmark({}).step_time_s, rel=1e-12)
    assert flagged == pytest.approx(benchmark(columns).step_time_s, rel=1e-12)
    assert flagged != pytest.approx(base, rel=1e-4)


def test_torch_compile_and_cp_comm_flags_match_the_benchmark_columns(capsys, bench):
    """torchtitan (fsdp2) without torch.compile and with Llama 3's all-gather CP: the flags and the columns agree."""
    argv = ["estimate", "--model", "llama3-8b", "--hardware", "grand-teton-h100", "--nodes", "4", "--seq", "32768",
            "--global-batch", "16", "--max-seq", "32768", "--cp", "4", "--stack", "fsdp2", "--microbatch", "1", "--recompute", "full", "--json"]
    row = {"stack": "fsdp2", "attention": "flash", "precision": "bf16", "compile": "1", "tp_overlap": "0",
           "recompute": "full"}
    from paratrain.model.config import load_model_config

    model = load_model_config("llama3-8b").model_copy(update={"max_seq": 32768})
    system = resolve_system("grand-teton-h100")
    lay = Layout(cp=4, dp_kind="fsdp", zero_stage=3, recompute="full", microbatch=1)
    base = _json(capsys, argv)["step_time_s"]
    for flags, cols in ((["--torch-compile", "off"], {"compile": "0"}), (["--cp-comm", "allgather"], {"cp_comm": "allgather"}),
                        (["--recompute-every", "2"], {"recompute": "selective_layer"})):
        flagged = _json(capsys, [*argv, *flags])["step_time_s"]
        expected = estimate(model, system, 4, 32768, 16, lay, bench._eval_options(system, row | cols))
        assert flagged == pytest.approx(expected.step_time_s, rel=1e-12) and flagged != pytest.approx(base, rel=1e-4)


def _flag_and_column(capsys, bench, argv, row, lay, flag, column):
    """(estimate without the flag, with it, the benchmark's estimate with the csv column at 1), for an
    `estimate` on 4 p4de.24xlarge nodes at seq 2048 (global batch and layout from argv / lay)."""
    system = resolve_system("p4de.24xlarge")
    batch = int(argv[argv.index("--global-batch") + 1])
    base = _json(capsys, argv)["step_time_s"]
    flagged = _json(capsys, [*argv, flag])["step_time_s"]
    expected = estimate("llama2-7b", system, 4, 2048, batch, lay, bench._eval_options(system, row | {column: "1"}))
    return base, flagged, expected.step_time_s


# DeepSpeed's pipeline-less ZeRO-1 on 4 p4de (TP 8, full recompute, gradients reduced after the backward), for the
# DeepSpeed ZeRO-1 flags: the command line and the same run's benchmark columns
DEEPSPEED_7B_ARGV = ["estimate", "--model", "llama2-7b", "--hardware", "p4de.24xlarge", "--nodes", "4", "--seq", "2048",
                     "--global-batch", "32", "--tp", "8", "--stack", "deepspeed", "--attention", "unfused",
                     "--dp-overlap", "0", "--zero-stage", "1", "--recompute", "full", "--microbatch", "1", "--json"]
DEEPSPEED_7B_ROW = {"stack": "deepspeed", "attention": "unfused", "precision": "bf16", "compile": "1", "tp_overlap": "0",
                    "recompute": "full", "dp_overlap": "0"}
DEEPSPEED_7B_LAYOUT = Layout(tp=8, sp=False, zero_stage=1, recompute="full", microbatch=1)


def test_zero1_grad_allreduce_flag_matches_the_benchmark_column(capsys, bench):
    """DeepSpeed's BF16_Optimizer (BLOOM's rows): --zero1-grad-allreduce and the csv's zero1_grad_allreduce 1 give the
    same estimate, and it differs from the reduce-scattering ZeRO-1 (else the test could not fail)."""
    argv, row, lay = DEEPSPEED_7B_ARGV, DEEPSPEED_7B_ROW, DEEPSPEED_7B_LAYOUT
    base, flagged, expected = _flag_and_column(capsys, bench, argv, row, lay, "--zero1-grad-allreduce",
                                               "zero1_grad_allreduce")
    assert flagged == pytest.approx(expected, rel=1e-12) and flagged > base * (1 + 1e-4)


def test_zero1_fp16_allreduce_flag_matches_the_benchmark_column(capsys, bench):
    """DeepSpeed's fp16 ZeRO-1 (BLOOM's 02-25 rows, bloom_search_fp16): --zero1-fp16-allreduce and the csv's
    zero1_fp16_allreduce 1 give the same estimate, different from the reduce-scattering ZeRO-1 (else the test could
    not fail); with --zero1-grad-allreduce (BF16_Optimizer, another optimizer) it is one error."""
    argv, row, lay = DEEPSPEED_7B_ARGV, DEEPSPEED_7B_ROW, DEEPSPEED_7B_LAYOUT
    base, flagged, expected = _flag_and_column(capsys, bench, argv, row, lay, "--zero1-fp16-allreduce",
                                               "zero1_fp16_allreduce")
    assert flagged == pytest.approx(expected, rel=1e-12) and flagged != pytest.approx(base, rel=1e-4)
    assert main([*argv[:-1], "--zero1-fp16-allreduce", "--zero1-grad-allreduce"]) == 2
    assert "--zero1-fp16-allreduce" in capsys.readouterr().err


def test_last_bucket_after_backward_flag_matches_the_benchmark_column(capsys, bench):
    """InternLM's HybridZeroOptimizer (zero1_1k's rows): --last-bucket-after-backward and the csv's
    last_bucket_after_backward 1 give the same estimate, slower than without the rule (else the test could not
    fail); DeepSpeed's ZeRO buckets make it the deepspeed stack's default (lastbucket), so the flag adds nothing there."""
    argv = ["estimate", "--model", "llama2-7b", "--hardware", "p4de.24xlarge", "--nodes", "4", "--seq", "2048",
            "--global-batch", "256", "--stack", "deepspeed", "--grad-bucket-mb", "1024", "--grad-bytes", "2",
            "--zero-stage", "0", "--recompute", "full", "--microbatch", "8", "--json"]
    row = {"stack": "deepspeed", "attention": "flash", "precision": "bf16", "compile": "1", "tp_overlap": "0",
           "recompute": "full", "bucket_mb": "1024", "reduce_bytes": "2"}
    lay = Layout(tp=1, sp=False, zero_stage=0, recompute="full", microbatch=8)
    base, flagged, expected = _flag_and_column(capsys, bench, argv, row, lay, "--last-bucket-after-backward",
                                               "last_bucket_after_backward")
    system = resolve_system("p4de.24xlarge")
    without = estimate("llama2-7b", system, 4, 2048, 256, lay, software_options(system, Software(
        stack="deepspeed", grad_bucket_mb=1024.0, grad_bytes=2, last_bucket_after_backward=False))).step_time_s
    assert flagged == base == pytest.approx(expected, rel=1e-12) and flagged > without * (1 + 1e-4)



def test_param_gather_in_step_flag_matches_the_benchmark_column(capsys, bench):
    """big3d: --param-gather-in-step and the csv's overlap_param_gather 0 (Megatron-Bridge 0.2.0's 405B MXFP8 row in
    nemo_b200) give the same estimate, slower than the default dispatch (else the test could not fail)."""
    argv = ["estimate", "--model", "llama2-7b", "--hardware", "p4de.24xlarge", "--nodes", "4", "--seq", "2048",
            "--global-batch", "64", "--tp", "2", "--sp", "--pp", "2", "--virtual-stages", "2", "--pp-schedule",
            "interleaved_1f1b", "--pp-layers", "balanced",
            "--stack", "megatron", "--zero-stage", "1", "--recompute", "none", "--microbatch", "1", "--json"]
    row = {"stack": "megatron", "attention": "flash", "precision": "bf16", "compile": "1", "tp_overlap": "1",
           "recompute": "none"}
    lay = Layout(tp=2, pp=2, sp=True, zero_stage=1, recompute="none", microbatch=1, pp_schedule="interleaved_1f1b",
                 virtual_stages=2, pp_layers="balanced")
    system = resolve_system("p4de.24xlarge")
    base = _json(capsys, argv)["step_time_s"]
    flagged = _json(capsys, [*argv, "--param-gather-in-step"])["step_time_s"]
    expected = estimate("llama2-7b", system, 4, 2048, 64, lay, bench._eval_options(
        system, row | {"overlap_param_gather": "0"})).step_time_s
    assert flagged == pytest.approx(expected, rel=1e-12) and flagged > base * (1 + 1e-4)

@pytest.mark.parametrize("argv,expect", [
    (["--fp8-recipe", "blockwise"], ("argument --fp8-recipe: invalid choice: 'blockwise'", "mxfp8")),
    (["--attention-kernel", "fa3"], ("argument --attention-kernel: invalid choice: 'fa3'", "cudnn")),
    (["--grad-bucket-mb", "0"], ("--grad-bucket-mb = 0.0: must be > 0",)),
    (["--dp-overlap", "1.5"], ("--dp-overlap = 1.5: must be <= 1",)),
    (["--recompute-every", "0"], ("--recompute-every = 0: must be >= 1",)),
    (["--cp-comm", "p2p"], ("argument --cp-comm: invalid choice: 'p2p'", "allgather_rotate")),
    (["--torch-compile", "yes"], ("argument --torch-compile: invalid choice: 'yes'", "off")),
    (["--unfused-softmax"], ("--unfused-softmax with flash attention",)),
    (["--fp8-recipe", "mxfp8"], ("--fp8-recipe mxfp8 on dgx-h100: h100 runs no MX block-scaled matmuls",
                                 "chips.h100.mx_formats", "allowed: --fp8-recipe current or delayed")),
])
def test_bad_software_flags_fail_with_one_line(capsys, argv, expect):
    """One line naming the flag, the value and what is allowed (argparse's choices exit from the parser)."""
    try:
        code = main([*H100_8B, *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and all(e in err for e in expect) and err.count("\n") == 1, err


def test_mxfp8_flag_matches_the_benchmark_column_on_blackwell_and_fp8_needs_an_fp8_rate(capsys, bench):
    """--fp8-recipe mxfp8 where the chip runs MX formats (B200: chips.b200.mx_formats) gives the benchmark's
    precision=mxfp8 column and moves the step; --fp8 on an A100 (no FP8 rate in the catalog) is refused with one line
    before anything is timed (a BF16 rate under an FP8 label would be a wrong number), by estimate and by plan."""
    argv = [a if a != "dgx-h100" else "dgx-b200" for a in H100_8B]
    system = resolve_system("dgx-b200")
    lay = Layout(tp=2, sp=True, dp_kind="ddp", zero_stage=1, recompute="selective", microbatch=1)
    flagged = _json(capsys, [*argv, "--fp8-recipe", "mxfp8"])["step_time_s"]
    expected = estimate("llama3-8b", system, 16, 8192, 512, lay,
                        bench._eval_options(system, H100_8B_ROW | {"precision": "mxfp8"})).step_time_s
    assert flagged == pytest.approx(expected, rel=1e-12) and flagged != pytest.approx(_json(capsys, argv)["step_time_s"], rel=1e-4)
    for command in ("estimate", "plan"):
        args = ["--model", "llama3-8b", "--hardware", "p4de.24xlarge", "--nodes", "4", "--fp8"]
        assert main([command, *args]) == 2
        err = capsys.readouterr().err
        assert "--fp8 on p4de.24xlarge: a100-80gb has no FP8 matmul rate (chips.a100-80gb.fp8_tflops unset" in err, err
        assert err.count("\n") == 1


def test_tp_comm_overlap_is_refused_off_nvidia(capsys):
    assert main(["estimate", *SEVEN_B, "--tp", "8", "--sp", "--tp-comm-overlap", "on"]) == 2
    assert "--tp-comm-overlap on, on trainium1: the overlap runs on NVIDIA GPUs only" in capsys.readouterr().err


def test_software_checks_name_the_flag_in_the_benchmarks_path_too():
    from paratrain.plan.software import Software

    with pytest.raises(ValueError, match=r"--grad-bucket-mb = -1: allowed: a number > 0 \(MiB\)"):
        Software(grad_bucket_mb=-1)
    with pytest.raises(ValueError, match=r"--fp8-recipe = 'blockwise': allowed: current, delayed, mxfp8"):
        Software(fp8_recipe="blockwise")


def test_plan_names_the_layouts_tied_with_its_first_choice(capsys):
    """plan reports the candidates within plan.api.TIE_FRACTION (5%) of #1's step time (the planner's resolution: the
    layout decisions count published pairs only beyond it) in --json (search.ties_with_best) and as a note; the
    seed's Trainium layout (TP8 PP1 SP, DP512) is 5.7% ahead of its runner-up, so it has none."""
    from paratrain.plan.api import TIE_FRACTION

    argv = ["plan", "--model", "llama3-70b", "--hardware", "p5.48xlarge", "--nodes", "128", "--seq", "8192",
            "--global-batch", "1024", "--top", "5"]
    data = _json(capsys, [*argv, "--json"])
    steps = [c["step_time_s"] for c in data["candidates"]]
    ties = [i for i, s in enumerate(steps[1:], 2) if s <= steps[0] * (1 + TIE_FRACTION)]
    assert ties and data["search"]["ties_with_best"] == ties
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"note: {', '.join(f'#{r}' for r in ties)} within 5% of #1's step time" in out
    # why #1 beats #2, in the breakdown's terms: the component that differs most, from the same candidates' JSON
    a, b = (c["time_breakdown_s"] for c in data["candidates"][:2])
    part, delta = max(((k, b[k] - a[k]) for k in a), key=lambda kv: abs(kv[1]))
    assert f"note: #2 is {steps[1] - steps[0]:+.4f} s per step" in out and f"{part} {delta:+.3f}" in out
    seed = _json(capsys, ["plan", *SEVEN_B, "--top", "5", "--json"])
    assert seed["search"]["ties_with_best"] == []
