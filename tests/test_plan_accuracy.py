"""The planner's accuracy goals against published measurements, as a regression guard.

The same data and code as `benchmarks/planner_accuracy.py` (which prints the per-row errors): if a change to the
model or the catalog's efficiency values moves a data set past its goal, this fails. Goals from the issue:
step-time MAPE under 10% on Narayanan et al. 2021 Table 1 and Korthikanti et al. 2022 Table 5, under 15% with
Spearman >= 0.8 on the vTrain single-node runs; the held-out vTrain multi-node runs (never used to set any
parameter) must beat vTrain's own reported 14.7%.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from paratrain.hardware.catalog import get_catalog

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "planner_accuracy.py"


def _bench():
    spec = importlib.util.spec_from_file_location("planner_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _errors(rows):
    pred = np.array([p for _, p, _ in rows])
    meas = np.array([m for _, _, m in rows])
    assert np.isfinite(pred).all(), "every published row must get a prediction"
    return pred, meas


@pytest.fixture(scope="module")
def bench():
    return _bench()


def test_narayanan_and_korthikanti_under_10_percent(bench):
    dgx = get_catalog().system("dgx-a100-80gb")
    for name, rows, count in (("narayanan", bench.narayanan(dgx), 10), ("korthikanti", bench.korthikanti(dgx), 8)):
        pred, meas = _errors(rows)
        assert len(rows) == count, name
        assert bench.mape(pred, meas) < 10.0, name


def test_vtrain_single_node_under_15_percent_and_ranked(bench):
    pred, meas = _errors(bench.vtrain(get_catalog().system("p4d.24xlarge")))
    assert len(pred) == 1440
    assert bench.mape(pred, meas) < 15.0
    assert bench.spearman(pred, meas) >= 0.8


def test_held_out_multi_node_beats_vtrain(bench):
    pred, meas = _errors(bench.vtrain_multi(bench.vtrain_cluster(get_catalog())))
    assert len(pred) == 109
    assert bench.mape(pred, meas) < 14.7  # vTrain's own reported multi-node error
    assert bench.spearman(pred, meas) >= 0.8


def test_evaluation_runs_are_sourced_and_apart_from_calibration(bench):
    """Every published run names its source; no run is in both the calibration and the evaluation file."""
    import csv

    def rows(path):
        with path.open(encoding="utf-8") as fh:
            return list(csv.DictReader(fh))
    ev, cal = rows(bench.EVAL_CSV), rows(bench.CAL_CSV)
    assert len(ev) >= 35 and len(cal) >= 5 and all(r["source"].strip() for r in ev + cal)
    key = lambda r: tuple(r[k] for k in ("model", "system", "nodes", "seq", "global_batch", "tp", "pp", "cp",  # noqa: E731
                                         "precision", "compile", "measured"))
    assert not {key(r) for r in ev} & {key(r) for r in cal}
    assert not {r["set"] for r in ev} & {r["set"] for r in cal}


def test_trainium_calibration_spans_sdk_versions_and_models(bench):
    """Trainium1 is fitted on more than one model and more than one SDK per model (the SDK spread is the floor),
    and its held-out NxD rows (other models and layouts) stay within 10%."""
    import csv

    with bench.CAL_CSV.open(encoding="utf-8") as fh:
        cal = [r for r in csv.DictReader(fh) if r["set"] == "neuron_trn1_nxd"]
    models = {r["model"] for r in cal}
    assert len(models) >= 2 and all(sum(r["model"] == m for r in cal) >= 3 for m in models)
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        held = {r["model"] for r in csv.DictReader(fh) if r["set"] == "neuron_trn1"}
    assert held and not held & models  # evaluated on models it was not fitted on


def test_evaluation_sets_stay_within_their_reported_error(bench):
    """Regression guard on the evaluation sets (docs/planner.md's accuracy table; nothing was fitted on them)."""
    sets = bench.eval_sets(get_catalog())
    # h100p2p (4 Dec): the Hopper GEMM efficiency at megatron_h100_1node's optimum 0.64 and Megatron's interleaved
    # sends as overlap_p2p_comm waits for them: nemo_h100 6.2 -> 5.7, llama3_paper 12.8 -> 8.8, dgxc_h100 6.1 -> 3.2,
    # nemo_gb200 7.3 -> 6.0, together_b200 7.9 -> 6.1, nemo_long_seq_h100 2.2 -> 1.2 (guards 10 / 13.5 / 7 / 12 / 9 / 4
    # -> 7 / 9.5 / 4 / 7 / 7 / 2); nemo_b200 5.4 -> 7.1, ibm_fsdp2_h100 13.3 -> 14.8, mosaic_fsdp 4.9 -> 5.4 worse
    # nemo_h100 5.8 -> 5.5% once the SP backward's re-gather of the column-parallel inputs is exposed where it
    # outlasts its dgrad GEMM (big3d, 4 Dec; was 7.0)
    goals = {"nemo_h100": 6.5, "torchtitan_a100": 10.0,
             # torchtitan_h100: 7.6 -> 6.2% once torch's CP ring, traced by the benchmarks' torch.compile, waits for
             # each of its collectives where it issues it (cptt, 4 Dec; was 15.0)
             "torchtitan_h100": 7.0,
             # llama3_paper: 17.7% with the planner's best pipeline, 14.1% once its rows run the pipeline and FSDP
             # ZeRO-2 Dubey et al. 2024 sec. 3.3.2 publish (v 8, empty end chunks; accmeta, 3 Dec; was 25.0); 17.2% once
             # they run on the cluster sec. 3.3.1 describes (meta-llama3-h100: 3,072-GPU pods, 1:7 between) with Meta's
             # [TP, CP, PP, DP] order: FSDP's per-microbatch gathers then cross the 1:7 layer (rankorder, 3 Dec; was
             # 15.0 on dgx-h100, where the order changes nothing); 13.5% with the data parallelism, gradient precision,
             # recompute, microbatch and kernel of Meta's own account of that system (Chu et al., ISCA '25: one
             # overlapped gather and reduce-scatter per step, FP32 reduce-scatter, FA2; llama3dp, 4 Dec; was 18.0)
             # 12.8% once hidden DP traffic costs the SMs NCCL holds (nccl, 4 Dec; guard 14 -> 13.5)
             "llama3_paper": 9.5,
             # neuron_trn1 5.3 -> 5.1%, neuron_trn1_nemo 7.9 -> 7.3%, neuron_trn1_megatron 5.9 -> 5.3% once Trainium1's
             # collectives reduce at the rate nccom-test's on-chip all-reduce measures and NKI's flash kernel runs its
             # diagonal key tiles whole (nxdtp, 4 Dec; guards 6.5 / 9.0 / 8.0 -> 6.0 / 8.0 / 6.5)
             "neuron_trn1": 6.0, "neuron_trn1_nemo": 8.0,
             # nemo_b200 7.1 -> 6.8% once NeMo 25.02's rows run the FP8 recipe and loss of NeMo v2.2.0 (TE delayed
             # scaling, Megatron-Core's fused cross-entropy; b200, 4 Dec; was 10.0); 6.6% once Megatron-Bridge 0.2.0's
             # 405B MXFP8 row gathers its parameters in the optimizer step (big3d, 4 Dec; was 7.5)
             "nemo_b200": 7.0,
             # mosaic_fsdp 7.8 -> 6.2%, ibm_fsdp1_a100 6.4 -> 5.4% once llm-foundry's Triton attention is timed as the
             # FA1-class kernel it is and the A100 PyTorch scale refit (pthopper, 3 Dec; bounds 10.0 / 10.0 before)
             # 4.9% / 3.6% / 2.9% / 8.4% / 6.1% for mosaic_fsdp / ibm_fsdp1_a100 / megatron_fsdp / zero1_1k / dgxc_h100 with the
             # SM share of hidden DP traffic (nccl, 4 Dec; guards 7 / 7 / 4 / 9.5 / 8 -> 5.5 / 5 / 3.5 / 9 / 7)
             # 5.4 -> 5.1% once Grand Teton's peak is the 700 W part's throughput under a 500 W cap and the Hopper
             # PyTorch scale refit 0.85 -> 0.92 (h100power, 4 Dec; was 5.5)
             "mosaic_fsdp": 5.25,
             "neuron_trn1_megatron": 6.5,  # 13.0% / 9.6% since acctrn's GPT-3 rows (docs/planner.md); 8.8% / 5.9%
             # since acctrn2's gradient accumulation pass (bounds 12.0 / 12.0 before)
             # neuron_trn1_nemo: 13.0% -> 10.2% once its pre-2.18 rows ran the unfused softmax they ran (was 20.0 here)
             # neuron_trn1 6.0 -> 5.3%, neuron_trn1_nemo 8.8 -> 7.9% once the replay's dead tail is dropped (accnxd;
             # bounds 10.0 / 10.0 before)
             # ibm_fsdp2_h100 14.8 -> 11.5, ibm_fsdp1_a100 3.6 -> 1.5% once torch's non-reentrant checkpoint replay
             # stops before the block's last GEMM (early stop, torch >= 2.1; h100pt, 4 Dec; bounds 15.0 / 5.0 before);
             # torchtitan_h100 6.1 -> 6.7, torchtitan_a100 2.6 -> 3.6% worse (docs/planner.md, h100pt)
             # ibm_fsdp2_h100 11.5 -> 8.3% with the same refit (h100power, 4 Dec; was 12.5); torchtitan_h100 6.7 -> 6.9%
             # worse (docs/planner.md, h100power)
             "ibm_fsdp2_h100": 9.0, "ibm_fsdp1_a100": 2.5,
             "nemo_gb200": 7.0,
             "nemo_long_seq_h100": 2.0,  # 2.2% since its rows ran flash-attn 2 (acccp, 3 Dec; was 32.0)
             # fsdp_scale (fsdpdata, 3 Dec): BLOOM 176B on 384 A100 (3D + ZeRO-1) and MT-NLG 530B on 2,240-3,360 A100,
             # every row fast: 18.2% at its addition, 15.2% once the tied embedding's gradient all-reduce and DeepSpeed
             # BF16_Optimizer's whole-buffer all-reduce are timed; what is left is in docs/planner.md "fsdpdata";
             # 13.0% since BF16_Optimizer's per-microbatch fp32 accumulation and DeepSpeed's serial pipeline sends
             # are timed (pipegap, 3 Dec; was 16.0); BLOOM's pre-launch layout search is its own set, bloom_search
             "fsdp_scale": 14.0,
             # bloom_search (layoutpairs, 6 Dec): BLOOM's 02-28 layout search, three 64-head candidate shapes in TP4/TP8,
             # PP6/PP12, MBS 2/4 on the same 384 A100, one build: 4.5% at its addition
             "bloom_search": 5.0,
             # bloom_search_fp16 (bloomfp16, 6 Dec): the same search's 02-25 fp16 tables, one 181B shape in 21
             # layouts (TP 2-8, PP 2-24, MBS 1-6, GBS 1568-2048), DeepSpeed's fp16 ZeRO-1: 7.4% read as the planner's
             # reduce-scattering ZeRO-1, 6.96% with DeepSpeedZeroOptimizer's fp16 all-reduce and autograd's fp16
             # accumulation (zero1_fp16_allreduce) at its addition
             "bloom_search_fp16": 7.0,
             # megatron_fsdp (mfsdp, 3 Dec): Megatron FSDP (ZeRO-3) in Megatron-Bridge's DGX-GB200 tables, Llama 3 70B
             # FSDP64 and 405B TP2 FSDP64 at 64-128 GPUs: 4.2% at its addition, six of seven rows fast (-8.2% .. +0.2%);
             # 3.6% with the recipes' CPU activation offloading timed (offload, 3 Dec; guard 5 -> 4)
             "megatron_fsdp": 3.5,
             # zero1_1k (scale3d, 3 Dec): InternLM 7B, data parallel over 256-1,024 A100 (hybrid ZeRO-1, gradients
             # all-reduced over every GPU), never tuned: 10.5% at its addition, every row fast (-1.3% .. -19.6%);
             # 9.0% with InternLM's last bucket reduced after the backward (scalegap, 3 Dec; guard 11 -> 9.5)
             "zero1_1k": 9.0,
             # together_b200 (b200scale, 3 Dec): Together AI's Llama 3 70B runs on two B200 clusters via dgxc-
             # benchmarking, 8.0% at its addition: FSDP FP8-CS on 64-592 GPUs -0.3 .. -17.2% (fast with scale: the
             # planner keeps FSDP's traffic hidden), TP2 PP4 VP5 MXFP8 on 256-512 GPUs +3.4 .. +23.4% (slow; the
             # slinky cluster runs the same layout 19% faster than use3a-ss)
             "together_b200": 7.0,
             # fsdp_1k (fsdp1k, 4 Dec): fully sharded data parallelism at 768-4,096 GPUs, never tuned: OPT-175B on 992
             # A100 80GB (metaseq: fairscale FSDP without reshard after forward + Megatron TP8; Zhang et al. 2022's
             # "up to 147 TFLOP/s per GPU" in Narayanan et al.'s count), the one public run found that pins a row:
             # 14.5% (fast) at its addition, 13.3% once its checkpointed inputs are split over the TP group and
             # re-gathered before each replay (--distribute-checkpointed-activations; guard 15 -> 14)
             "fsdp_1k": 14.0,
             # automodel (autorows, 6 Dec): NVIDIA NeMo AutoModel's one dense pre-training row (Llama 3.1 70B BF16 on
             # 64 H100, torch FSDP2 over 64 ranks with CP2, torch.compile, AC on each block's attention and MLP),
             # never tuned: +11.7% (slow) at its addition; its compute alone (19.1 s) is over the measured 18.90 s
             "automodel": 12.0,
             # torchtitan_h200 (lead, 6 Dec): Trainy's torchtitan Llama 3.1 8B FP8 FSDP runs on 32 / 64 H200 (the
             # torchtitan benchmark whose memory memory_runs.csv already holds): -1.8 / -3.2% at its addition
             "torchtitan_h200": 3.5,
             "dgxc_h100": 4.0}  # dgxc_h100: 6.7% with the runs' own cross-entropy (accdgx, 3 Dec; guard 9 -> 8), 7.7% at its addition (accdgxc, 2 Dec), 8.3% with the Nemotron-4/GPT-3 rows, 7.8% with acccp's FA2 rows, 7.7% with FP8 delayed scaling's amax all-reduce, 7.6% with the runs' gradient buckets (accdp, 3 Dec)
    # nemo_long_seq_h100: 28.1% at its addition (accl3, 2 Dec; docs/planner.md)  # nemo_gb200: 9.2% at its addition (accgpu, 2 Dec)  # ibm_fsdp2_h100: 15.0% at its addition (acc3),
    # 12.7% since torchtitan's per-op checkpointing is timed; the cause left is in docs/planner.md
    for name, goal in goals.items():
        pred, meas = _errors([r[:3] for r in sets[name]])
        assert bench.mape(pred, meas) < goal, name


def test_pytorch_a100_scale_is_calibrated_on_one_node_rows(bench):
    """plan.stacks.PYTORCH_AMPERE_SCALE is the grid's best on mosaic_a100_1node (one 8-GPU A100 node: no network),
    and the A100 PyTorch-native evaluation sets it was not fitted on (torchtitan's and IBM's Llama rows on 64-128
    GPUs, MosaicML's multi-node rows) stay within 10%."""
    import csv
    from unittest import mock

    import paratrain.plan.stacks as stacks

    with bench.CAL_CSV.open(encoding="utf-8") as fh:
        cal = [r for r in csv.DictReader(fh) if r["set"] == "mosaic_a100_1node"]
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        foundry = [r for r in csv.DictReader(fh) if "llm-foundry" in r["source"]]
    # every llm-foundry row ran submit_benchmarks.py's default attn_impl triton: timed as FA1 class, as is the fit
    assert foundry and all(r["attention_kernel"] == "fa1" for r in cal + foundry)
    assert len(cal) >= 8 and {r["nodes"] for r in cal} == {"1"} and {r["system"] for r in cal} == {"dgx-a100-80gb"}
    catalog = get_catalog()

    def cal_mape(scale):
        with mock.patch.object(stacks, "PYTORCH_AMPERE_SCALE", scale):
            rows = bench.eval_sets(catalog, bench.CAL_CSV)["mosaic_a100_1node"]
        return bench.mape([r[1] for r in rows], [r[2] for r in rows])
    fitted = stacks.PYTORCH_AMPERE_SCALE
    assert cal_mape(fitted) < 6.0  # 4.9% with the rows' FA1-class attention (pthopper, 3 Dec; 6.4% and < 8.0 before)
    assert cal_mape(fitted) <= min(cal_mape(fitted - 0.01), cal_mape(fitted + 0.01))  # the grid's optimum
    sets = bench.eval_sets(catalog)
    for name in ("torchtitan_a100", "ibm_fsdp1_a100"):
        pred, meas = _errors([r[:3] for r in sets[name]])
        assert bench.mape(pred, meas) < 10.0, name


def test_b200_is_calibrated_on_dense_one_node_rows_and_held_out_on_others(bench):
    """The B200 GEMM efficiency is the grid's best on the dense calibration set nemo_b200_1node (Llama 3 8B on
    one DGX-B200, two containers, FP8-CS and MXFP8), not on its evaluation set nemo_b200 (other models, sizes
    and containers: within 10%) nor on any MoE row; and it moves only B200 rows."""
    import csv

    with bench.CAL_CSV.open(encoding="utf-8") as fh:
        cal = [r for r in csv.DictReader(fh) if r["set"] == "nemo_b200_1node"]
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        ev = [r for r in csv.DictReader(fh) if r["set"] == "nemo_b200"]
    assert len(cal) >= 4 and {r["system"] for r in cal} == {"dgx-b200"} and {r["nodes"] for r in cal} == {"1"}
    assert {r["precision"] for r in cal} == {"fp8", "mxfp8"}
    assert len(ev) >= 8 and {r["model"] for r in ev} - {r["model"] for r in cal}  # models it was not fitted on
    catalog = get_catalog()
    fitted = catalog.chip("b200").efficiency.matmul_eff_max

    def cal_mape(eff):
        rows = bench.eval_sets(bench._Swapped(catalog, {"matmul_eff_max": eff}, chip="b200"),
                               bench.CAL_CSV)["nemo_b200_1node"]
        return bench.mape([r[1] for r in rows], [r[2] for r in rows])
    assert cal_mape(fitted) < 5.0
    assert cal_mape(fitted) <= min(cal_mape(fitted - 0.01), cal_mape(fitted + 0.01))  # the grid's optimum
    # the old assumption (H100's 0.70) only moves B200 rows
    now, old = bench.eval_sets(catalog), bench.eval_sets(bench._Swapped(catalog, {"matmul_eff_max": 0.70}, chip="b200"))
    for name in now:
        moved = [a[1] != b[1] for a, b in zip(now[name], old[name], strict=True)]
        assert any(moved) == (name in ("nemo_b200", "together_b200")), name  # the evaluation sets on dgx-b200


def test_h100_megatron_calibration_set_is_one_node_and_held_apart(bench):
    """megatron_h100_1node (the Hopper GEMM efficiency's set, --calibrate-h100-megatron): Megatron-Core runs on one
    8-GPU DGX-H100 (no network term to fit), more than one model, source and precision; the evaluation sets its rows
    came from (dgxc_h100, nemo_h100) keep no single-node row, and no H100 evaluation set shares a row with it."""
    import csv

    with bench.CAL_CSV.open(encoding="utf-8") as fh:
        cal = [r for r in csv.DictReader(fh) if r["set"] == "megatron_h100_1node"]
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        ev = list(csv.DictReader(fh))
    assert len(cal) >= 8 and {r["system"] for r in cal} == {"dgx-h100"} and {r["nodes"] for r in cal} == {"1"}
    assert {r["stack"] for r in cal} == {"megatron"} and {r["precision"] for r in cal} == {"bf16", "fp8"}
    assert len({r["model"] for r in cal}) >= 2 and len({r["source"].split(" ")[0] for r in cal}) >= 3
    assert not [r for r in ev if r["set"] in ("dgxc_h100", "nemo_h100") and r["nodes"] == "1"]
    key = lambda r: (r["model"], r["system"], r["nodes"], r["precision"], r["measured"])  # noqa: E731
    assert not {key(r) for r in cal} & {key(r) for r in ev}  # no row in both files
    assert {r["set"] for r in ev if r["system"] == "dgx-h100"} >= {"dgxc_h100", "nemo_h100", "nemo_long_seq_h100"}


def test_version_spread_floor_is_the_best_one_prediction_per_layout(bench, tmp_path):
    """Rows that differ only in their measurement and its source (one layout on several SDKs) can get only one
    prediction: the floor is the best constant's MAPE over them (a measured value: the objective is convex and
    piecewise linear); a layout measured once counts 0; a set without repeats reports none."""
    import csv

    cols = ["set", "model", "tp", "measured", "unit", "source", "notes"]
    rows = [["a", "m1", "8", "10", "seq_per_s", "SDK 1", ""], ["a", "m1", "8", "12", "seq_per_s", "SDK 2", "later"],
            ["a", "m2", "8", "5", "seq_per_s", "SDK 1", ""], ["b", "m1", "8", "10", "seq_per_s", "SDK 1", ""]]
    path = tmp_path / "runs.csv"
    with path.open("w", encoding="utf-8", newline="") as fh:
        csv.writer(fh).writerows([cols, *rows])
    steps = {"a": [("r1", 1.0, 1.0), ("r2", 1.0, 1.2), ("r3", 1.0, 3.0)], "b": [("r4", 1.0, 1.0)]}
    floor = bench.version_spread_floor(path, steps)
    assert set(floor) == {"a"} and floor["a"]["layouts"] == 2 and floor["a"]["rows"] == 3
    assert floor["a"]["floor_pct"] == pytest.approx((0.2 / 1.2) / 3 * 100)  # 1.0 for both: 0 and 1/6; m2: 0
    assert floor["a"]["spread_pct"] == pytest.approx(20.0)
    nxd = bench.version_spread_floor(bench.CAL_CSV, bench.eval_sets(get_catalog(), bench.CAL_CSV))["neuron_trn1_nxd"]
    # three configurations, each on several SDKs: Llama 2 7B unfused (2.15-2.18) and with NxD's flash kernel (the
    # tp_zero1 script's default from 2.19: 2.20, 2.21), Llama 3.1 8B (2.20-2.24)
    assert 0 < nxd["floor_pct"] < 10 and nxd["layouts"] == 3


def test_megatron_fsdp_set_is_sharded_data_parallel_at_scale(bench):
    """megatron_fsdp (mfsdp): Megatron FSDP (ZeRO-3, data_parallel_sharding_strategy optim_grads_params) runs at
    64 GPUs and more, all on systems of the catalog, none of them a calibration row."""
    import csv

    catalog = get_catalog()
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r["set"] == "megatron_fsdp"]
    with bench.CAL_CSV.open(encoding="utf-8") as fh:
        cal = {(r["model"], r["system"], r["nodes"], r["measured"]) for r in csv.DictReader(fh)}
    assert len(rows) >= 7 and {r["dp_kind"] for r in rows} == {"fsdp"} and {r["stack"] for r in rows} == {"megatron"}
    assert all(int(r["nodes"]) * bench._system(catalog, r["system"]).devices_per_node >= 64 for r in rows)
    assert not {(r["model"], r["system"], r["nodes"], r["measured"]) for r in rows} & cal


