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

from paratrain.config.layout import effective_dp
from paratrain.config.schema import SINGLE_STAGE_SCHEDULES, V_SCHEDULES

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
    empty = [i for i, n in enumerate(given) if n < 0 or (n == 0 and 0 < i < stages - 1)]
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
    schedule: str

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks_per_rank

    @property
    def v_shape(self) -> bool:
        return self.schedule in V_SCHEDULES

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
    if schedule in SINGLE_STAGE_SCHEDULES:
        if virtual_stages != 1:
            raise ValueError(f"parallel.virtual_stages={virtual_stages} with parallel.pp_schedule='{schedule}': "
                             f"'{schedule}' runs one stage per rank; allowed: virtual_stages=1, or "
                             f"pp_schedule='interleaved_1f1b' for several chunks per rank")
        return 1
    if schedule == "interleaved_1f1b":
        if virtual_stages < 2:
            raise ValueError("parallel.virtual_stages=1 with parallel.pp_schedule='interleaved_1f1b': interleaving "
                             "needs several chunks per rank; allowed: virtual_stages >= 2 (or pp_schedule='1f1b')")
        return virtual_stages
    if virtual_stages not in (1, 2):
        raise ValueError(f"parallel.virtual_stages={virtual_stages} with parallel.pp_schedule='{schedule}': the V "
                         f"schedules place exactly 2 chunks per rank; allowed: virtual_stages 1 (means 2) or 2")
    return 2


def check_microbatches(schedule: str, m: int, pp: int, stages: int, where: str) -> None:
    if schedule == "1f1b" and m < pp:
        raise ValueError(f"{where}: 1f1b needs microbatches >= pp={pp}; allowed: a larger global_batch or a "
                         f"smaller microbatch, or pp_schedule='gpipe'")
    if schedule == "interleaved_1f1b":
        if m < pp:
            raise ValueError(f"{where}: interleaved_1f1b needs microbatches >= pp={pp}; allowed: a larger "
                             f"global_batch or a smaller microbatch, or pp_schedule='gpipe'")
        rounds = m // pp
        if m % rounds:
            raise ValueError(f"{where}: interleaved_1f1b runs microbatches in rounds of m // pp = {rounds}; "
                             f"allowed: microbatch counts divisible by {rounds} (e.g. a multiple of pp={pp})")
    if schedule in V_SCHEDULES and m < stages:
        raise ValueError(f"{where}: {schedule} needs microbatches >= 2*pp = {stages} (its V holds 2 stages per "
                         f"rank); allowed: a larger global_batch or a smaller microbatch")


