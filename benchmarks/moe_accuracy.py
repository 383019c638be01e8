"""Planner accuracy on published mixture-of-experts training runs (plan/moe.py; docs/planner.md, MoE section).

    .venv/bin/python benchmarks/moe_accuracy.py          # every row: predicted vs published step time

Data: benchmarks/data/moe_runs.csv, one row per published run with its source. Set "moe_public" is EVALUATION
data: no constant of the planner was set on it (plan/moe.py's constants come from the cited papers and the chip
and link entries of the hardware catalog). Fields marked "best" were not published: the planner's best fitting
choice for the published ones. Each run is timed as its stack runs it (Megatron-Core: plan.stacks "megatron"),
with its precision, its routing (balanced: the benchmark force-balances tokens over experts, moe_imbalance = 1;
learned: plan.moe.routing_imbalance), whether it overlaps the all-to-all (ep_overlap) and dispatches in FP8,
and how its grouped expert GEMM launches (grouped_gemm: per_expert = Transformer Engine's multi-stream
GroupedLinear, which Megatron-Core runs on Hopper; fused = one launch for all local experts, DeepSeek's).

The DeepSeek-V3 cluster (2048 H800): H800 = H100 SXM compute and memory with NVLink cut to 400 GB/s
bidirectional (200 GB/s per direction; DeepSeek-V3 report sec. 3.3.1 and NVIDIA's H800 export specification)
and 8 x 400 Gb/s InfiniBand per node (report sec. 3.1: "each node ... 8 GPUs connected by NVLink and NVSwitch
within nodes ... IB across nodes"): the catalog's DGX H100 with the NVLink bandwidth halved. The DGX-B200 rows
run on the catalog's `dgx-b200` (8 x B200 on NVLink 5 with 8 x 400 Gb/s InfiniBand rails; until 2026-12-01 a
stand-in here built the same from p6-b200 and DGX H100's rails); precision "mxfp8" is FP8 with MX block scaling
(Options.block_scaling), what the Blackwell rows publish as MXFP8. The B200's GEMM efficiency is calibrated on
dense DGX-B200 runs (benchmarks/planner_accuracy.py --calibrate-b200), never on these rows.

Set "together_b200_moe" (EVALUATION, never tuned; docs/planner.md, "togethermoe"): Together AI's own runs of NVIDIA's
versioned DeepSeek-V3 and Qwen3-235B recipes at 256 / 512 B200 (togethercomputer/together-dgxc-benchmarking
worklogs), timed on the catalog's dgx-b200 like the b200scale rows; measured as step times (unit step_time_s).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np

from benchmarks.planner_accuracy import rows_by_set
from paratrain.hardware.catalog import get_catalog
from paratrain.model.config import load_model_config
from paratrain.plan.api import Layout, estimate
from paratrain.plan.options import MOE_FLEX_BACKENDS, Options
from paratrain.plan.software import megatron_core_options

DATA = Path(__file__).parent / "data"
RUNS_CSV = DATA / "moe_runs.csv"
CHOICES = {"recompute": ["none", "selective", "full"], "microbatch": [1, 2, 4, 8]}
# csv `recompute` as the recipe names it where it is none of CHOICES: Megatron-Core's recompute_modules
# ["layernorm", "moe_act"] (the GPT-OSS recipes): no attention replay, the norms and the expert activation rerun
# (Options.recompute_norm_act), with the memory those output-discarding checkpoints free (plan.moe.
# activation_bytes_per_layer). Where it does not fit the planner's memory model the fastest fitting choice of
# CHOICES is taken and the label says so (until 2026-12-01 evening the DGX-B200 GPT-OSS row at mb4, at full).
NORM_ACT = "layernorm+moe_act"
# csv `recompute` "mla_up_proj" / "mla_up_proj+mlp": Megatron-Core's recompute_modules of the DeepSeek-V3 recipes
# (Megatron-Bridge deepseek_workload_base_configs.py; DeepSeek's own, report sec. 3.2.3: "MLA up-projections"):
# the up-projections and RoPE rerun, Q/K/V dropped (Options.recompute_mla_up_proj); "+mlp": the MLP block checkpointed
# too (selective recompute with recompute_mlp), the attention core not ("core_attn" is not in the list:
# Options.recompute_core_attention False). Where it does not fit, the fastest fitting choice of CHOICES, labelled.
MLA_UP_PROJ = ("mla_up_proj", "mla_up_proj+mlp")
# csv `dispatcher`: alltoall (Megatron-Core's MoEAlltoAllTokenDispatcher); the flex dispatcher's backends deepep and
# hybridep, and hierarchical (a node-deduplicating dispatch whose backend the source does not name: timed as
# HybridEP, DeepSeek's own DeepEP stack on the fused GEMM path). HybridEP pads each expert's rows for FP8 while
# permuting (pad_multiple); DeepEP and alltoall leave it to Transformer Engine's Fp8Padding (plan.moe.fp8_padding_s)
HIERARCHICAL = ("hierarchical", "deepep", "hybridep")
FUSED_PADDING = ("hierarchical", "hybridep")
# csv `dp_bucket`: stack = the megatron stack's 128 Mi-parameter gradient buckets (NeMo 2.x / Megatron-Bridge set
# them through CommOverlapConfig whenever dp > 1, plan.stacks); default = Megatron-Core's own bucket_size,
# max(40M, 1M x dp) parameters (plan.data_parallel.default_bucket_bytes): the GPT-OSS performance recipes leave
# cfg.comm_overlap None on H100 and B200 (scripts/performance/configs/gpt_oss/gpt_oss_llm_pretrain.py,
# Megatron-Bridge v0.2.0-v0.4.2; only the GB200 variant builds a CommOverlapConfig) and turn overlap_grad_reduce and
# overlap_param_gather on in the DDP config itself (recipes/gpt_oss/gpt_oss.py)
DP_BUCKETS = ("stack", "default")


def h800_cluster(catalog):
    """DeepSeek's H800 nodes: DGX H100 with NVLink at 200 GB/s per direction (see the module docstring)."""
    base = catalog.system("dgx-h100")
    intra = base.tiers[0]
    link = dataclasses.replace(intra.interconnect, name="nvlink4-h800", bw_gbytes_per_s=200.0)
    return dataclasses.replace(base, name="h800-deepseek", tiers=(dataclasses.replace(intra, interconnect=link),
                                                                   *base.tiers[1:]))


