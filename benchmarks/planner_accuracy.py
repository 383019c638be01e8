"""Planner accuracy on published training runs: CALIBRATION sets (constants were fitted on them) and EVALUATION
sets (never used to set a constant), reported apart, per set step-time MAPE and Spearman, and the signed errors
of the evaluation runs by layout kind (3D, FSDP/ZeRO-3, TP+FSDP, TP-only, DDP/ZeRO-1/2, CP), system and model size,
and the planner as a chooser (layout decisions): for every job measured with several layouts, whether the planner
orders them as measured and how much slower its first choice ran than the best published one (the regret).

    .venv/bin/python benchmarks/planner_accuracy.py                       # all sets, worst rows
    .venv/bin/python benchmarks/planner_accuracy.py --calibrate           # refit the A100 physical parameters
    .venv/bin/python benchmarks/planner_accuracy.py --calibrate-trainium  # refit Trainium1 on its NxD set
    .venv/bin/python benchmarks/planner_accuracy.py --calibrate-h100      # refit PyTorch-native stacks on Hopper
    .venv/bin/python benchmarks/planner_accuracy.py --calibrate-a100-pytorch  # ... and on A100
    .venv/bin/python benchmarks/planner_accuracy.py --calibrate-b200      # refit the B200 GEMM efficiency
    .venv/bin/python benchmarks/planner_accuracy.py --calibrate-h100-megatron  # refit the Hopper GEMM efficiency

Calibration data: benchmarks/data/published (see its README): Narayanan et al. 2021 Table 1 (step time = 96 B s l
h^2 (1 + s/6h + V/16lh) / (TFLOP/s x GPUs); microbatch and schedule not published: the planner's best for the
published tp/pp), Korthikanti et al. 2022 Table 5, vTrain single-node (1,440 Megatron runs, full recompute,
no bucketing; Megatron-era software: unfused attention, fp16 gradients, no DP overlap); and
benchmarks/data/calibration_runs.csv: torchtitan on one Grand Teton node (plan.stacks.PYTORCH_HOPPER_SCALE), the
public NeuronX Distributed figures of Llama 2 7B and Llama 3.1 8B over SDK 2.15-2.24 (Trainium1), and
Megatron-Bridge's Llama 3 8B on one DGX-B200 (FP8-CS and MXFP8, containers 25.09 and 25.11: the B200's GEMM
efficiency, --calibrate-b200; held out: eval_runs.csv nemo_b200), and Megatron-Core/NeMo on one DGX-H100
(megatron_h100_1node: dgxc-benchmarking's, Megatron-Bridge's and NeMo 24.07's 8-GPU rows, the Hopper GEMM
efficiency, --calibrate-h100-megatron; held out: every other H100 row).

Evaluation data: vTrain multi-node (benchmarks/planner_vtrain_multi.csv) and benchmarks/data/eval_runs.csv
(torchtitan H100/A100, NeMo / Megatron-Bridge DGX-H100, Llama 3 paper, Neuron trn1 NxD and neuronx-nemo-megatron,
MosaicML llm-foundry FSDP on H100/A100, BLOOM 176B and MT-NLG 530B: 3D + ZeRO-1 on 384-3,360 A100), one row per published run
with its source; fields marked "best" were not published and take the planner's best fitting choice. Each
run's software is its stack's (plan.stacks, as `plan --stack`), plus its precision, torch.compile and TP
overlap. A100 calibration (--calibrate): coordinate descent over five global A100 parameters minimising the
mean MAPE of the three A100 sets; values are written into hardware/catalog/*.toml by hand with the command as
their source.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import re
import sys
import time
from pathlib import Path

import numpy as np

from paratrain.config.names import DP_KINDS, RECOMPUTE
from paratrain.config.ranks import DEFAULT_RANK_ORDER
from paratrain.hardware.catalog import get_catalog
from paratrain.model.config import ModelConfig, gpt_config
from paratrain.plan.api import TIE_FRACTION, Layout, estimate, search
from paratrain.plan.options import Options
from paratrain.plan.software import Software, software_options
from paratrain.plan.step import SCHEDULES, evaluate

REF = Path(__file__).parent / "data" / "published"  # the published tables, with their sources (README.md there)
VOCAB = 51200
# Megatron-LM 2021-22: unfused attention, fp16 gradients, one all-reduce over the contiguous gradient buffer
# (its local DDP's allreduce_gradients; no buckets) after the backward, not overlapped with it (dp_overlap 0: the
# software of these runs; the A100 systems' own dp_overlap is what the hardware allows), and an eager Python loop
# whose host issues each kernel in MEGATRON_HOST_LAUNCH_S (Options.host_launch_s): small layers wait for it
MEGATRON_HOST_LAUNCH_S = 60e-6
MEGATRON = Options(attention="unfused", grad_bytes=2, bucket_bytes=float("inf"), dp_overlap=0.0,
                   host_launch_s=MEGATRON_HOST_LAUNCH_S)


def _rows(name: str) -> list[dict]:
    with (REF / name).open(encoding="utf-8-sig") as fh:
        return list(csv.DictReader(fh))


def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    return float(np.mean(np.abs(pred - meas) / meas) * 100)


def spearman(a, b) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


# ---- data sets ------------------------------------------------------------------------------------------
def narayanan(system) -> list[tuple[str, float, float]]:
    out = []
    for r in _rows("narayanan2021_table1.csv"):
        h, layers, heads = int(r["hidden"]), int(r["layers"]), int(r["heads"])
        tp, pp, gpus, gbs = int(r["tp"]), int(r["pp"]), int(r["gpus"]), int(r["global_batch"])
        s = 2048
        flops = 96 * gbs * s * layers * h * h * (1 + s / (6 * h) + VOCAB / (16 * layers * h))
        measured = flops / (float(r["achieved_tflops_per_gpu"]) * 1e12 * gpus)
        model = gpt_config(f"gpt-{r['params_B']}B", layers, h, heads, VOCAB, s)
        res = search(model, system, gpus // 8, s, gbs, top=1, options=MEGATRON, max_microbatch=8, any_stack=True,
                     constraints={"tp": [tp], "pp": [pp], "recompute": ["full"], "dp_kind": ["ddp"],
                                  "zero_stage": [0], "pp_schedule": ["1f1b", "interleaved_1f1b"] if pp > 1 else ["1f1b"],
                                  # Megatron-LM 2021 needed layers divisible by pp x v
                                  "virtual_stages": [v for v in range(1, 9) if layers % (pp * v) == 0]})
        pred = res.candidates[0].step_time_s if res.candidates else float("nan")
        out.append((f"{r['params_B']}B tp{tp} pp{pp} {gpus}gpu", pred, measured))
    return out


def korthikanti(system) -> list[tuple[str, float, float]]:
    out = []
    for r in _rows("korthikanti2022_table5.csv"):
        h, layers, heads = int(r["hidden"]), int(r["layers"]), int(r["heads"])
        tp, pp, gpus, gbs = int(r["tp"]), int(r["pp"]), int(r["gpus"]), int(r["global_batch"])
        mb, v = int(r["microbatch"]), int(r["interleave"])
        model = gpt_config(r["model"], layers, h, heads, VOCAB, 2048)
        sched = "interleaved_1f1b" if v > 1 else "1f1b"
        for label, rc, sp, col in (("full", "full", False, "iter_s_full_recompute"),
                                   ("sp+sel", "selective", True, "iter_s_sp_selective")):
            lay = Layout(tp=tp, pp=pp, sp=sp, microbatch=mb, recompute=rc, pp_schedule=sched, virtual_stages=v,
                         zero_stage=0)
            est = estimate(model, system, max(1, gpus // 8), 2048, gbs, lay, MEGATRON)
            out.append((f"{r['model']} {label}", est.step_time_s, float(r[col])))
    return out


def calculon_korthikanti() -> float:
    """MAPE of Calculon's own published predictions on the same Table 5 rows (for comparison)."""
    pred, meas = [], []
    for r in _rows("korthikanti2022_table5.csv"):
        pred += [float(r["calculon_pred_full"]), float(r["calculon_pred_spsel"])]
        meas += [float(r["iter_s_full_recompute"]), float(r["iter_s_sp_selective"])]
    return mape(pred, meas)


