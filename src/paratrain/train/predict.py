"""The one adapter from training to the planner and the calibrator (docs/architecture.md): what
this run is in the planner's terms, what the planner predicts for it, and the machine probe the metrics use.
Nothing else under train/ imports paratrain.plan or paratrain.calibrate.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from paratrain.calibrate.fit import sized_for
from paratrain.calibrate.probe import probe_matmul  # noqa: F401 - for train.metrics (machine peak)
from paratrain.config import TrainConfig, precision_bytes, zero_stage_of
from paratrain.hardware.catalog import resolve_system
from paratrain.plan.api import Layout, estimate, layout_from_parallel
from paratrain.plan.options import PARATRAIN_RUNTIME, Options


def planner_layout(cfg: TrainConfig, degrees: dict) -> dict:
    """This run's layout in the planner's terms (paratrain.plan.Layout fields, by the one conversion
    layout_from_parallel), as it ran: with one data-parallel rank (dp x cp = 1) nothing was data-parallel, so the
    DP kind is recorded as plain ddp / ZeRO-0 whatever the config says."""
    lay = layout_from_parallel(cfg.parallel, cfg.train.microbatch, degrees["dp"])
    lay = replace(lay, zero_stage=zero_stage_of(cfg.parallel))
    if degrees["dp"] * degrees["cp"] == 1:
        lay = replace(lay, dp_kind="ddp", zero_stage=0, dp_replicate=None)
    return lay.to_dict()


def planner_options(cfg: TrainConfig) -> dict:
    """The software choices of this run that the planner models (paratrain.plan.options.Options fields):
    paratrain's runtime (PARATRAIN_RUNTIME) with this config's DDP bucket size, and eager kernels unless
    train.compile fuses the blocks' elementwise ops; the bytes gathered and reduced follow train.dtype and
    train.reduce_dtype (precision_bytes)."""
    return {**PARATRAIN_RUNTIME, "bucket_bytes": cfg.parallel.ddp_bucket_bytes, "eager": not cfg.train.compile,
            **precision_bytes(cfg.train)}


def measured_for_planner(cfg: TrainConfig, model_cfg, degrees: dict, breakdowns: list[dict],
                         warmup_steps: int) -> dict:
    """Steady-state step time and breakdown (medians, first steps dropped as warm-up), with what the planner
    needs to predict the same run: `paratrain calibrate` reads these fields from the summary."""
    steady = breakdowns[min(warmup_steps, max(len(breakdowns) - 1, 0)):]
    keys = sorted({k for b in steady for k in b})
    # profiler-only keys (forward/backward split, communication by kind) over the profiled steps only
    median = {k: statistics.median([b[k] for b in steady if k in b]) for k in keys} if steady else {}
    return {"model_shape": model_cfg.model_dump(), "seq_len": cfg.train.seq_len,
            "global_batch": cfg.train.global_batch, "planner_layout": planner_layout(cfg, degrees),
            "planner_options": planner_options(cfg),
            "step_time_s_median": median.pop("step_time_s", float("nan")), "breakdown_median_s": median}


def planner_prediction(cfg: TrainConfig, model_cfg, degrees: dict, world_size: int) -> dict:
    """What the planner predicts for this very run on `metrics.hardware` (the plan -> train -> measure loop)."""
    system = resolve_system(cfg.metrics.hardware)
    if world_size < system.devices_per_node or system.chip.vendor == "local":  # the ranks in use on one node
        system = sized_for(system, world_size)
    nodes = max(world_size // system.devices_per_node, 1)
    est = estimate(model_cfg, system, nodes, cfg.train.seq_len, cfg.train.global_batch,
                   Layout(**planner_layout(cfg, degrees)), Options.for_system(system, **planner_options(cfg)))
    return {"system": system.name, "step_time_s": est.step_time_s, "breakdown_s": est.time_breakdown_s,
            "memory_per_device_bytes": est.memory_per_device_bytes}