SYSTEMS = {"h800-deepseek": h800_cluster}


def system_of(catalog, name: str):
    return SYSTEMS[name](catalog) if name in SYSTEMS else catalog.system(name)


def model_of(name: str):
    path = DATA / "moe_models" / f"{name}.toml"
    return load_model_config(path if path.is_file() else name)


def options_of(system, r: dict) -> Options:
    if r["dispatcher"] not in ("alltoall", *HIERARCHICAL):
        raise ValueError(f"dispatcher = {r['dispatcher']!r}: allowed: alltoall, {', '.join(HIERARCHICAL)}")
    if r["dp_bucket"] not in DP_BUCKETS:
        raise ValueError(f"dp_bucket = {r['dp_bucket']!r}: allowed: {', '.join(DP_BUCKETS)}")
    bucket = {"bucket_bytes": None} if r["dp_bucket"] == "default" else {}
    # mxfp8: FP8 with MX block scaling (one E8M0 scale per 32 elements), what Blackwell runs as "MXFP8"
    return Options.for_system(system, stack="megatron", fp8=r["precision"] in ("fp8", "mxfp8"),
                              block_scaling=True if r["precision"] == "mxfp8" else None,
                              moe_imbalance=1.0 if r["routing"] == "balanced" else None,
                              ep_overlap=float(r["ep_overlap"]), moe_fp8_dispatch=r["fp8_dispatch"] == "1",
                              moe_hierarchical_dispatch=r["dispatcher"] in HIERARCHICAL,
                              moe_fused_padding=r["dispatcher"] in FUSED_PADDING,
                              moe_flex_backend=r["dispatcher"] if r["dispatcher"] in MOE_FLEX_BACKENDS else None,
                              moe_gemm_per_expert=r["grouped_gemm"] == "per_expert",
                              recompute_mlp=r["recompute_mlp"] == "1", **bucket,
                              **megatron_core_options(r.get("megatron_core") or None))


