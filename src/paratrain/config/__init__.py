"""The training configuration: one torch-free package used by the CLI, the launcher, the planner, the config
writer and the runtime (docs/architecture.md).

- schema.py: the typed sections ([model], [data], [parallel], [optim], [train], [checkpoint], [metrics],
  [staleness]) and the names they allow (schedules, DP kinds, ...).
- layout.py / pipeline.py: every layout rule (mesh degrees, TP/CP/SP divisibility, DP kind and ZeRO stage, pipeline
  stages and schedules, batch and microbatch counts), each written once.
- load.py: TOML + `--set` overrides -> TrainConfig, one-line errors; dump_config.
- reference.py: the generated reference (docs/config.md).

`from paratrain.config import ...` stays the entry point for everyone else.
"""

from paratrain.config.dp import ZERO_STAGES, ZERO_STAGES_OF_KIND, effective_dp, zero_stage_of
from paratrain.config.layout import (
    check_cp_layout,
    check_parallel_config,
    check_tp_layout,
    resolve_degrees,
    view_of,
)
from paratrain.config.load import (
    dump_config,
    format_validation_error,
    load_config,
    parse_override,
    resolved_config,
)
from paratrain.config.pipeline import (
    PipelineLayout,
    balanced_layers,
    check_batch_layout,
    check_launch,
    check_pipeline_layout,
    check_pp_layers,
    check_stages,
    chunks_per_rank,
    plan_pipeline,
    stage_reshard_after_forward,
)
from paratrain.config.reference import FIELD_HELP, reference_markdown
from paratrain.config.rules import RULES, View
from paratrain.config.schema import (
    DEFAULT_DDP_BUCKET_MB,
    DP_KINDS,
    MESH_DIMS,
    MULTI_STAGE_SCHEDULES,
    PP_SCHEDULES,
    RECOMPUTE,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    CheckpointSection,
    DataSection,
    MetricsSection,
    MixSource,
    ModelSection,
    OptimSection,
    ParallelSection,
    Section,
    StalenessSection,
    TrainConfig,
    TrainSection,
    precision_bytes,
)

__all__ = [
    "DEFAULT_DDP_BUCKET_MB", "DP_KINDS", "FIELD_HELP", "MESH_DIMS", "MULTI_STAGE_SCHEDULES", "PP_SCHEDULES",
    "RECOMPUTE", "RULES", "View", "ZERO_STAGES", "ZERO_STAGES_OF_KIND", "view_of", "zero_stage_of",
    "SINGLE_STAGE_SCHEDULES", "V_SCHEDULES", "CheckpointSection", "DataSection", "MetricsSection", "MixSource",
    "ModelSection", "OptimSection", "ParallelSection", "PipelineLayout", "Section", "StalenessSection",
    "TrainConfig", "TrainSection", "balanced_layers", "check_batch_layout", "check_launch", "check_cp_layout",
    "check_parallel_config", "check_pipeline_layout", "check_pp_layers", "check_stages", "check_tp_layout",
    "chunks_per_rank", "dump_config", "effective_dp", "format_validation_error", "load_config", "parse_override",
    "plan_pipeline", "precision_bytes", "reference_markdown", "resolve_degrees", "resolved_config",
    "stage_reshard_after_forward",
]