def _stage_layer_counts(cfg: TrainConfig, num_layers: int, stages: int) -> list[int]:
    given = cfg.parallel.pp_layers
    if given is None:
        if stages > num_layers:
            raise ValueError(f"parallel.pp={cfg.parallel.pp} x {stages // cfg.parallel.pp} chunk(s) per rank = "
                             f"{stages} pipeline stages, but the model has {num_layers} layers; allowed: stages <= "
                             f"model.layers (a smaller pp or virtual_stages)")
        return balanced_layers(num_layers, stages)
    # the planner validates the splits it writes with the same function (plan/stages.py: torch-free)
    return list(check_pp_layers(given, num_layers, cfg.parallel.pp, stages // cfg.parallel.pp, "parallel.pp_layers"))


def check_stages(cfg: TrainConfig) -> tuple[int, list[int]]:
    """(chunks per rank, layers per stage): the part of the layout that does not depend on the data-parallel
    size, so `paratrain config` can check it before the number of ranks is known."""
    p = cfg.parallel
    model = cfg.model_shape()
    chunks = chunks_per_rank(p.pp_schedule, p.virtual_stages)
    if model.tie_embeddings and p.pp > 1:
        raise ValueError("model.tie_embeddings=true with parallel.pp > 1: the embedding and the output head sit "
                         "on different stages; allowed: tie_embeddings=false for pipeline parallelism")
    return chunks, _stage_layer_counts(cfg, model.layers, p.pp * chunks)


def plan_pipeline(cfg: TrainConfig, dp: int) -> PipelineLayout:
    """The pipeline layout for cfg at data-parallel size dp, or one clear ValueError naming the field."""
    p = cfg.parallel
    chunks, counts = check_stages(cfg)
    stages = p.pp * chunks
    per_rank = cfg.train.global_batch // dp
    if per_rank % cfg.train.microbatch:
        raise ValueError(f"train.microbatch={cfg.train.microbatch} must divide the per-rank batch "
                         f"global_batch/dp = {per_rank}")
    m = per_rank // cfg.train.microbatch
    where = (f"parallel.pp_schedule='{p.pp_schedule}' with {m} microbatches (train.global_batch="
             f"{cfg.train.global_batch} / (dp={dp} x train.microbatch={cfg.train.microbatch}))")
    check_microbatches(p.pp_schedule, m, p.pp, stages, where)
    return PipelineLayout(pp=p.pp, chunks_per_rank=chunks, layers_per_stage=tuple(counts), microbatches=m,
                          schedule=p.pp_schedule)


def stage_reshard_after_forward(pcfg) -> bool:
    """FSDP's reshard_after_forward for the stage modules.

    The zero-bubble schedules (zbv, dualpipev) split each backward into an input-gradient and a later
    weight-gradient pass (torch.distributed.pipelining's stage_backward_input / stage_backward_weight), which
    find the weights through the stage module's *registered* parameters after the forward. When FSDP2 reshards
    a block after its forward, those are the sharded DTensors, not the unsharded tensors the autograd graph used:
    the weight pass then silently misses gradients (measured, PP2 x FSDP2, torch 2.13: the last stage's block got
    no gradient, inner stages' gradients 54-88% off). So under those schedules the blocks keep their gathered
    parameters from forward to backward (ZeRO-2 within the step; gradients and optimizer state stay sharded);
    an explicit request for resharding (reshard_after_forward=true, zero_stage=3) is refused instead."""
    kind, reshard = effective_dp(pcfg)
    if kind == "ddp" or pcfg.pp <= 1 or pcfg.pp_schedule not in V_SCHEDULES:
        return reshard
    if pcfg.zero_stage == 3 or "reshard_after_forward" in pcfg.model_fields_set and pcfg.reshard_after_forward:
        raise ValueError(f"parallel.pp_schedule='{pcfg.pp_schedule}' with parallel.dp_kind='{kind}' and "
                         f"{'zero_stage=3' if pcfg.zero_stage == 3 else 'reshard_after_forward=true'}: the "
                         f"zero-bubble weight-gradient pass needs the parameters gathered from forward to backward; "
                         f"allowed: reshard_after_forward=false / zero_stage=2 (the default under this schedule), "
                         f"dp_kind='ddp', or pp_schedule gpipe / 1f1b / interleaved_1f1b")
    return False


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
    stage_reshard_after_forward(cfg.parallel)
    if dp is None:
        check_stages(cfg)
        return None
    return plan_pipeline(cfg, dp)


def check_batch_layout(cfg: TrainConfig, dp: int) -> None:
    """The batch rules at data-parallel size dp (global batch over dp ranks, microbatches), then the pipeline's."""
    t = cfg.train
    if t.global_batch % dp:
        raise ValueError(f"train.global_batch={t.global_batch} must be divisible by the data-parallel size {dp}; "
                         f"allowed: a multiple of {dp}")
    per_rank = t.global_batch // dp
    if per_rank % t.microbatch:
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        raise ValueError(f"train.microbatch={t.microbatch} must divide the per-rank batch "
                         f"global_batch/dp = {per_rank}; allowed: {', '.join(map(str, divisors))}")
    if cfg.parallel.pp > 1 or cfg.parallel.pp_layers is not None:  # stages, schedule, microbatches
        from paratrain.config.pipeline import check_pipeline_layout

        check_pipeline_layout(cfg, dp)