def stage_layers(layout: str | None):
    """Decoder layers per (virtual) pipeline stage of a Megatron-Core pipeline_model_parallel_layout string (csv
    `pp_layout`; Megatron-Bridge's DeepSeek-V3 recipes, e.g. "Et*4|(t*4|)*14tmL": "|" separates stages, "t" one
    decoder layer, "E" the embedding, "m" the MTP block, "L" the loss, "x*n" and "(...)*n" repeats), as
    Layout.pp_layers; "auto": the planner's best split (an unpublished split); empty: the balanced split."""
    if not layout:
        return None
    if layout == "auto":
        return "auto"
    text = layout
    while "(" in text:  # innermost group first
        text = re.sub(r"\(([^()]*)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    text = re.sub(r"([A-Za-z])\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    return tuple(stage.count("t") for stage in text.split("|"))


def measured_step_s(r: dict, tokens_per_device: float) -> float:
    """The published step time of a row: `unit` tokens_per_s_per_device (Megatron-Bridge's performance tables) or
    step_time_s (a run log's step time; the together_b200_moe rows)."""
    if r["unit"] == "tokens_per_s_per_device":
        return tokens_per_device / float(r["measured"])
    if r["unit"] == "step_time_s":
        return float(r["measured"])
    raise ValueError(f"unit = {r['unit']!r}: allowed: tokens_per_s_per_device, step_time_s")


def _fastest(model, system, nodes, seq, gbs, fixed, opts, recomputes, microbatches):
    """The fastest estimate that fits over the given recompute and microbatch choices (None: none fits)."""
    best = None
    for rc in recomputes:
        for mb in microbatches:
            lay = Layout(**fixed, sp=fixed["tp"] > 1, microbatch=mb, recompute=rc)
            try:
                est = estimate(model, system, nodes, seq, gbs, lay, opts)
            except ValueError:  # e.g. the microbatch does not divide the batch
                continue
            if est.fits and (best is None or est.step_time_s < best.step_time_s):
                best = est
    return best


def predict(catalog, r: dict):
    """(label, predicted step time s, published step time s, estimate) of one row."""
    system = system_of(catalog, r["system"])
    model = model_of(r["model"])
    seq, gbs, nodes = int(r["seq"]), int(r["global_batch"]), int(r["nodes"])
    fixed = {"tp": int(r["tp"]), "pp": int(r["pp"]), "cp": int(r["cp"]), "ep": int(r["ep"]), "etp": int(r["etp"]),
             "virtual_stages": int(r["vp"]), "pp_schedule": r["schedule"], "dp_kind": r["dp_kind"],
             "zero_stage": 3 if r["dp_kind"] == "fsdp" else 1, "pp_layers": stage_layers(r.get("pp_layout"))}
    opts = options_of(system, r)
    # fields not published: every choice is estimated and the fastest that fits is taken (the published
    # virtual-stage counts, e.g. 24, lie outside the search grid, so estimate() is called per choice)
    mbs = CHOICES["microbatch"] if r["microbatch"] == "best" else [int(r["microbatch"])]
    note = ""
    if r["recompute"] in MLA_UP_PROJ:  # Megatron-Core's recompute_modules with "mla_up_proj" (see MLA_UP_PROJ)
        with_mlp = r["recompute"].endswith("+mlp")
        recipe = dataclasses.replace(opts, recompute_mla_up_proj=True, recompute_mlp=with_mlp,
                                     recompute_core_attention=not with_mlp)
        est = _fastest(model, system, nodes, seq, gbs, fixed, recipe, ["selective" if with_mlp else "none"], mbs)
        note = f" +{r['recompute']}" if est is not None else " (recipe's recompute does not fit: best)"
        est = est or _fastest(model, system, nodes, seq, gbs, fixed, opts, CHOICES["recompute"], mbs)
    elif r["recompute"] == NORM_ACT:
        est = _fastest(model, system, nodes, seq, gbs, fixed, dataclasses.replace(opts, recompute_norm_act=True),
                       ["none"], mbs)
        note = " +layernorm,moe_act" if est is not None else " (recipe's recompute does not fit: best)"
        est = est or _fastest(model, system, nodes, seq, gbs, fixed, opts, CHOICES["recompute"], mbs)
    else:
        est = _fastest(model, system, nodes, seq, gbs, fixed, opts,
                       CHOICES["recompute"] if r["recompute"] == "best" else [r["recompute"]], mbs)
    devices = nodes * system.devices_per_node
    measured = measured_step_s(r, gbs * seq / devices)
    label = (f"{r['model']} {r['system']} {devices}dev tp{r['tp']} pp{r['pp']} ep{r['ep']} {r['precision']} "
             f"gbs{gbs}{note}")
    bound = float(r["claim"]) if r["claim"] != "none" else None
    return label, (est.step_time_s if est else float("nan")), measured, est, bound


def sets(catalog=None) -> dict[str, list[tuple]]:
    """Rows of moe_runs.csv grouped by their `set`, each (label, predicted s, published s, estimate, bound %).
    bound: the error bound claimed for the row (the `claim` column; None where the csv says why not)."""
    catalog = catalog or get_catalog()
    return rows_by_set(RUNS_CSV, lambda r: predict(catalog, r))


def main() -> int:
    outside = 0
    for name, rows in sets().items():
        errs = [(p - m) / m * 100 for _, p, m, _, _ in rows]
        within = sum(abs(e) <= 15 for e in errs)
        print(f"\n== {name} (evaluation): {len(rows)} rows, MAPE {np.mean(np.abs(errs)):.1f}%, "
              f"{within}/{len(rows)} within 15%, max |error| {max(abs(e) for e in errs):.1f}%")
        for (label, pred, meas, est, bound), err in zip(rows, errs, strict=True):
            extra = ""
            if est is not None:
                t = est.time_breakdown_s
                extra = (f"  [{est.layout.recompute} mb{est.layout.microbatch}; compute {t['compute']:.2f} ep "
                         f"{t['ep_comm']:.2f} bubble {t['bubble']:.2f} dp {t['dp_exposed']:.2f} s; "
                         f"{est.memory_per_device_bytes / 2**30:.0f} GiB]")
            claim = "  " if bound is None else ("ok" if abs(err) <= bound else "!!")
            print(f"   {claim} {label:<58} predicted {pred:8.2f} s  published {meas:8.2f} s  {err:+6.1f}%{extra}")
            outside += bound is not None and not abs(err) <= bound
    print("\nok / !!: within / outside the bound the csv claims for the row (blank: no claim, reason in the csv)")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