def vtrain(system) -> list[tuple[str, float, float]]:
    rows = _rows("vtrain_ground_truth_single.csv")
    groups: dict[tuple, list] = {}
    for r in rows:
        key = (int(r["hidden size"]), int(r["attention heads"]), int(r["# layers"]), int(r["sequence length"]),
               int(r["global batch"]))
        groups.setdefault(key, []).append(r)
    out = []
    for (h, heads, layers, s, gbs), rs in groups.items():
        model = gpt_config(f"gpt-h{h}-l{layers}", layers, h, heads, VOCAB, s)
        def col(name: str, rs=rs) -> np.ndarray:
            return np.array([int(r[name]) for r in rs])

        n = len(rs)
        res = evaluate(model, system, s, gbs, nodes=np.ones(n), tp=col("tensor parallelism"),
                       pp=col("pipeline parallelism"), dp=col("data parallelism"), cp=np.ones(n),
                       microbatch=col("micro batch"), sp=np.zeros(n, bool), recompute=np.full(n, RECOMPUTE.index("full")),
                       pp_schedule=np.full(n, SCHEDULES.index("1f1b")), virtual_stages=np.ones(n),
                       zero_stage=np.zeros(n, int), dp_kind=np.full(n, DP_KINDS.index("ddp")), opts=MEGATRON)
        # a single node: `nodes` = 1 but the run may use only 2 or 4 of its 8 GPUs; the model only needs the
        # layout, and all groups of these runs stay inside the NVLink domain.
        for r, pred in zip(rs, res["step_time_s"], strict=True):
            label = (f"h{h} L{layers} gbs{gbs} mb{r['micro batch']} tp{r['tensor parallelism']} "
                     f"dp{r['data parallelism']} pp{r['pipeline parallelism']}")
            out.append((label, float(pred), float(r["iteration time (ms)"]) / 1000.0))
    return out


def vtrain_cluster(catalog):
    """vTrain's multi-node cluster as its validation configs describe it (config/validation/multi/*.json):
    8 A100 per node, "inter_node_bandwidth": 800 (Gbps) -> a DGX A100 entry with a 100 GB/s scale-out link."""
    base = catalog.system("dgx-a100-80gb")
    net = dataclasses.replace(base.tiers[-1].interconnect, name="vtrain-800g", bw_gbytes_per_s=100.0)
    return dataclasses.replace(base, name="vtrain-a100-800g",
                               tiers=(*base.tiers[:-1], dataclasses.replace(base.tiers[-1], interconnect=net)))