def test_published_runs_fit_where_they_ran(bench, monkeypatch):
    """fitaudit: the runs whose memory the planner once rejected (InternLM's hybrid ZeRO-1, llm-foundry's fused
    cross-entropy, the Neuron Megatron-LM reference without dropout on Trn1, Nemotron-4 340B's bf16 Adam states,
    OPT-175B's TP-split checkpointed inputs: fsdp1k) fit as they ran; Llama 3 405B at 8,192 GPUs is the one fully
    published row left over (Meta's sec. 6.3 memory work)."""
    import csv

    made, real = [], bench.estimate
    monkeypatch.setattr(bench, "estimate", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    catalog = get_catalog()
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r["set"] in ("zero1_1k", "mosaic_fsdp", "neuron_trn1_megatron", "fsdp_1k")
                or r["model"] == "nemotron4-340b" and r["precision"] == "bf16"]
    for r in rows:
        made.clear()
        bench._eval_row(catalog, r)
        assert len(made) == 1 and made[0].fits, (r["set"], r["model"], r["nodes"], made[0].memory_per_device_bytes)
    assert len(rows) == 55


def test_fsdp_1k_set_is_fully_sharded_at_scale(bench):
    """fsdp_1k (fsdp1k): every row is FSDP/HSDP with sharded parameters (zero_stage >= 2) on 768-4,096 devices, and
    OPT-175B's 147 TFLOP/s per GPU in Narayanan et al. 2021's count (full recompute) is a 19.98 s step of 992 x 2048
    tokens on 992 GPUs (96 B s l h^2 (1 + s/6h + V/16lh) / (147e12 x 992))."""
    import csv

    catalog = get_catalog()
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r["set"] == "fsdp_1k"]
    assert rows and all(r["dp_kind"] in ("fsdp", "hsdp") and int(r["zero_stage"] or 3) >= 2 for r in rows)
    assert all(768 <= int(r["nodes"]) * bench._system(catalog, r["system"]).devices_per_node <= 4096 for r in rows)
    opt = next(r for r in rows if r["model"] == "opt-175b")
    assert bench._eval_row(catalog, opt)[2] == pytest.approx(19.977, abs=0.01)


