"""Write a planned layout as a paratrain training config (TOML: [model], [parallel], [train], [metrics]).

The trainer's config object (paratrain.config.TrainConfig) is built from the planned Layout (Layout.to_parallel,
the one conversion) and validated by the trainer's own rules before it is written (dump_config): a layout the
runtime would refuse is an error here, not at the start of the run. Only the keys the plan sets are written;
parallel.pp_layers only when the planned split differs from the runtime's balanced default. metrics.run_dir is a fresh folder named after the model and layout (runs/small-dp4-ddp-mb4, or
-2, -3, ... when that exists), so training the plan starts a new run instead of resuming an earlier one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import tomli_w
from pydantic import ValidationError

from paratrain.config import MetricsSection, ModelSection, TrainConfig, TrainSection, format_validation_error
from paratrain.model.config import PRESETS, ModelConfig
from paratrain.plan.api import Estimate, Layout
from paratrain.plan.stages import is_balanced


def layout_name(layout: dict) -> str:
    """A short file-system name of a layout (runtime or planner keys): dp4-ddp-mb4, tp2-pp2-dp2-fsdp-mb2, ..."""
    parts = [f"{k}{layout[k]}" for k in ("tp", "pp", "cp", "dp") if int(layout.get(k) or 1) > 1]
    if int(layout.get("dp") or 1) > 1:
        parts.append(str(layout.get("dp_kind", "ddp")))
    if layout.get("sp"):
        parts.append("sp")
    if layout.get("recompute", "none") != "none":
        parts.append(f"rc-{layout['recompute']}")
    if int(layout.get("offload_layers") or 0):
        parts.append(f"off{layout['offload_layers']}")
    return "-".join(parts or ["single"]) + f"-mb{layout.get('microbatch', 1)}"


def fresh_run_dir(name: str, root: str | Path = "runs") -> str:
    """runs/<name>, or runs/<name>-2, -3, ... : the first that does not exist yet."""
    base = Path(root) / name
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def runtime_layout(layout: Layout) -> Layout:
    """The layout paratrain's runtime runs for a planned one: ZeRO-1/2 on DDP (DeepSpeed, Megatron's distributed
    optimizer: the runtime has neither) become FSDP with reshard_after_forward=false (zero_stage 2), which shards at
    least as much state (memory only goes down) with the same gradient reduce-scatter + parameter all-gather
    traffic; every other layout unchanged."""
    if layout.dp_kind == "ddp" and layout.zero_stage in (1, 2):
        return replace(layout, dp_kind="fsdp", zero_stage=2)
    return layout


def training_config(est: Estimate, model: ModelConfig, model_spec: str, devices_per_node: int,
                    hardware_spec: str | None = None) -> dict:
    """The trainer's config for a planned layout (the keys it sets), checked by the trainer's schema.
    `hardware_spec`: what the user passed to --hardware (a catalog name or a TOML file), written as
    metrics.hardware so the run predicts against the same entry."""
    if est.recompute_mlp:  # planned for NxD (plan --stack nxd): the runtime's selective recompute keeps the MLP
        raise ValueError("layout: recompute = selective with the MLP block replayed (NxD's "
                         "activations_checkpoint_recompute_mlp) has no paratrain runtime equivalent; allowed: a "
                         "candidate with recompute none, selective or full (plan --json lists recompute_mlp)")
    lay = runtime_layout(est.layout)
    if model_spec in PRESETS or Path(model_spec).is_file():
        model_section = {"preset": model_spec}
    else:  # a ModelConfig built in code: write its shape over the closest preset
        model_section = {"preset": "llama2-7b", "layers": model.layers, "hidden": model.hidden,
                         "heads": model.heads, "kv_heads": model.n_kv_heads, "ffn_hidden": model.ffn,
                         "vocab": model.vocab, "max_seq": model.max_seq}
    if isinstance(lay.pp_layers, tuple) and is_balanced(lay.pp_layers, model.layers):
        lay = replace(lay, pp_layers=None)  # balanced is the runtime's default: not written
    if lay.dp_kind == "hsdp" and lay.dp_replicate is None:  # one replica per node, shards inside it
        shard = max(1, min(lay.dp, devices_per_node // (lay.tp * lay.cp)))
        lay = replace(lay, dp_replicate=lay.dp // shard)
    parallel = lay.to_parallel()
    run_dir = fresh_run_dir(f"{model.name}-{layout_name({**parallel.model_dump(), 'microbatch': lay.microbatch})}")
    try:
        cfg = TrainConfig(model=ModelSection(**model_section), parallel=parallel,
                          train=TrainSection(seq_len=est.seq, global_batch=est.global_batch, microbatch=lay.microbatch),
                          metrics=MetricsSection(hardware=_hardware_ref(hardware_spec, est.system), run_dir=run_dir))
    except ValidationError as err:
        raise ValueError(f"the planned layout cannot be written as a training config: "
                         f"{format_validation_error(err).removeprefix('invalid config: ')}") from None
    return cfg.model_dump(exclude_unset=True)


def _hardware_ref(spec: str | None, system_name: str) -> str:
    if spec and Path(spec).is_file():  # a file (e.g. from `paratrain probe`): absolute, so the config travels
        return str(Path(spec).resolve())
    return system_name


def _split_comment(est: Estimate) -> str:
    if est.balanced_step_time_s is None:
        return ""
    return (f"# Pipeline stages: pp_layers = {list(est.layout.pp_layers)} (the balanced split would take "
            f"{est.balanced_step_time_s:.3f} s/step).\n")


def _stack_comment(stack: str | None) -> str:
    """The prediction above is the named stack's (plan --stack: its kernels, its recompute policy, e.g. fsdp2's
    "selective" is torchtitan's per-op checkpointing), not paratrain's runtime's, which trains this config."""
    if stack is None:
        return ""
    return (f"# Timed as the {stack} stack runs this layout (--stack {stack}); paratrain's runtime, which trains "
            f"this config, runs its own kernels and recompute: `paratrain estimate` without --stack times it so.\n")


def write_training_config(path: str | Path, est: Estimate, model: ModelConfig, model_spec: str,
                          devices_per_node: int, hardware_spec: str | None = None, stack: str | None = None) -> Path:
    data = training_config(est, model, model_spec, devices_per_node, hardware_spec)
    header = (f"# Written by `paratrain plan/estimate`: {est.model} on {est.nodes} x {est.system}, predicted "
              f"{est.step_time_s:.3f} s/step, MFU {est.mfu:.1%}, {est.memory_per_device_bytes / 2**30:.1f} GiB/device.\n"
              f"# Planned data parallelism: {est.layout.dp_kind} ZeRO-{est.layout.zero_stage}"
              f" (written as the runtime's {data['parallel']['dp_kind']}"
              f"{'' if 'zero_stage' not in data['parallel'] else ' zero_stage ' + str(data['parallel']['zero_stage'])}).\n"
              + _stack_comment(stack) + _split_comment(est)
              + f"# metrics.run_dir {data['metrics']['run_dir']}: a new folder for this run (a second run of this "
                f"config resumes it; plan again for a new one).\n")
    path = Path(path)
    path.write_text(header + tomli_w.dumps(data))  # the keys the plan set (dump_config writes every default)
    return path
