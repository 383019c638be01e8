"""Pipeline layout rules (torch-free): the schedules, chunks per rank, layers per stage, microbatch counts.

The runtime (paratrain.parallel.pipeline) builds its stages from `plan_pipeline`'s PipelineLayout and only maps
schedule names onto torch.distributed.pipelining classes; the planner (paratrain.plan) and the config loader call
the same functions, so a layout one of them accepts the others accept too.

Placement of stages on pp ranks: looped (stage s on rank s % pp) for gpipe / 1f1b / interleaved_1f1b; V-shaped
(rank r holds stages r and 2pp-1-r) for the zero-bubble schedules zbv and dualpipev, which is why the last stage,
and hence the loss, lives on pp rank 0 there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from paratrain.config.dp import stage_reshard_after_forward  # noqa: F401 - re-exported for the runtime
from paratrain.config.layout import resolve_degrees, view_of
from paratrain.config.names import V_SCHEDULES
from paratrain.config.rules import View, check, fewest_stage_layers

if TYPE_CHECKING:
    from paratrain.config.schema import TrainConfig


def balanced_layers(num_layers: int, num_stages: int) -> list[int]:
    """The runtime's default split (the runtime's pipeline and the planner both call this one):
    equal counts, the remainder to inner stages first, then to the first stage, then to the last (the first also
    runs the embedding, the last the norm, the output head and the loss)."""
    counts = [num_layers // num_stages] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1] if num_stages > 1 else [0]
    for i in range(num_layers % num_stages):
        counts[order[i]] += 1
    return counts


def stage_ranks(pp: int, v: int, v_shape: bool) -> list[int]:
    """The rank that runs each stage, in stage order (the same placement as PipelineLayout.stages_of_rank)."""
    if v_shape:
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * v)]


def check_pp_layers(pp_layers, layers: int, pp: int, v: int, field: str = "pp_layers") -> tuple[int, ...]:
    """An explicit split checked by the rules the runtime applies (the runtime calls this with
    field="parallel.pp_layers"): one entry per (virtual) stage, summing to the layer count, every inner stage with
    at least one layer. One ValueError naming the field, the value and what is allowed."""
    given = tuple(int(n) for n in pp_layers)
    shown, stages = list(given), pp * v
    if pp == 1:
        raise ValueError(f"{field}={shown} needs parallel.pp > 1")
    if len(given) != stages:
        raise ValueError(f"{field}={shown}: {len(given)} entries but the layout has {stages} (virtual) stages "
                         f"(pp x virtual_stages); allowed: one layer count per stage, in stage order")
    if sum(given) != layers:
        raise ValueError(f"{field}={shown}: sums to {sum(given)} but the model has {layers} layers; allowed: layer "
                         f"counts summing to {layers}")
    empty = [i for i, n in enumerate(given) if n < fewest_stage_layers(i, stages)]
    if empty:
        raise ValueError(f"{field}={shown}: stage(s) {empty} would hold no work; allowed: >= 1 layer per inner "
                         f"stage (0 only for the first or last stage, which hold embedding/head)")
    return given


# --------------------------------------------------------------------------------------------------------
# Layout: which layers each stage holds, which stages each rank holds. Validated before any work.
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    chunks_per_rank: int  # 1, or `virtual_stages` (interleaved), or 2 (V schedules)
    layers_per_stage: tuple[int, ...]
    microbatches: int  # per pp step on one dp rank: global_batch / (dp * microbatch)
    pp_schedule: str  # parallel.pp_schedule

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks_per_rank

    @property
    def v_shape(self) -> bool:
        return self.pp_schedule in V_SCHEDULES

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """Stage indices held by `pp_rank`, in execution order of a forward pass."""
        if self.v_shape:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.chunks_per_rank)]

    def rank_of_stage(self, stage: int) -> int:
        return next(r for r in range(self.pp) if stage in self.stages_of_rank(r))

    def layer_ids(self, stage: int) -> list[int]:
        start = sum(self.layers_per_stage[:stage])
        return list(range(start, start + self.layers_per_stage[stage]))


def chunks_per_rank(schedule: str, virtual_stages: int) -> int:
    """Model chunks per pipeline rank (the rules in config.rules check virtual_stages against the schedule)."""
    return int(View(tp=1, pp=2, cp=1, sp=False, schedule=schedule, virtual_stages=virtual_stages, dp_kind="ddp",
                    zero=0, seq=1, model=None).chunks)


def _stage_layer_counts(cfg: TrainConfig, num_layers: int, stages: int) -> list[int]:
    given = cfg.parallel.pp_layers
    if given is None:
        return balanced_layers(num_layers, stages)
    # the planner validates the splits it writes with the same function (plan/stages.py: torch-free)
    return list(check_pp_layers(given, num_layers, cfg.parallel.pp, stages // cfg.parallel.pp, "parallel.pp_layers"))


def check_stages(cfg: TrainConfig) -> tuple[int, list[int]]:
    """(chunks per rank, layers per stage): the part of the layout that does not depend on the data-parallel
    size, so `paratrain config` can check it before the number of ranks is known."""
    p = cfg.parallel
    model = cfg.model_shape()
    check(view_of(model, p, cfg.train.seq_len))
    chunks = chunks_per_rank(p.pp_schedule, p.virtual_stages)
    return chunks, _stage_layer_counts(cfg, model.layers, p.pp * chunks)


def plan_pipeline(cfg: TrainConfig, dp: int) -> PipelineLayout:
    """The pipeline layout for cfg at data-parallel size dp, or one clear ValueError naming the field."""
    p = cfg.parallel
    chunks, counts = check_stages(cfg)
    view = view_of(cfg.model_shape(), p, cfg.train.seq_len, cfg.train.global_batch, cfg.train.microbatch, dp)
    check(view)
    return PipelineLayout(pp=p.pp, chunks_per_rank=chunks, layers_per_stage=tuple(counts),
                          microbatches=int(view.microbatches), pp_schedule=p.pp_schedule)


def check_pipeline_layout(cfg: TrainConfig, dp: int | None) -> PipelineLayout | None:
    """Validate the pipeline part of cfg at data-parallel size dp (call before any work); None when pp == 1.
    dp=None (the number of ranks not known yet): everything but the microbatch counts, which depend on dp."""
    if cfg.parallel.pp == 1:
        if cfg.parallel.pp_layers is not None:
            raise ValueError(f"parallel.pp_layers={cfg.parallel.pp_layers} needs parallel.pp > 1")
        return None
    if cfg.staleness.policy != "sync":
        raise ValueError(f"staleness.policy='{cfg.staleness.policy}' with parallel.pp={cfg.parallel.pp} is not "
                         f"supported; allowed: staleness.policy='sync' with pipeline parallelism")
    if dp is None:
        check_stages(cfg)
        return None
    return plan_pipeline(cfg, dp)


def check_batch_layout(cfg: TrainConfig, dp: int) -> None:
    """The batch rules at data-parallel size dp (global batch over dp ranks, microbatches), then the pipeline's."""
    t = cfg.train
    check(view_of(cfg.model_shape(), cfg.parallel, t.seq_len, t.global_batch, t.microbatch, dp),
          groups=("global_batch_dp", "microbatch_divides"))
    if cfg.parallel.pp > 1 or cfg.parallel.pp_layers is not None:  # stages, schedule, microbatches
        check_pipeline_layout(cfg, dp)


def check_launch(cfg: TrainConfig, world_size: int) -> None:
    """The checks that need the number of ranks (degrees vs world size, batch vs dp), before a rank joins a
    process group: under torchrun every rank refuses a bad layout at once, with one line."""
    check_batch_layout(cfg, resolve_degrees(cfg.parallel, world_size)["dp"])