def test_automodel_rows_name_their_table_and_recipe(bench):
    """automodel (autorows): every row is NVIDIA NeMo AutoModel's torch FSDP2 (the planner's fsdp2 stack) and names
    the performance-summary table it was read from at a pinned commit and the YAML recipe that fixed its unpublished
    fields; its one Llama row is 128 x 8192 tokens in 18.90 s on 64 GPUs, the table's 866.77 tokens/s/GPU."""
    import csv
    import re

    catalog = get_catalog()
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r["set"] == "automodel"]
    assert rows and all(r["stack"] == "fsdp2" and r["dp_kind"] == "fsdp" for r in rows)
    assert all(re.match(r"NVIDIA-NeMo/Automodel docs/performance-summary\.md @[0-9a-f]{40} ", r["source"])
               for r in rows)
    assert all(re.search(r"examples/\S+\.yaml @[0-9a-f]{9}", r["notes"]) for r in rows)
    llama = next(r for r in rows if r["model"] == "llama3-70b")
    label, _, measured, *_ = bench._eval_row(catalog, llama)
    assert "64dev" in label and measured == pytest.approx(18.90)
    assert 128 * 8192 / (measured * 64) == pytest.approx(866.77, rel=1e-3)


def test_torchtitan_h200_rows_are_the_memory_sets_runs(bench):
    """torchtitan_h200: the two Trainy runs whose memory memory_runs.csv holds (same layout, same source file at the
    same commit), timed from their TPS/GPU column: 64 x 8192 tokens on 32 GPUs at 10,938 tokens/s/GPU."""
    import csv

    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r["set"] == "torchtitan_h200"]
    with (bench.EVAL_CSV.parent / "memory_runs.csv").open(encoding="utf-8") as fh:
        mem = [r for r in csv.DictReader(fh) if r["set"] == "torchtitan_h200"]
    key = ("model", "system", "nodes", "seq", "global_batch", "tp", "pp", "cp", "microbatch", "dp_kind", "recompute",
           "precision", "compile", "stack")
    assert len(rows) == len(mem) == 2 and [tuple(r[k] for k in key) for r in rows] == [tuple(m[k] for k in key) for m in mem]
    assert all(r["source"] == m["source"].replace("Memory(GiB)", "TPS/GPU") for r, m in zip(rows, mem, strict=True))
    label, _, measured, *_ = bench._eval_row(get_catalog(), rows[0])
    assert "32dev" in label and 64 * 8192 / (measured * 32) == pytest.approx(10938)