def vtrain_multi(system) -> list[tuple[str, float, float]]:
    """Held out (never used for calibration): vTrain data/ground_truth_multi.csv, 109 Megatron-DeepSpeed runs
    on 64-512 A100 (3.6B-175B), copied to benchmarks/planner_vtrain_multi.csv from VIA-Research/vTrain @f8dda84."""
    out = []
    with (Path(__file__).parent / "planner_vtrain_multi.csv").open(encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            h, heads, layers = int(r["hidden size"]), int(r["attention heads"]), int(r["# layers"])
            s, gbs, gpus = int(r["sequence length"]), int(r["global batch"]), int(r["# GPUs"])
            tp, dp, pp, mb = (int(r[k]) for k in ("tensor parallelism", "data parallelism", "pipeline parallelism",
                                                 "micro batch"))
            model = gpt_config(f"gpt-{r['Parameters (billion)']}B", layers, h, heads, VOCAB, s)
            lay = Layout(tp=tp, pp=pp, dp=dp, microbatch=mb, recompute="full", zero_stage=0)
            est = estimate(model, system, gpus // 8, s, gbs, lay, MEGATRON)
            out.append((f"{r['Parameters (billion)']}B mb{mb} tp{tp} dp{dp} pp{pp}", est.step_time_s,
                        float(r["iteration time (ms)"]) / 1000.0))
    return out


class _Swapped:
    """A catalog whose systems built on `chip` (a chip name, or a collection of names that share the values: the
    Hopper parts) use the given efficiency parameters (matmul_eff_max, kernel_overhead_s, memory_bw_eff; link_bw_eff
    for the links whose name starts with `link_prefix`), frozen dataclasses replaced; the built-in catalog is
    untouched. Default: Trainium1 and its NeuronLink."""

    def __init__(self, catalog, values: dict, chip="trainium1", link_prefix: str = "neuronlink"):
        self.catalog, self.values, self.link_prefix = catalog, values, link_prefix
        self.chip_names = {chip} if isinstance(chip, str) else set(chip)

    def chip(self, name: str):
        return self.catalog.chip(name)

    def system(self, name: str):
        base = self.catalog.system(name)
        if base.chip.name not in self.chip_names:
            return base
        v = self.values
        eff = dataclasses.replace(base.chip.efficiency, **{k: v[k] for k in CHIP_EFFICIENCY if k in v})
        tiers = tuple(dataclasses.replace(t, interconnect=dataclasses.replace(t.interconnect, bw_eff=v["link_bw_eff"]))
                      if "link_bw_eff" in v and t.interconnect.name.startswith(self.link_prefix) else t
                      for t in base.tiers)
        return dataclasses.replace(base, chip=dataclasses.replace(base.chip, efficiency=eff), tiers=tiers)


CHIP_EFFICIENCY = ("matmul_eff_max", "kernel_overhead_s", "memory_bw_eff")  # the chip's [efficiency] block


TRN_PARAMS = {
    "matmul_eff_max": [0.45, 0.5, 0.55, 0.6, 0.64, 0.7, 0.75],
    "kernel_overhead_s": [2e-6, 4e-6, 8e-6, 16e-6, 32e-6],
    "memory_bw_eff": [0.5, 0.6, 0.7, 0.8, 0.9],
    "link_bw_eff": [0.8],  # not fitted: three rows do not separate the link from the chip (docs/planner.md)
}


def calibrate_trainium(catalog, rounds: int = 2) -> None:
    """Coordinate descent over TRN_PARAMS minimising the MAPE of the Trn1 calibration set (calibration_runs.csv,
    set neuron_trn1_nxd: the public NeuronX Distributed figures of Llama 2 7B (SDK 2.15 and later) and Llama 3.1 8B (SDK 2.24); the other Trn1 figures (neuronx-nemo-megatron, other models) are evaluation)."""
    sys0 = catalog.system("trn1.32xlarge")
    values = {"matmul_eff_max": sys0.chip.efficiency.matmul_eff_max,
              "kernel_overhead_s": sys0.chip.efficiency.kernel_overhead_s,
              "memory_bw_eff": sys0.chip.efficiency.memory_bw_eff, "link_bw_eff": sys0.tiers[1].interconnect.bw_eff}

    def objective(vals):
        rows = eval_sets(_Swapped(catalog, vals), CAL_CSV)["neuron_trn1_nxd"]
        return mape([r[1] for r in rows], [r[2] for r in rows])
    best = objective(values)
    for r in range(rounds):
        for name, grid in TRN_PARAMS.items():
            for candidate in grid:
                trial = {**values, name: candidate}
                obj = objective(trial)
                if obj < best - 1e-9:
                    best, values = obj, trial
            print(f"round {r + 1} {name}: MAPE {best:.2f}% {values}", file=sys.stderr)
    held = eval_sets(_Swapped(catalog, values))["neuron_trn1"]
    print(f"trainium1 calibrated: {values} -> calibration MAPE {best:.2f}%, held-out "
          f"{mape([r[1] for r in held], [r[2] for r in held]):.2f}%")


def calibrate_pytorch_scale(catalog, attr: str = "PYTORCH_HOPPER_SCALE", data_set: str = "torchtitan_h100_1node",
                            grid=np.round(np.arange(0.55, 1.01, 0.01), 2)) -> float:
    """Grid over a PyTorch-native GEMM scale of plan.stacks (PYTORCH_HOPPER_SCALE on torchtitan_h100_1node,
    PYTORCH_AMPERE_SCALE on mosaic_a100_1node) minimising the MAPE of that calibration set, the only rows it is
    fitted on (patched for the search only)."""
    from unittest import mock

    import paratrain.plan.stacks as stacks

    results = []
    for scale in grid:
        with mock.patch.object(stacks, attr, float(scale)):
            rows = eval_sets(catalog, CAL_CSV)[data_set]
        results.append((mape([r[1] for r in rows], [r[2] for r in rows]), float(scale)))
    best, scale = min(results)
    print(f"{attr} calibrated: {scale} -> {data_set} MAPE {best:.2f}% (catalog value {getattr(stacks, attr)})")
    return scale


B200_MATMUL_EFF = np.round(np.arange(0.40, 0.81, 0.01), 2)  # grid of the B200 GEMM efficiency


def calibration_set_mape(cat, name: str, rows_filter=None) -> float:
    """MAPE of calibration_runs.csv's set `name` on catalog `cat` (the rows `rows_filter(label)` keeps: all by
    default)."""
    rows = [r for r in eval_sets(cat, CAL_CSV)[name] if rows_filter is None or rows_filter(r[0])]
    return mape([r[1] for r in rows], [r[2] for r in rows])


def all_set_mapes(cat) -> dict[str, float]:
    """{set: step-time MAPE} of every set of both runs files (calibration and evaluation) on catalog `cat`."""
    sets = {**eval_sets(cat, CAL_CSV), **eval_sets(cat)}
    return {k: mape([r[1] for r in rows], [r[2] for r in rows]) for k, rows in sets.items()}


def calibrate_b200(catalog) -> dict:
    """Grid over the B200's matmul_eff_max (its GEMMs' achieved fraction of the peak of the precision they run
    in) minimising the MAPE of the calibration set nemo_b200_1node (calibration_runs.csv: Megatron-Bridge's
    Llama 3 8B on one DGX-B200, FP8-CS and MXFP8, containers 25.09 and 25.11). One parameter: four rows of one
    layout cannot separate the per-kernel cost or the HBM efficiency from it (kept at their H100 values).
    Prints the held-out B200 set (eval_runs.csv nemo_b200: Llama 3.1 405B on 128 GPUs, NeMo 25.02's 8B/70B/
    405B/GPT-3 175B) at the fitted value; returns {set: MAPE} before and after for every csv set."""
    best, eff = min((calibration_set_mape(_Swapped(catalog, {"matmul_eff_max": float(e)}, chip="b200"),
                                          "nemo_b200_1node"), float(e)) for e in B200_MATMUL_EFF)
    before, after = all_set_mapes(catalog), all_set_mapes(_Swapped(catalog, {"matmul_eff_max": eff}, chip="b200"))
    print(f"b200 matmul_eff_max calibrated: {eff} -> nemo_b200_1node MAPE {best:.2f}%, held-out nemo_b200 "
          f"{after['nemo_b200']:.2f}% (catalog value {catalog.chip('b200').efficiency.matmul_eff_max}: "
          f"{before['nemo_b200_1node']:.2f}% / {before['nemo_b200']:.2f}%)")
    for name in before:
        print(f"  {name:<24} MAPE {before[name]:6.2f}% -> {after[name]:6.2f}%")
    return {"matmul_eff_max": eff, "before": before, "after": after}


HOPPER_MATMUL_EFF = np.round(np.arange(0.55, 0.81, 0.01), 2)  # grid of the Hopper GEMM efficiency
H100_SET = "megatron_h100_1node"


def h100_set_mape(catalog, eff: float, rows_filter=None) -> float:
    """MAPE of the calibration set megatron_h100_1node with every Hopper chip's matmul_eff_max at `eff` (the
    rows `rows_filter(label)` keeps: all by default)."""
    from paratrain.plan.stacks import HOPPER_CHIPS

    return calibration_set_mape(_Swapped(catalog, {"matmul_eff_max": float(eff)}, chip=HOPPER_CHIPS), H100_SET,
                                rows_filter)


def calibrate_h100_megatron(catalog) -> dict:
    """Grid over the Hopper matmul_eff_max (H100 SXM, and the parts that inherit it: plan.stacks.HOPPER_CHIPS, the
    same SMs) minimising the MAPE of the calibration set megatron_h100_1node (calibration_runs.csv: Megatron-Core on
    one 8-GPU DGX-H100, no network term: dgxc-benchmarking's Llama 3.1 8B CP2 BF16/FP8 on NeMo 24.09 and 24.12,
    Megatron-Bridge's Llama 3 8B FP8 on 25.09/25.11, NeMo 24.07's Llama 2 7B and Llama 3 8B FP8). One parameter for
    both precisions: the BF16 rows are one layout (two containers), which cannot fit a second one; the best value of
    each precision's rows alone is printed as a diagnostic, not used. PyTorch-native stacks multiply this value by
    plan.stacks.PYTORCH_HOPPER_SCALE, fitted on torchtitan_h100_1node: it is refit at the fitted value (the same
    grid search as --calibrate-h100) before every set is reported before -> after. Returns {"matmul_eff_max",
    "pytorch_hopper_scale", "before", "after"}."""
    from unittest import mock

    import paratrain.plan.stacks as stacks

    results = [(h100_set_mape(catalog, eff), float(eff)) for eff in HOPPER_MATMUL_EFF]
    best, eff = min(results)
    for name, keep in (("bf16", lambda label: label.endswith(" bf16")), ("fp8", lambda label: label.endswith(" fp8"))):
        alone = min((h100_set_mape(catalog, e, keep), float(e)) for e in HOPPER_MATMUL_EFF)
        print(f"  diagnostic, {name} rows alone: best {alone[1]} ({alone[0]:.2f}%)")
    swapped = _Swapped(catalog, {"matmul_eff_max": eff}, chip=stacks.HOPPER_CHIPS)
    scale = calibrate_pytorch_scale(swapped)
    before = all_set_mapes(catalog)
    with mock.patch.object(stacks, "PYTORCH_HOPPER_SCALE", scale):
        after = all_set_mapes(swapped)
    print(f"hopper matmul_eff_max calibrated: {eff} -> {H100_SET} MAPE {best:.2f}% (catalog value "
          f"{catalog.chip('h100').efficiency.matmul_eff_max}: {before[H100_SET]:.2f}%); PYTORCH_HOPPER_SCALE refit "
          f"{stacks.PYTORCH_HOPPER_SCALE} -> {scale}")
    for name in before:
        print(f"  {name:<24} MAPE {before[name]:6.2f}% -> {after[name]:6.2f}%")
    return {"matmul_eff_max": eff, "pytorch_hopper_scale": scale, "before": before, "after": after}


# ---- evaluation data (benchmarks/data/eval_runs.csv): never used to set a constant ------------------------
EVAL_CSV = Path(__file__).parent / "data" / "eval_runs.csv"
GPT3 = {"gpt3-175b": (96, 12288, 96), "gpt3-6.7b": (32, 4096, 32),  # layers, hidden, heads (Brown et al. 2020)
        # neuronx-nemo-megatron nemo/examples/nlp/language_modeling/gpt_23b.sh, gpt_46b.sh (FFN 4h, GPT-2 vocabulary)
        "gpt3-23b": (28, 8192, 64), "gpt3-46b": (56, 8192, 64)}
CHOICES = {"recompute": ["none", "selective", "full"], "schedule": ["1f1b", "interleaved_1f1b"],
           "microbatch": [1, 2, 4, 8], "vp": [1, 2, 4, 8]}


# MosaicML MPT (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): GPT blocks (LayerNorm, 4h GeLU MLP), tied
# embeddings, vocabulary 50,368; layers, d_model, heads. Checked against the benchmark table's NumParams column
# (12 L h^2 + V h + seq h: 6,658,859,008 for 7b at seq 2048, 64,862,437,376 for 70b)
MPT = {"mpt-1b": (24, 2048, 16), "mpt-3b": (32, 2560, 32), "mpt-7b": (32, 4096, 32), "mpt-13b": (40, 5120, 40),
       "mpt-30b": (48, 7168, 64), "mpt-70b": (80, 8192, 64)}
MPT_VOCAB = 50368


# Nemotron-4 (Parmar et al. 2024, Nemotron-4 15B Technical Report, Table 1; NVIDIA 2024, Nemotron-4 340B Technical
# Report, Table 1): layers, hidden, heads, with 8 KV heads, vocabulary 256,000, untied embeddings, RoPE, and a
# non-gated squared-ReLU MLP of 4h. Stand-in: the llama block with a SwiGLU of width 8h/3, the same MLP parameters
# and matmul FLOPs (3 x h x 8h/3 = 2 x h x 4h); its elementwise traffic (gate x up) differs slightly
NEMOTRON = {"nemotron4-15b": (32, 6144, 48), "nemotron4-340b": (96, 18432, 96)}


# Megatron-DeepSpeed GPT shapes of two published 3D + ZeRO-1 runs (set fsdp_scale): layers, hidden, heads, vocabulary.
# BLOOM 176B (bigscience-workshop/bigscience train/tr11-176B-ml/README.md @00327f8: NLAYERS 70, NHIDDEN 14336, NHEADS
# 112, padded vocabulary 250,880 "v*h: 250880*14336"; tied embeddings, 4h GeLU MLP, ALiBi instead of position
# embeddings). MT-NLG 530B (Smith et al. 2022, arXiv 2201.11990 sec. 2.4 / cli99/llm-analysis
# examples/megatron-turing-nlg/README.md @b60b392: 105 layers, hidden 20480, 128 heads, FFN 4h; the GPT-2 BPE padded
# to Megatron's 51,200)
# BLOOM's pre-launch layout search (bigscience-workshop/bigscience train/tr11-176B-ml/chronicles-prequel.md @00327f8,
# "Rebalancing layers", 02-28): candidate shapes with NHEADS 64, named by the size the table prints: "NHIDDEN=14336;
# NLAYERS=70" (176B, BLOOM's shape with 64 instead of 112 heads), "NHIDDEN=13312; NLAYERS=82" (178B), "HIDDEN=12288;
# NLAYERS=100" (184B); vocabulary as BLOOM's ("VOCAB_LENGTH=250k" in that file; 250,880 padded, README); and the
# 02-25 fp16 tables' shape ("GBS Variations": "NLAYERS=72 NHIDDEN=14336 NHEADS=64", 181B), the same vocabulary
MEGATRON_DEEPSPEED = {"bloom-176b": (70, 14336, 112, 250880), "mt-nlg-530b": (105, 20480, 128, VOCAB),
                      "bloom-64h-176b": (70, 14336, 64, 250880), "bloom-64h-178b": (82, 13312, 64, 250880),
                      "bloom-64h-184b": (100, 12288, 64, 250880), "bloom-64h-181b": (72, 14336, 64, 250880)}


# InternLM 7B (InternLM/InternLM configs/7B_sft.py @c18bec9: HIDDEN_SIZE 4096, NUM_ATTENTION_HEAD 32, NUM_LAYER 32,
# MLP_RATIO 8/3, VOCAB_SIZE 103168; internlm/model/linear.py FeedForward: SwiGLU, width rounded up to a multiple of
# 256: int(4096 x 8/3) = 10922 -> 11008; modeling_internlm.py: RMSNorm, rotary, full multi-head attention, an
# untied output head): layers, hidden, heads, FFN width, vocabulary
INTERNLM = {"internlm-7b": (32, 4096, 32, 11008, 103168)}


# OPT-175B (Zhang et al. 2022, arXiv 2205.01068, Table 1: 96 layers, 96 heads, embedding 12288; facebookresearch/
# metaseq metaseq/launcher/opt_job_constants.py @f2cd367 "175b": Size(96, 12288, 96, 128, ...), ffn_size 4 x
# emb_size; opt_baselines.py: --share-decoder-input-output-embed, learned positions, ReLU): a GPT block with tied
# embeddings; the GPT-2 BPE vocabulary as the released OPT checkpoints carry it (facebook/opt-* config.json
# vocab_size 50272): layers, hidden, heads, vocabulary
OPT = {"opt-175b": (96, 12288, 96, 50272)}


def _eval_model(name: str, seq: int):
    if name in INTERNLM:
        layers, hidden, heads, ffn, vocab = INTERNLM[name]
        return ModelConfig(name=name, arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                           ffn_hidden=ffn, vocab=vocab, max_seq=seq)
    if name in MEGATRON_DEEPSPEED or name in OPT:
        layers, hidden, heads, vocab = {**MEGATRON_DEEPSPEED, **OPT}[name]
        return ModelConfig(name=name, arch="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                           max_seq=seq, tie_embeddings=True)
    if name in NEMOTRON:
        layers, hidden, heads = NEMOTRON[name]
        return ModelConfig(name=name, arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=8,
                           ffn_hidden=8 * hidden // 3, vocab=256000, max_seq=seq)
    if name in GPT3:
        layers, hidden, heads = GPT3[name]
        return gpt_config(name, layers, hidden, heads, VOCAB, seq)
    if name in MPT:
        layers, hidden, heads = MPT[name]
        return ModelConfig(name=name, arch="gpt", layers=layers, hidden=hidden, heads=heads, vocab=MPT_VOCAB,
                           max_seq=seq, tie_embeddings=True)
    return name


# Clusters of published runs that no catalog system describes, built from one that differs only in the named part
DERIVED_SYSTEMS = {
    # MosaicML's "A100 40GB with 1600 Gbps node-node interconnect (RoCE)": 8 x 200 Gb/s per node, as DGX A100
    "a100-40gb-1600g": ("dgx-a100-80gb", "a100-40gb"),
}


def _system(catalog, name: str):
    if name not in DERIVED_SYSTEMS:
        return catalog.system(name)
    base, chip = DERIVED_SYSTEMS[name]
    return dataclasses.replace(catalog.system(base), name=name, chip=catalog.chip(chip))


def _eval_options(system, r: dict) -> Options:
    """The software of the run, as `paratrain estimate` / `plan` flags name it (plan.software: the one mapping to
    Options, so each column below moves an estimate as its flag does): its stack's defaults (plan.stacks, the same
    as `plan --stack`), plus what the row names. Empty columns: the stack's."""
    return software_options(system, Software(
        stack=r["stack"], attention=r["attention"],  # --stack, --attention
        # precision (--fp8, --bf16-sr; mxfp8: --fp8-recipe mxfp8, FP8 with MX block scaling, what the Blackwell
        # tables call MXFP8 / FP8-MX); fp8 is per-tensor current scaling (FP8-CS) unless the chip's FP8 is
        # block-scaled only. fp8_recipe (--fp8-recipe): "delayed" where the run's config names FP8 delayed scaling
        # (Transformer Engine's DelayedScaling: NeMo 1.0's fp8_hybrid with an amax history)
        fp8=r["precision"] == "fp8", bf16_sr=r["precision"] == "bf16sr",
        fp8_recipe="mxfp8" if r["precision"] == "mxfp8" else r.get("fp8_recipe") or None,
        # attention_kernel (--attention-kernel): where the run's launcher overrode its stack's attention kernel
        # (NeMo-Framework-Launcher 24.03-24.07: NVTE_FUSED_ATTN=0, so Transformer Engine ran flash-attn 2: "fa2")
        attention_kernel=r.get("attention_kernel") or None,
        # cross_entropy (--cross-entropy): the loss kernel the run's config names (NeMo 1.0's
        # cross_entropy_loss_fusion: true runs Megatron-Core's fused_vocab_parallel_cross_entropy: "mcore_fused")
        cross_entropy=r.get("cross_entropy") or None,
        # bucket_mb (--grad-bucket-mb): the gradient bucket the run's optimizer names, MiB of its gradient dtype per
        # collective call (Apex DistributedFusedAdam's bucket_cap_mb, as NeMo 1.0's distributed_fused_adam passes it)
        grad_bucket_mb=float(r["bucket_mb"]) if r.get("bucket_mb") else None,
        # reduce_bytes (--grad-bytes): bytes per gradient element reduced where the run names its reduce dtype (FSDP
        # MixedPrecision reduce_dtype=bfloat16: 2)
        grad_bytes=int(r["reduce_bytes"]) if r.get("reduce_bytes") else None,
        # dp_overlap (--dp-overlap): where the run's software reduces gradients only after the backward (Megatron-LM
        # 2021's local DDP, as the Neuron reference port runs it: 0); empty = the system's
        dp_overlap=float(r["dp_overlap"]) if r.get("dp_overlap") else None,
        # cp_comm (--cp-comm): the context-parallel K/V exchange where the run names one (Llama 3's all-gather)
        cp_comm=r.get("cp_comm") or None,
        # softmax_fused (--unfused-softmax): 0 where the run's unfused attention softmax was not one fused kernel
        # (neuronx-nemo-megatron before its 2.18 release: no NEURON_FUSE_SOFTMAX, masked_softmax_fusion False)
        fused_softmax=False if r.get("softmax_fused") == "0" else None,
        # compile (--torch-compile): eager PyTorch for torchtitan without torch.compile; the other stacks' kernels
        # are fused either way
        torch_compile=not (r["stack"] == "fsdp2" and r["compile"] == "0"),
        # tp_overlap (--tp-comm-overlap): TP comm overlap where the run names it (async TP / TE userbuffers)
        tp_comm_overlap=r["tp_overlap"] == "1",
        # recompute "selective_mlp" (--recompute-mlp): selective recompute that also replays the MLP block
        recompute_mlp=r["recompute"] == "selective_mlp",
        # recompute "selective_layer" (--recompute full --recompute-every 2): torchtitan's selective layer AC at its
        # default selective_ac_option "2", every other block fully checkpointed (config_manager.py at 0413364)
        recompute_every=2 if r["recompute"] == "selective_layer" else None,
        # zero1_grad_allreduce (--zero1-grad-allreduce): ZeRO-1 that all-reduces the whole gradient buffer (DeepSpeed's
        # BF16_Optimizer, bf16 with ZeRO stage 0 in the DeepSpeed config: BLOOM's)
        zero1_grad_allreduce=True if r.get("zero1_grad_allreduce") == "1" else None,
        # zero1_fp16_allreduce (--zero1-fp16-allreduce): DeepSpeed's fp16 ZeRO-1 (DeepSpeedZeroOptimizer, stage 1,
        # v0.5.10-v0.6.0): fp16 buckets all-reduced, autograd's fp16 accumulation (BLOOM's 02-25 rows)
        zero1_fp16_allreduce=True if r.get("zero1_fp16_allreduce") == "1" else None,
        # last_bucket_after_backward (--last-bucket-after-backward): the gradient all-reduce follows the backward
        # bucket by bucket, the last after it (InternLM's HybridZeroOptimizer: zero1_1k's rows)
        last_bucket_after_backward=True if r.get("last_bucket_after_backward") == "1" else None,
        # optimizer_dtype (--bf16-optimizer): "bf16" where the run's optimizer keeps bf16 Adam states and no fp32
        # master copy (NeMo's distributed_fused_adam with optim.dtype bf16: Nemotron-4 340B's dgxc_h100 BF16 rows)
        bf16_optimizer=True if r.get("optimizer_dtype") == "bf16" else None,
        # "fp32_remainders" / "bf16_master" (--optimizer-state): NeMo v2.0.0's distributed_fused_adam over bf16
        # weights keeps 16-bit param remainders, not an fp32 master (the dgxc_h100 BF16 rows with the fp32 default
        # dtype); with fp8_params and optim.dtype bf16 a bf16 master (Nemotron-4 340B's FP8 rows): precision.
        # OPTIMIZER_STATE_BYTES
        optimizer_state=r.get("optimizer_dtype") if r.get("optimizer_dtype") in ("fp32_remainders", "bf16_master")
        else None,
        # dropout (--no-dropout): 0 where the run sets attention and hidden dropout to 0 (the Neuron Megatron-LM
        # reference's --attention-dropout 0 --hidden-dropout 0): the GPT count keeps no masks
        dropout=False if r.get("dropout") == "0" else None,
        # distribute_saved (--distribute-saved-activations): 1 where full recompute splits the checkpointed block
        # inputs over the TP group (metaseq's --distribute-checkpointed-activations: OPT-175B's fsdp_1k row)
        distribute_saved_activations=True if r.get("distribute_saved") == "1" else None,
        # overlap_param_gather (--param-gather-in-step): 0 where the run turned Megatron-Core's overlap_param_gather
        # off (Megatron-Bridge 0.2.0's 405B MXFP8 configs): the parameter all-gather is exposed in the optimizer step
        param_gather_in_step=True if r.get("overlap_param_gather") == "0" else None,
        # megatron_core (--megatron-core): the container's megatron-core release where established (Megatron-Bridge
        # docs/releases/software-versions.md, its 3rdparty/Megatron-LM pin); empty: before 0.18
        megatron_core=r.get("megatron_core") or None,
        # torch (--torch): the run's torch release where it predates checkpoint early stop (2.1): MosaicML's
        # llm-foundry image mosaicml/pytorch:2.0.1_cu118 (sweep.sh): its recomputed blocks rerun whole
        torch=r.get("torch") or None))


def _best_published(model, system, nodes, seq, gbs, fixed, free, opts):
    """The fastest fitting estimate over the choices a run does not publish ("best" in the csv), every other
    field as published. Stages split as the runtime's default splits them (Megatron, NxD and torchtitan
    balance layers unless told otherwise; none of these runs says otherwise), not the planner's uneven split.
    gbs None (global batch "best": a run that publishes neither its local nor its global batch): one microbatch
    per data-parallel rank per step (torchtitan's default, no gradient accumulation), its size the best choice."""
    pick = lambda key: CHOICES[key] if free[key] == "best" else [free[key]]  # noqa: E731
    dp = nodes * system.devices_per_node // (fixed["tp"] * fixed["pp"] * fixed["cp"])
    best = None
    for rc, sched, mb, vp in itertools.product(pick("recompute"), pick("schedule"), pick("microbatch"), pick("vp")):
        mb, vp = int(mb), int(vp)
        if fixed["pp"] == 1 and (sched != "1f1b" or vp > 1) or (sched == "1f1b") != (vp == 1):
            continue
        try:
            lay = Layout(**fixed, microbatch=mb, recompute=rc, pp_schedule=sched, virtual_stages=vp, pp_layers="balanced")
            est = estimate(model, system, nodes, seq, gbs or mb * dp, lay, opts)
        except ValueError:  # a choice the published fields do not allow (microbatch vs batch, stages vs layers)
            continue
        # the fastest in tokens/s (the same as the shortest step where the global batch is published)
        if est.fits and (best is None or est.tokens_per_s > best.tokens_per_s):
            best = est
    return best


def _megatron2021_flops(model, gbs: int, seq: int) -> float:
    """FLOPs of one step as Narayanan et al. 2021 (sec. 5.1, eq. 3) count them for a GPT model with full activation
    recompute: 96 B s l h^2 (1 + s / 6h + V / 16 l h), the count behind its Table 1's (and narayanan() above)."""
    h, layers = model.hidden, model.layers
    return 96 * gbs * seq * layers * h * h * (1 + seq / (6 * h) + model.vocab / (16 * layers * h))


def _eval_row(catalog, r: dict):
    """(label, predicted step time, measured step time, kind, system, model) of one published run."""
    system = _system(catalog, r["system"])
    seq, nodes = int(r["seq"]), int(r["nodes"])
    gbs = None if r["global_batch"] == "best" else int(r["global_batch"])
    model = _eval_model(r["model"], seq)
    fsdp = r["dp_kind"] in ("fsdp", "hsdp")  # hsdp: sharded inside a node, replicated across nodes
    # sp, zero_stage: where the run names them (a pre-SP Megatron-LM without a distributed optimizer: 0, 0; FSDP
    # that does not reshard after forward, Llama 3's: 2); empty = SP with TP, ZeRO-1 (ZeRO-3 for FSDP)
    fixed = {"tp": int(r["tp"]), "pp": int(r["pp"]), "cp": int(r["cp"]),
             "sp": r["sp"] == "1" if r.get("sp") else int(r["tp"]) > 1, "dp_kind": r["dp_kind"],
             "zero_stage": int(r["zero_stage"]) if r.get("zero_stage") else 3 if fsdp else 1,
             # rank_order (parallel.rank_order): how the run's ranks map onto tp, cp, dp, pp where it differs from
             # the default tp-cp-dp-pp (Llama 3's [TP, CP, PP, DP]: tp-cp-pp-dp); empty = the default
             "rank_order": r.get("rank_order") or DEFAULT_RANK_ORDER,
             # offload_layers (--offload-layers): the blocks whose activations the run keeps in host memory
             # (Megatron-Core's cpu_offloading_num_layers, as the recipe sets it); empty = none
             "offload_layers": int(r["offload_layers"]) if r.get("offload_layers") else 0}
    # "selective_mlp": selective recompute that also replays the MLP block (Options.recompute_mlp)
    free = {k: r[k] for k in ("recompute", "schedule", "microbatch", "vp")}
    free["recompute"] = {"selective_mlp": "selective", "selective_layer": "full"}.get(free["recompute"], free["recompute"])
    opts = _eval_options(system, r)
    if "best" in free.values() or gbs is None:  # not published: the planner's best fitting choice for the published fields
        est = _best_published(model, system, nodes, seq, gbs, fixed, free, opts)
    else:
        lay = Layout(**{k: v for k, v in fixed.items()}, microbatch=int(r["microbatch"]), recompute=free["recompute"],
                     pp_schedule=r["schedule"], virtual_stages=int(r["vp"]), pp_layers="balanced")
        est = estimate(model, system, nodes, seq, gbs, lay, opts)
    devices = nodes * system.devices_per_node
    gbs = gbs or (est.global_batch if est else 1)  # "best": the batch of the chosen estimate
    value = float(r["measured"])
    if r["unit"] == "tokens_per_s_per_device":
        measured = gbs * seq / (value * devices)
    elif r["unit"] == "seq_per_s":
        measured = gbs / value
    elif r["unit"] == "step_time_s":  # the run's published seconds per iteration
        measured = value
    elif r["unit"] == "model_tflops_per_device":  # causal attention count (Megatron-Bridge's MODEL_TFLOP/s/GPU)
        measured = (est.model_flops_per_step if est else float("nan")) / (value * 1e12 * devices)
    elif r["unit"] == "megatron2021_tflops_per_device":  # Narayanan et al. 2021 eq. 3, full recompute counted
        measured = _megatron2021_flops(model, gbs, seq) / (value * 1e12 * devices)
    else:  # model TFLOP/s per device, full-square attention count
        measured = (est.model_flops_full_attention_per_step if est else float("nan")) / (value * 1e12 * devices)
    fsdp = fsdp and fixed["zero_stage"] >= 2  # hsdp with zero_stage 1 (InternLM's hybrid ZeRO-1) replicates parameters
    kind = ("CP" if int(r["cp"]) > 1 else "FSDP/ZeRO-3" if fsdp and int(r["pp"]) == 1 and int(r["tp"]) == 1
            else "3D" if int(r["pp"]) > 1 else "TP+FSDP" if fsdp else "TP-only" if int(r["tp"]) > 1
            else "DDP/ZeRO-1/2")  # tp 1, replicated parameters: data parallelism alone
    size = (model.num_params() if not isinstance(model, str) else None)
    label = f"{r['model']} {r['system']} {devices}dev tp{r['tp']} pp{r['pp']} cp{r['cp']} {r['dp_kind']} {r['precision']}"
    return (label, est.step_time_s if est else float("nan"), measured, kind, r["system"], r["model"], size, gbs * seq)


CAL_CSV = Path(__file__).parent / "data" / "calibration_runs.csv"


def rows_by_set(path: Path, predict_row) -> dict[str, list[tuple]]:
    """`predict_row(row)` for each row of a runs file, grouped by data set (the csv's `set` column)."""
    with path.open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    sets: dict[str, list[tuple]] = {}
    for r in rows:
        sets.setdefault(r["set"], []).append(predict_row(r))
    return sets


def eval_sets(catalog, path: Path = EVAL_CSV) -> dict[str, list[tuple]]:
    """The rows of a runs file, predicted, grouped by data set."""
    return rows_by_set(path, lambda r: _eval_row(catalog, r))


# columns that differ between measurements of one layout on several software versions (SDK, container)
_NOT_LAYOUT = {"measured", "unit", "source", "notes"}


def version_spread_floor(path: Path, sets: dict[str, list[tuple]]) -> dict[str, dict]:
    """The error no model can beat on a runs file: rows that agree on every column but the measurement and its source
    (one layout measured on several SDK versions or containers) get one prediction each, so the best a model can do on
    them is the constant that minimises their mean relative error (a point of the set of measured step times: the
    objective is piecewise linear and convex). Returns, per set with such repeats, {"floor_pct": that best MAPE over
    the whole set (a layout measured once counts as 0), "spread_pct": the widest max/min - 1 of one layout,
    "layouts": distinct layouts, "rows": rows}; `sets` are the predicted rows (measured step time at index 2)."""
    with path.open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    out = {}
    for name, predicted in sets.items():
        groups: dict[tuple, list[float]] = {}
        for r, p in zip((r for r in rows if r["set"] == name), predicted, strict=True):
            groups.setdefault(tuple((k, v) for k, v in r.items() if k not in _NOT_LAYOUT), []).append(float(p[2]))
        if len(groups) == len(predicted):
            continue
        errors = []
        for meas in groups.values():
            m = np.asarray(meas)
            errors += list(min((np.abs(c - m) / m for c in m), key=np.sum))
        out[name] = {"floor_pct": float(np.mean(errors) * 100), "layouts": len(groups), "rows": len(predicted),
                     "spread_pct": max(float((max(g) / min(g) - 1) * 100) for g in groups.values())}
    return out


# ---- decision quality: does the planner order the layouts one job was measured with as the measurements do? ----
# Two layouts whose measured time per token differs by less than this are a tie: below the spread of one layout
# measured on several containers or SDKs (version_spread_floor's widest spreads are 2-27%), so no order is claimed;
# the planner's own tie (plan.api.TIE_FRACTION, which `plan` reports), one rule
RANK_TIE_PCT = TIE_FRACTION * 100
# the decision `plan` makes: one model on one cluster with one software release (a layout measured on an older
# container against another on a newer one is a software comparison, not a layout decision)
_JOB = ("model", "system", "nodes", "seq", "precision", "stack", "megatron_core", "torch")
# what `plan` chooses between (parallel.* and the batch split); the other columns are the software a layout ran on, so
# one layout measured on several containers or SDKs is one alternative (its measurements averaged)
# a release the csv names only in its source text (Neuron SDK rows; NeMo containers and dgxc-benchmarking's NeMo
# versions where megatron_core is empty): part of the strict job key, so two SDKs' layouts are not one job's choice
_RELEASE = re.compile(r"Neuron \d+\.\d+(?:\.\d+)?|NeMo \d+\.\d+(?:\.\d+)?|\d\d\.\d\d(?:\.\d+)? container")


def _release(r: dict) -> tuple[str, ...]:
    return tuple(sorted(set(_RELEASE.findall(r.get("source", "")))))


_LAYOUT = ("global_batch", "tp", "pp", "cp", "vp", "ep", "microbatch", "dp_kind", "zero_stage", "sp", "recompute",
           "schedule", "offload_layers", "rank_order")


def layout_decisions(path: Path, sets: dict[str, list[tuple]], job_fields: tuple[str, ...] = _JOB,
                     by_release: bool = True, rows: list[dict] | None = None) -> dict:
    """The planner as a chooser between the layouts published for one job: rows of a runs file that share model,
    system, node count, sequence, precision and software release (_JOB, and a release named only in the source
    text: _release) but not their layout (_LAYOUT) are one job's alternatives. Per job, time
    per token (step time / tokens per step, so global batches may differ) predicted and measured, one value per
    layout (a layout measured on several software versions: the mean). Returns {"jobs": [...], "pairs": n,
    "agree": n, "regret_pct": [...]}: pairs of layouts whose measured times differ by more than RANK_TIE_PCT, how
    many the planner orders the same way, and per job the regret, how much slower (measured) the layout the planner
    ranks first is than the fastest measured one (0 = the planner picks the best published layout). job_fields
    _JOB[:5] (any software): the stacks and releases of one job compete too (plan's choice across software; a newer
    release's own speed-up then counts as the layout's), with by_release False. rows: the runs file already read."""
    if rows is None:
        with path.open(encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    jobs: dict[tuple, dict[tuple, list]] = {}
    for name, predicted in sets.items():
        for r, p in zip((r for r in rows if r["set"] == name), predicted, strict=True):
            if not np.isfinite(p[1]):
                continue
            layout = tuple(r.get(k, "") for k in _LAYOUT)
            name_ = " ".join(f"{k}={v}" for k, v in zip(_LAYOUT, layout, strict=True) if v not in ("", "1", "0", "None")
                             or k in ("tp", "pp"))
            job = tuple(r.get(k, "") for k in job_fields) + (_release(r) if by_release else ())
            per = jobs.setdefault(job, {}).setdefault(layout, [name_, [], []])
            per[1].append(p[1] / p[7])
            per[2].append(p[2] / p[7])
    return score_decisions(jobs)


def score_decisions(jobs: dict[tuple, dict[tuple, list]]) -> dict:
    """layout_decisions' scores of {job: {layout: [label, [predicted s per token], [measured s per token]]}}."""
    out = {"jobs": [], "pairs": 0, "agree": 0, "regret_pct": []}
    for job, layouts in jobs.items():
        if len(layouts) < 2:
            continue
        alts = [(label, float(np.mean(pr)), float(np.mean(me))) for label, pr, me in layouts.values()]
        best_measured = min(m for _, _, m in alts)
        chosen = min(alts, key=lambda a: a[1])
        regret = (chosen[2] / best_measured - 1) * 100
        wrong = []
        for i, a in enumerate(alts):
            for b in alts[i + 1:]:
                if abs(a[2] / b[2] - 1) * 100 <= RANK_TIE_PCT:
                    continue
                out["pairs"] += 1
                if (a[1] < b[1]) == (a[2] < b[2]):
                    out["agree"] += 1
                else:
                    wrong.append((a, b))
        out["regret_pct"].append(regret)
        out["jobs"].append({"job": job, "layouts": alts, "regret_pct": regret, "misordered": wrong})
    return out


def vtrain_decisions(system) -> dict:
    """layout_decisions on vTrain's multi-node ground truth (evaluation data, planner_vtrain_multi.csv): a job is one
    model (parameters, hidden, layers) on one GPU count, sequence and global batch; its layouts are the runs' tp, dp,
    pp and micro batch (Megatron-DeepSpeed, full recompute, 64-512 A100)."""
    with (Path(__file__).parent / "planner_vtrain_multi.csv").open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    jobs: dict[tuple, dict[tuple, list]] = {}
    for r, (label, pred, meas) in zip(rows, vtrain_multi(system), strict=True):
        tokens = int(r["global batch"]) * int(r["sequence length"])
        job = tuple(r[k] for k in ("Parameters (billion)", "hidden size", "# layers", "# GPUs", "sequence length",
                                   "global batch"))
        per = jobs.setdefault(job, {}).setdefault(label, [label, [], []])
        per[1].append(pred / tokens)
        per[2].append(meas / tokens)
    return score_decisions(jobs)


def decision_summary(d: dict) -> str:
    return (f"{d['agree']}/{d['pairs']} pairs ordered as measured, regret of the planner's pick mean "
            f"{np.mean(d['regret_pct']):.1f}% max {max(d['regret_pct']):.1f}% ({len(d['jobs'])} jobs)")


def decision_table(path: Path, sets: dict[str, list[tuple]]) -> dict[str, dict]:
    """Print layout_decisions, one software release per job ("same software") and then any software ("any
    software"): per job its layouts, the regret, and every pair the planner orders against the measurements."""
    out = {}
    with path.open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    for title, fields, release in (("same software", _JOB, True), ("any software", _JOB[:5], False)):
        d = out[title] = layout_decisions(path, sets, fields, release, rows)
        print(f"\n   layout decisions, {title} (jobs measured with several layouts; measured ties within "
              f"{RANK_TIE_PCT:.0f}% not counted): {decision_summary(d)}")
        _decision_rows(d)
    # the same-software view set by set (a job whose rows lie in two sets counts in neither line): which set's jobs
    # the summary's pairs come from (bloom_search_fp16's one job of 21 layouts holds most of them)
    print("\n   layout decisions, same software, per evaluation set:")
    for name, predicted in sets.items():
        d = layout_decisions(path, {name: predicted}, rows=rows)
        if d["jobs"]:
            out[f"same software, {name}"] = d
            print(f"     {name:<22} {decision_summary(d)}")
    return out


def _decision_rows(d: dict) -> None:
    for j in d["jobs"]:
        model, system, nodes, seq, prec = j["job"][:5]
        flag = "  !!" if j["misordered"] else ""
        print(f"     {model} on {nodes} x {system}, seq {seq}, {prec}: {len(j['layouts'])} layouts, regret "
              f"{j['regret_pct']:.1f}%{flag}")
        for a, b in j["misordered"]:
            print(f"        misordered: {a[0]} (pred {a[1] * 1e6:.2f} / meas {a[2] * 1e6:.2f} us/token) vs "
                  f"{b[0]} ({b[1] * 1e6:.2f} / {b[2] * 1e6:.2f})")


def _size_bucket(model: str) -> str:
    digits = "".join(c for c in model.split("-")[-1] if c.isdigit() or c == ".")
    size = float(digits) if digits else 0.0
    return "<= 13B" if size <= 13 else "70B" if size <= 80 else ">= 175B"


def signed_error_table(sets: dict[str, list[tuple]]) -> None:
    """Mean signed step-time error (predicted - measured) / measured by layout kind, system and model size."""
    rows = [r for rs in sets.values() for r in rs if np.isfinite(r[1])]
    for title, key in (("layout kind", lambda r: r[3]), ("system", lambda r: r[4]),
                       ("model size", lambda r: _size_bucket(r[5]))):
        groups: dict[str, list[float]] = {}
        for r in rows:
            groups.setdefault(key(r), []).append((r[1] - r[2]) / r[2] * 100)
        print(f"\n   signed error by {title}:")
        for name, errs in sorted(groups.items()):
            print(f"     {name:<22} n={len(errs):>3}  mean {np.mean(errs):+6.1f}%  min {min(errs):+6.1f}%  "
                  f"max {max(errs):+6.1f}%  MAPE {np.mean(np.abs(errs)):5.1f}%")


# ---- calibration ----------------------------------------------------------------------------------------
PARAMS = {  # name: grid searched
    "matmul_eff_max": [0.65, 0.7, 0.72, 0.75, 0.78, 0.8, 0.85],
    "kernel_overhead_s": [4e-6, 8e-6, 12e-6, 16e-6, 20e-6, 25e-6, 30e-6],
    "memory_bw_eff": [0.6, 0.7, 0.8, 0.9, 1.0],
    "nvlink_bw_eff": [0.5, 0.6, 0.7, 0.8, 0.9],
    "nvlink_collective_overhead_us": [0, 50, 100, 150, 200, 250, 300, 400],
    "host_launch_s": [40e-6, 45e-6, 50e-6, 55e-6, 60e-6, 65e-6, 70e-6, 80e-6],  # MEGATRON's, not the chip's
}


def with_a100(catalog, values: dict):
    """Systems using A100 chips with the given parameters (new frozen dataclasses; the catalog is untouched)."""
    systems = {}
    for name in ("dgx-a100-80gb", "p4d.24xlarge"):
        base = catalog.system(name)
        chip_eff = dataclasses.replace(base.chip.efficiency, matmul_eff_max=values["matmul_eff_max"],
                                       kernel_overhead_s=values["kernel_overhead_s"],
                                       memory_bw_eff=values["memory_bw_eff"])
        chip = dataclasses.replace(base.chip, efficiency=chip_eff)
        link = lambda t: dataclasses.replace(  # noqa: E731
            t.interconnect, bw_eff=values["nvlink_bw_eff"],
            collective_overhead_us=values["nvlink_collective_overhead_us"])
        tiers = tuple(dataclasses.replace(t, interconnect=link(t)) if t.interconnect.name == "nvlink3" else t
                      for t in base.tiers)
        systems[name] = dataclasses.replace(base, chip=chip, tiers=tiers)
    return systems


def current_values(catalog) -> dict:
    sys_ = catalog.system("dgx-a100-80gb")
    eff, link = sys_.chip.efficiency, sys_.tiers[0].interconnect
    return {"matmul_eff_max": eff.matmul_eff_max, "kernel_overhead_s": eff.kernel_overhead_s,
            "memory_bw_eff": eff.memory_bw_eff, "nvlink_bw_eff": link.bw_eff,
            "nvlink_collective_overhead_us": link.collective_overhead_us, "host_launch_s": MEGATRON.host_launch_s}


def score(systems) -> dict[str, float]:
    v = vtrain(systems["p4d.24xlarge"])
    return {"narayanan": mape(*zip(*[(p, m) for _, p, m in narayanan(systems["dgx-a100-80gb"])], strict=True)),
            "korthikanti": mape(*zip(*[(p, m) for _, p, m in korthikanti(systems["dgx-a100-80gb"])], strict=True)),
            "vtrain": mape([p for _, p, _ in v], [m for _, _, m in v])}


def _trial_score(catalog, values: dict) -> dict[str, float]:
    """score() with the A100 systems and MEGATRON's host_launch_s set from values (the module's MEGATRON patched
    for the call only)."""
    from unittest import mock

    trial = dataclasses.replace(MEGATRON, host_launch_s=values["host_launch_s"])
    with mock.patch.dict(globals(), {"MEGATRON": trial}):
        return score(with_a100(catalog, values))


def calibrate(catalog, rounds: int = 3) -> None:
    """Coordinate descent over PARAMS' grids, minimising the mean of the three data sets' MAPE."""
    values = current_values(catalog)
    best = float(np.mean(list(_trial_score(catalog, values).values())))
    start = time.perf_counter()
    for r in range(rounds):
        for name, grid in PARAMS.items():
            for candidate in grid:
                trial = {**values, name: candidate}
                obj = float(np.mean(list(_trial_score(catalog, trial).values())))
                if obj < best - 1e-9:
                    best, values = obj, trial
            print(f"round {r + 1} {name}: mean MAPE {best:.2f}% {values}", file=sys.stderr)
    final = _trial_score(catalog, values)
    print(f"calibrated in {time.perf_counter() - start:.0f} s: {values} -> "
          + ", ".join(f"{k} {v:.2f}%" for k, v in final.items()))


# ---- report ---------------------------------------------------------------------------------------------
def report(name: str, rows: list[tuple[str, float, float]], worst: int, with_rank: bool) -> dict:
    pred = np.array([p for _, p, _ in rows])
    meas = np.array([m for _, _, m in rows])
    ok = np.isfinite(pred)
    result = {"rows": len(rows), "predicted": int(ok.sum()), "mape_pct": mape(pred[ok], meas[ok])}
    if with_rank:
        result["spearman"] = spearman(pred[ok], meas[ok]) if ok.sum() > 2 else float("nan")
    extra = f"  Spearman {result['spearman']:.3f}" if with_rank and ok.sum() > 2 else ""
    print(f"\n== {name}: {result['predicted']}/{len(rows)} rows, MAPE {result['mape_pct']:.1f}%{extra}")
    err = np.where(ok, (pred - meas) / meas * 100, np.nan)
    order = np.argsort(-np.abs(np.nan_to_num(err, nan=1e9)))
    shown = order[:worst] if len(rows) > worst else np.arange(len(rows))
    for i in shown:
        print(f"   {rows[i][0]:<48} predicted {pred[i]:9.3f} s  measured {meas[i]:9.3f} s  error {err[i]:+6.1f}%")
    return result


def plot(sets: dict[str, list[tuple[str, float, float]]], path: str) -> None:
    """Predicted vs measured step time, log-log, one colour per data set, with the +-15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    lo, hi = 1e9, 0.0
    for name, rows in sets.items():
        pred = np.array([p for _, p, _ in rows])
        meas = np.array([m for _, _, m in rows])
        ax.scatter(meas, pred, s=8 if len(rows) > 100 else 30, alpha=0.6, label=f"{name} ({len(rows)})")
        lo, hi = min(lo, meas.min(), pred.min()), max(hi, meas.max(), pred.max())
    line = np.array([lo / 1.2, hi * 1.2])
    ax.plot(line, line, "k-", lw=1)
    ax.fill_between(line, line * 0.85, line * 1.15, color="grey", alpha=0.15, label="+-15%")
    ax.set(xscale="log", yscale="log", xlabel="measured step time (s)", ylabel="predicted step time (s)",
           title="paratrain planner vs published measurements")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true", help="grid-search the A100 physical parameters")
    parser.add_argument("--calibrate-h100", action="store_true",
                        help="refit plan.stacks.PYTORCH_HOPPER_SCALE on torchtitan_h100_1node and exit")
    parser.add_argument("--calibrate-a100-pytorch", action="store_true",
                        help="refit plan.stacks.PYTORCH_AMPERE_SCALE on mosaic_a100_1node and exit")
    parser.add_argument("--calibrate-trainium", action="store_true",
                        help="grid-search the Trainium1 parameters on the Trn1 calibration set")
    parser.add_argument("--calibrate-b200", action="store_true",
                        help="refit the B200 GEMM efficiency on the DGX-B200 calibration set and exit")
    parser.add_argument("--calibrate-h100-megatron", action="store_true",
                        help="refit the Hopper GEMM efficiency on megatron_h100_1node (and PYTORCH_HOPPER_SCALE at it) and exit")
    parser.add_argument("--worst", type=int, default=6, help="rows to list per data set (worst first)")
    parser.add_argument("--plot", metavar="PNG", help="also draw predicted vs measured")
    args = parser.parse_args()
    catalog = get_catalog()
    if args.calibrate:
        calibrate(catalog)
        return 0
    if args.calibrate_trainium:
        calibrate_trainium(catalog)
        return 0
    if args.calibrate_h100:
        calibrate_pytorch_scale(catalog)
        return 0
    if args.calibrate_a100_pytorch:
        calibrate_pytorch_scale(catalog, "PYTORCH_AMPERE_SCALE", "mosaic_a100_1node", np.round(np.arange(0.70, 1.01, 0.01), 2))
        return 0
    if args.calibrate_b200:
        calibrate_b200(catalog)
        return 0
    if args.calibrate_h100_megatron:
        calibrate_h100_megatron(catalog)
        return 0
    start = time.perf_counter()
    calibration = {
        "narayanan2021_table1": ("Narayanan et al. 2021 Table 1 (DGX A100, 32-3072 GPUs)",
                                 narayanan(catalog.system("dgx-a100-80gb"))),
        "korthikanti2022_table5": ("Korthikanti et al. 2022 Table 5 (DGX A100, 8-512 GPUs)",
                                   korthikanti(catalog.system("dgx-a100-80gb"))),
        "vtrain_single": ("vTrain single-node ground truth (A100, 2-8 GPUs)", vtrain(catalog.system("p4d.24xlarge"))),
    }
    cal_titles = {"torchtitan_h100_1node": "torchtitan FSDP on one Grand Teton node (set PyTorch-on-Hopper scale)",
                  "mosaic_a100_1node": "MosaicML llm-foundry FSDP on one A100 80GB node (set PyTorch-on-A100 scale)",
                  "neuron_trn1_nxd": "Neuron trn1 NxD benchmarks (set the Trainium1 efficiencies)",
                  "nemo_b200_1node": "Megatron-Bridge Llama 3 8B on one DGX-B200, FP8-CS/MXFP8 (set the B200 GEMM efficiency)",
                  "megatron_h100_1node": "Megatron-Core/NeMo Llama 2 7B / Llama 3 8B on one DGX-H100, BF16+FP8 (set the Hopper GEMM "
                                         "efficiency, --calibrate-h100-megatron: its fit 0.64 is chips.toml's since h100p2p)"}
    cal_grouped = eval_sets(catalog, CAL_CSV)
    for key, rows in cal_grouped.items():
        calibration[key] = (cal_titles.get(key, key), [r[:3] for r in rows])
    evaluation = {"vtrain_multi_heldout": ("vTrain multi-node ground truth (A100, 64-512 GPUs)",
                                           vtrain_multi(vtrain_cluster(catalog)))}
    grouped = eval_sets(catalog)
    titles = {"torchtitan_h100": "torchtitan FSDP2/TP/PP/CP on H100 (Grand Teton, 8-512 GPUs)",
              "torchtitan_a100": "torchtitan FSDP2 on 64 A100",
              "nemo_h100": "NeMo / Megatron-Bridge on DGX-H100 (FP8, 8-1024 GPUs)",
              "llama3_paper": "Llama 3 405B pre-training (BF16, 8,192-16,384 H100)",
              "neuron_trn1": "Neuron trn1 NxD benchmarks, Llama 2 13B/70B and Llama 3.1 70B, SDK 2.16-2.24",
              "mosaic_fsdp": "MosaicML llm-foundry FSDP (MPT 1B-70B, 8-128 H100/A100, eager)",
              "neuron_trn1_nemo": "Neuron trn1 neuronx-nemo-megatron benchmarks (Llama 2 7B/13B, GPT-3 23B/46B/175B, SDK 2.13-2.18)",
              "neuron_trn1_megatron": "Neuron trn1 Megatron-LM reference (GPT-3 6.7B TP8 DP64, no SP, no recompute, SDK 2.9-2.13)",
              "nemo_b200": "NeMo / Megatron-Bridge on DGX-B200 (FP8/MXFP8, Llama 3 8B-405B, GPT-3 175B, 8-512 GPUs)",
              "nemo_gb200": "Megatron-Bridge on DGX-GB200 (NVL72; FP8-CS/MXFP8, Llama 3 8B-405B, 8-256 GPUs)",
              "ibm_fsdp1_a100": "IBM fms-fsdp FSDP1/HSDP on 128 A100, 400 Gbps per node (Llama 2 7B/13B/70B)",
              "ibm_fsdp2_h100": "IBM/Meta torchtitan FSDP2 (+TP4) at 512 H100, IBM Cloud RoCE (Llama 3 70B/405B, BF16/FP8)",
              "nemo_long_seq_h100": "NeMo 24.03 long sequences on DGX-H100 (Llama 2 7B FP8, 8K-1M tokens, CP 1-32, 8-1,024 GPUs)",
              "fsdp_scale": "Sharded / ZeRO data parallelism at scale: BLOOM 176B (384 A100, 3D + ZeRO-1), MT-NLG 530B (2,240-3,360 A100, 3D + ZeRO-1)",
              "dgxc_h100": "NVIDIA dgxc-benchmarking NeMo 24.05-24.09 on DGX-H100 (Llama 3.1 8B/70B/405B CP2, Nemotron-4 15B/340B, GPT-3 175B; BF16+FP8, 8-2,304 GPUs)",
              "megatron_fsdp": "Megatron FSDP (ZeRO-3) in Megatron-Bridge on DGX-GB200 (Llama 3 70B FSDP64, 405B TP2 FSDP64; FP8-CS, 64-128 GPUs, 25.09-26.04.01)",
              "zero1_1k": "InternLM 7B data parallel (hybrid ZeRO-1: gradient all-reduce over all GPUs) at 256-1,024 A100 80GB, "
                          "InternLM doc/en/train_performance.md @c18bec9 FLOPS tables (4 x 100Gb RoCE per node)",
              "together_b200": "Together AI's Llama 3 70B runs on two B200 clusters (use3a-ss, slinky; together-dgxc-"
                               "benchmarking worklogs): Megatron FSDP FP8-CS + 5 offloaded layers on 64-592 GPUs, TP2 PP4 "
                               "VP5 MXFP8 on 256-512 (Megatron-Bridge 25.11-26.02)",
              "bloom_search": "BLOOM's pre-launch layout search: three 64-head candidate shapes (176B-184B) in TP4/TP8, "
                              "PP6/PP12, MBS 2/4 on the same 384 A100 (bigscience tr11-176B-ml chronicles-prequel.md, "
                              "02-28 tables; 3D + DeepSpeed BF16_Optimizer ZeRO-1)",
              "bloom_search_fp16": "BLOOM's pre-launch layout search in fp16: one 64-head 181B shape (72 x 14336), 21 "
                                   "layouts (TP 2-8, PP 2-24, MBS 1-6, GBS 1568-2048) on the same 384 A100 "
                                   "(chronicles-prequel.md, 02-25 tables; 3D + DeepSpeed fp16 ZeRO-1)",
              "fsdp_1k": "Fully sharded data parallelism at 768-4,096 GPUs: OPT-175B on 992 A100 80GB (metaseq: fairscale "
                         "FSDP without reshard after forward + Megatron TP8, full recompute, FP16; Zhang et al. 2022)",
              "torchtitan_h200": "torchtitan Llama 3.1 8B FP8 FSDP on 32 / 64 H200 (Trainy on WhiteFiber, June 2025; "
                                 "400 Gb/s per GPU)",
              "automodel": "NVIDIA NeMo AutoModel (torch FSDP2 + DTensor CP, torch.compile, full AC) on DGX-H100: Llama 3.1 "
                           "70B BF16, FSDP over 64 GPUs with CP2 (docs/performance-summary.md @2013a4dd6)"}
    for key, rows in grouped.items():
        evaluation[key] = (titles.get(key, key), [r[:3] for r in rows])
    results = {}
    print("#### CALIBRATION data (constants were fitted on these)")
    for key, (name, rows) in calibration.items():
        results[("calibration", key)] = report(name, rows, args.worst, True)
    print("\n#### EVALUATION data (never used to set a constant)")
    for key, (name, rows) in evaluation.items():
        results[("evaluation", key)] = report(name, rows, args.worst, True)
    signed_error_table(grouped)
    decisions = decision_table(EVAL_CSV, grouped)
    decisions["vtrain_multi"] = vtrain_decisions(vtrain_cluster(catalog))
    print(f"\n   layout decisions, vtrain_multi (one model, GPU count, sequence and batch; Megatron-DeepSpeed on "
          f"64-512 A100): {decision_summary(decisions['vtrain_multi'])}")
    if args.plot:
        plot({k: rows for k, (_, rows) in {**calibration, **evaluation}.items()}, args.plot)
    print(f"\nCalculon's published predictions on Korthikanti Table 5: MAPE {calculon_korthikanti():.1f}%")
    print(f"\nsummary ({time.perf_counter() - start:.1f} s):")
    for (role, name), r in results.items():
        rank = f", Spearman {r['spearman']:.3f}" if np.isfinite(r.get("spearman", np.nan)) else ""
        print(f"  {role:<11} {name:<24} MAPE {r['mape_pct']:5.1f}%{rank}  ({r['predicted']}/{r['rows']} rows)")
    for title, d in decisions.items():
        print(f"  evaluation  layout decisions, {title:<13} {decision_summary(d)}")
    print("\nfloor from the software-version spread (one layout measured on several SDKs / containers: the best MAPE of "
          "one prediction per layout):")
    for role, (path, sets) in (("calibration", (CAL_CSV, cal_grouped)), ("evaluation", (EVAL_CSV, grouped))):
        for name, f in version_spread_floor(path, sets).items():
            print(f"  {role:<11} {name:<24} floor {f['floor_pct']:5.1f}%  (MAPE {results[(role, name)]['mape_pct']:5.1f}%; "
                  f"{f['layouts']} layouts in {f['rows']} rows, widest spread {f['spread_pct']:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
