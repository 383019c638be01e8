"""Write a planned layout as a paratrain training config (TOML: [model], [parallel], [train], [metrics]).

The keys are those of `paratrain.config` (the trainer's schema): parallel.{dp,tp,pp,cp,sp,dp_kind,zero_stage,
recompute,pp_schedule,virtual_stages,dp_replicate,pp_layers}, train.{seq_len,global_batch,microbatch}, model.preset.
parallel.pp_layers is written only when the planned split differs from the runtime's balanced default.
"""

from __future__ import annotations

from pathlib import Path

import tomli_w

from paratrain.model.config import PRESETS, ModelConfig
from paratrain.plan.api import Estimate
from paratrain.plan.stages import is_balanced


def runtime_dp(dp_kind: str, zero_stage: int) -> tuple[str, int | None]:
    """The trainer's data-parallel choice for the planner's: plain DDP has no zero_stage; the runtime has no
    ZeRO-1, so ZeRO-1/2 become FSDP with reshard_after_forward=false (zero_stage 2), which shards at least as
    much state (memory only goes down) with the same gradient reduce-scatter + parameter all-gather traffic."""
    if zero_stage == 0:
        return "ddp", None
    if zero_stage in (1, 2):
        return "fsdp", 2
    return dp_kind, 3


def training_config(est: Estimate, model: ModelConfig, model_spec: str, devices_per_node: int,
                    hardware_spec: str | None = None) -> dict:
    """The trainer's config for a planned layout. `hardware_spec`: what the user passed to --hardware (a
    catalog name or a TOML file), written as metrics.hardware so the run predicts against the same entry."""
    lay = est.layout
    if model_spec in PRESETS or Path(model_spec).is_file():
        model_section = {"preset": model_spec}
    else:  # a ModelConfig built in code: write its shape over the closest preset
        model_section = {"preset": "llama2-7b", "layers": model.layers, "hidden": model.hidden,
                         "heads": model.heads, "kv_heads": model.n_kv_heads, "ffn_hidden": model.ffn,
                         "vocab": model.vocab, "max_seq": model.max_seq}
    dp_kind, zero = runtime_dp(lay.dp_kind, lay.zero_stage)
    parallel = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "sp": lay.sp, "dp_kind": dp_kind,
                "recompute": lay.recompute, "pp_schedule": lay.schedule, "virtual_stages": lay.virtual_stages}
    if zero is not None:
        parallel["zero_stage"] = zero
    if isinstance(lay.pp_layers, tuple) and not is_balanced(lay.pp_layers, model.layers):
        parallel["pp_layers"] = list(lay.pp_layers)  # the planner's uneven split; balanced is the default
    if lay.dp_kind == "hsdp":
        shard = max(1, min(lay.dp, devices_per_node // (lay.tp * lay.cp)))
        parallel["dp_replicate"] = lay.dp // shard
    return {
        "model": model_section,
        "parallel": parallel,
        "train": {"seq_len": est.seq, "global_batch": est.global_batch, "microbatch": lay.microbatch},
        "metrics": {"hardware": _hardware_ref(hardware_spec, est.system)},
    }


def _hardware_ref(spec: str | None, system_name: str) -> str:
    if spec and Path(spec).is_file():  # a file (e.g. from `paratrain probe`): absolute, so the config travels
        return str(Path(spec).resolve())
    return system_name


def _split_comment(est: Estimate) -> str:
    if est.balanced_step_time_s is None:
        return ""
    return (f"# Pipeline stages: pp_layers = {list(est.layout.pp_layers)} (the balanced split would take "
            f"{est.balanced_step_time_s:.3f} s/step).\n")


def write_training_config(path: str | Path, est: Estimate, model: ModelConfig, model_spec: str,
                          devices_per_node: int, hardware_spec: str | None = None) -> Path:
    data = training_config(est, model, model_spec, devices_per_node, hardware_spec)
    header = (f"# Written by `paratrain plan/estimate`: {est.model} on {est.nodes} x {est.system}, predicted "
              f"{est.step_time_s:.3f} s/step, MFU {est.mfu:.1%}, {est.memory_per_device_bytes / 2**30:.1f} GiB/device.\n"
              f"# Planned data parallelism: {est.layout.dp_kind} ZeRO-{est.layout.zero_stage}"
              f" (written as the runtime's {data['parallel']['dp_kind']}"
              f"{'' if 'zero_stage' not in data['parallel'] else ' zero_stage ' + str(data['parallel']['zero_stage'])}).\n"
              + _split_comment(est))
    path = Path(path)
    path.write_text(header + tomli_w.dumps(data))
    return path