def test_zero1_1k_set_is_data_parallel_at_scale(bench):
    """zero1_1k (scale3d): InternLM 7B with tp 1 pp 1 on 256-1,024 GPUs, its gradients all-reduced over every GPU
    (HybridZeroOptimizer's zero1=8: hsdp with zero_stage 1 here, the optimizer state sharded inside each node,
    docs/planner.md fitaudit), none of them a calibration row."""
    import csv

    catalog = get_catalog()
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r["set"] == "zero1_1k"]
    with bench.CAL_CSV.open(encoding="utf-8") as fh:
        cal = {(r["model"], r["system"], r["nodes"], r["measured"]) for r in csv.DictReader(fh)}
    assert len(rows) == 12 and {(r["dp_kind"], r["zero_stage"], r["tp"], r["pp"]) for r in rows} == {("hsdp", "1", "1", "1")}
    assert all(int(r["nodes"]) * bench._system(catalog, r["system"]).devices_per_node >= 256 for r in rows)
    assert not {(r["model"], r["system"], r["nodes"], r["measured"]) for r in rows} & cal


def test_together_b200_memory_matches_the_reported_peak(bench):
    """together_b200 (b200scale): the Llama 3 70B FSDP layout with its recipe's 5 offloaded layers, timed with the
    DGX B200's PCIe Gen5 host link, is held at the per-rank peak the report measured (Together's
    Llama_70B_FP8_Scaling_Benchmark_Report.md sec. 3, rank 0 max allocated after step 1: 164.4 GB on 64 GPUs ..
    157.6 GB on 592); the model's count falls faster with scale (-0.5% on 64 GPUs, -6.3% on 592), and the copies
    cost time (the report does not say how much)."""
    import csv

    from paratrain.plan.api import Layout, estimate

    reported_gb = {8: 164.4, 16: 160.5, 32: 158.6, 64: 157.8, 74: 157.6}
    catalog = get_catalog()
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh)
                if r["set"] == "together_b200" and "Llama_70B_FP8_Scaling_Benchmark_Report" in r["source"]]
    assert sorted(int(r["nodes"]) for r in rows) == sorted(reported_gb)
    errors = {}
    for r in rows:
        system = bench._system(catalog, r["system"])
        lay = Layout(tp=1, sp=False, dp_kind="fsdp", zero_stage=3, microbatch=1, offload_layers=int(r["offload_layers"]))
        est = estimate(r["model"], system, int(r["nodes"]), int(r["seq"]), int(r["global_batch"]), lay,
                       bench._eval_options(system, r))
        errors[int(r["nodes"])] = est.memory_per_device_bytes / (reported_gb[int(r["nodes"])] * 1e9) - 1
        assert est.fits and est.time_breakdown_s["offload_exposed"] > 0
    assert all(-0.07 < e < 0.0 for e in errors.values()), errors
    assert abs(errors[8]) < 0.01  # 64 GPUs, where FSDP splits the states the least


def test_megatron_fsdp_layouts_fit_with_their_published_offload(bench):
    """The megatron_fsdp layouts (Llama 3 70B FSDP64 mbs 2, 405B TP2 FSDP64 mbs 1 on DGX-GB200) fit in memory with
    the CPU activation offloading their recipes set (cpu_offloading_num_layers 40 of 80, 92 of 126: the csv's
    offload_layers) and not without it; the offloaded 70B layout pays for its copies over NVLink-C2C (its 225 GB/s
    per GPU each way does not carry a block's 3.6 GB within the block's forward), and `plan`, held to the published
    layout, offloads the fewest blocks that make it fit."""
    import csv
    from dataclasses import replace

    from paratrain.plan.api import Layout, estimate, search

    catalog = get_catalog()
    with bench.EVAL_CSV.open(encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r["set"] == "megatron_fsdp"]
    seen = set()
    for r in rows:
        key = (r["model"], r["nodes"], r["global_batch"], r["tp"], r["microbatch"])
        if key in seen:
            continue
        seen.add(key)
        system = bench._system(catalog, r["system"])
        lay = Layout(tp=int(r["tp"]), sp=int(r["tp"]) > 1, dp_kind="fsdp", zero_stage=3, microbatch=int(r["microbatch"]),
                     offload_layers=int(r["offload_layers"]))
        args = (r["model"], system, int(r["nodes"]), int(r["seq"]), int(r["global_batch"]))
        opts = bench._eval_options(system, r)
        with_offload = estimate(*args, lay, opts)
        without = estimate(*args, replace(lay, offload_layers=0), opts)
        assert with_offload.fits and not without.fits, (key, with_offload.memory_per_device_bytes / 2**30)
        if r["model"] == "llama3-70b":
            assert with_offload.time_breakdown_s["offload_exposed"] > 0
    r = next(r for r in rows if r["model"] == "llama3-70b" and r["global_batch"] == "256")
    system = bench._system(catalog, r["system"])
    found = search(r["model"], system, int(r["nodes"]), int(r["seq"]), int(r["global_batch"]), top=1,
                   options=bench._eval_options(system, r),
                   constraints={"tp": [1], "pp": [1], "microbatch": [2], "recompute": ["none"], "zero_stage": [3],
                                "dp_kind": ["fsdp"]}).candidates[0]
    n = found.layout.offload_layers
    assert found.fits and 0 < n <= int(r["offload_layers"])
    fewer = estimate(r["model"], system, int(r["nodes"]), int(r["seq"]), int(r["global_batch"]),
                     replace(found.layout, offload_layers=n - 1, pp_layers=None), bench._eval_options(system, r))
    assert not fewer.fits


def test_layout_decisions_count_misordered_pairs_and_the_regret_of_the_planners_pick(bench, tmp_path):
    """planner_accuracy.layout_decisions on a hand-made runs file: one job (model, system, nodes, seq, precision,
    software) with three layouts, one of them measured twice (averaged); pairs whose measured times differ by no more
    than RANK_TIE_PCT are ties; a pair the planner orders against the measurements is counted and listed; the regret
    is the measured time of the planner's first choice over the best measured one."""
    cols = ["set", *bench._JOB, *bench._LAYOUT, "measured", "unit", "source", "notes"]
    base = dict.fromkeys(cols, "")
    base.update(set="s", model="m", system="x", nodes="2", seq="4096", precision="bf16", global_batch="64", pp="1")
    layouts = [("1", "10"), ("2", "10"), ("4", "10"), ("4", "12"), ("8", "10")]
    path = tmp_path / "runs.csv"
    path.write_text(",".join(cols) + "\n" + "".join(
        ",".join({**base, "tp": tp, "measured": m}[c] for c in cols) + "\n" for tp, m in layouts))
    tokens = 64 * 4096
    # (label, predicted s, measured s, ..., tokens per step): tp 1 1.00 / 1.00, tp 2 0.97 / 1.02 (a tie measured),
    # tp 4 0.90 / 1.10 (two versions averaged: misordered against tp 1 and tp 2), tp 8 1.30 / 1.40
    pred = [1.00, 0.97, 0.90, 0.90, 1.30]
    meas = [1.00, 1.02, 1.08, 1.12, 1.40]
    sets = {"s": [(f"tp{tp}", p, m, "", "", "", 0, tokens) for (tp, _), p, m in zip(layouts, pred, meas, strict=True)]}
    d = bench.layout_decisions(path, sets)
    assert len(d["jobs"]) == 1 and len(d["jobs"][0]["layouts"]) == 4
    assert d["pairs"] == 5 and d["agree"] == 3  # tp1-tp2 a tie; tp4 ahead of tp1 and tp2 against the measurements
    assert d["regret_pct"] == [pytest.approx(10.0)]  # the planner picks tp 4: 1.10 measured against tp 1's 1.00


def test_the_planner_orders_published_layouts_of_one_job_as_measured(bench):
    """Decision quality on the evaluation runs (planner_accuracy's layout decisions): jobs measured with several
    layouts on one software release (the csv's stack / megatron_core / torch and a release its source names: Neuron
    SDK, NeMo container) are ordered as measured in at least 95% of pairs and the planner's first choice is within 3%
    of the best measured layout; across software releases of one job at least 89% of pairs, regret at most 11.5%;
    BLOOM's fp16 layout search, one job of 21 layouts, on its own line. At their addition (offloadstack, 6 Dec) 21/22
    and 2.4%, 26/29 and 11.0%; with BLOOM's bf16 layout search and the Neuron SDKs apart (layoutpairs) 25/26 and
    2.4% (12 jobs), 31/34 and 11.0% (21 jobs); the fp16 job (bloomfp16) 79/124, regret 0."""
    # guarded set by set, as the MAPE guards are: BLOOM's fp16 layout search (bloomfp16, 6 Dec) is one job of 21
    # layouts whose 124 pairs would outweigh every other job; its own line at its addition: 79/124 pairs (63.7%),
    # the planner's pick the fastest measured (regret 0); the pooled same-software line is printed, not guarded
    all_sets = bench.eval_sets(get_catalog())
    fp16 = bench.layout_decisions(bench.EVAL_CSV, {"bloom_search_fp16": all_sets["bloom_search_fp16"]})
    assert fp16["agree"] / fp16["pairs"] >= 0.63 and max(fp16["regret_pct"]) <= 1.0
    sets = {k: v for k, v in all_sets.items() if k != "bloom_search_fp16"}
    same = bench.layout_decisions(bench.EVAL_CSV, sets)
    assert same["agree"] / same["pairs"] >= 0.95 and max(same["regret_pct"]) <= 3.0
    loose = bench.layout_decisions(bench.EVAL_CSV, sets, bench._JOB[:5], by_release=False)
    assert loose["agree"] / loose["pairs"] >= 0.89 and max(loose["regret_pct"]) <= 11.5
    # vTrain's 109 multi-node runs: 4 jobs of 15-47 layouts each, many within a few per cent of each other; at its
    # addition 1063/1308 pairs (81.3%), regret mean 1.3% max 4.5%
    vt = bench.vtrain_decisions(bench.vtrain_cluster(get_catalog()))
    assert vt["agree"] / vt["pairs"] >= 0.81 and max(vt["regret_pct"]) <= 5.0
