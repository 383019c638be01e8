"""Data-parallel kind and ZeRO stage: one meaning for the trainer, the planner and calibration (torch-free).

`parallel.dp_kind` says how parameters live across the data-parallel ranks, `parallel.zero_stage` which training
state is sharded, with DeepSpeed's numbering (Rajbhandari et al. 2020, "ZeRO"), which torchtitan/FSDP users
know as FSDP1's sharding strategies:

| zero_stage | sharded across dp ranks            | dp_kind ddp                               | dp_kind fsdp / hsdp                   |
|---|---|---|---|
| 0 | nothing (replicated)               | torch DDP (the runtime's `ddp`)           | -                                     |
| 1 | optimizer state                    | DeepSpeed ZeRO-1, Megatron distributed optimizer (planner only) | hsdp: inside each shard group, gradients all-reduced over all (InternLM's HybridZeroOptimizer, planner only) |
| 2 | + gradients                        | DeepSpeed ZeRO-2 (planner only)           | FSDP2 reshard_after_forward=False (FSDP1 SHARD_GRAD_OP) |
| 3 | + parameters                       | -                                         | FSDP2 reshard_after_forward=True (FULL_SHARD), the default |

The planner models every cell (hsdp/1 when asked, not in `plan`'s search); paratrain's runtime runs ddp/0 and fsdp|hsdp/2|3 (the `runtime_only` rules in
paratrain.config.rules refuse the rest with the allowed values). Unset zero_stage: ddp -> 0; fsdp/hsdp -> 3, or 2
with reshard_after_forward=false, or 2 under a V pipeline schedule (zbv, dualpipev: their weight-gradient pass
needs the parameters still gathered, see `zero_stage_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.config.names import V_SCHEDULES

if TYPE_CHECKING:
    from paratrain.config.schema import ParallelSection

ZERO_STAGES = (0, 1, 2, 3)
# the stages each kind can mean (the planner's search and the rules use this table)
ZERO_STAGES_OF_KIND = {"ddp": (0, 1, 2), "fsdp": (2, 3), "hsdp": (1, 2, 3)}


def zero_stage_of(pcfg: ParallelSection) -> int:
    """The ZeRO stage this parallel section asks for (the table above), zero_stage given or not.

    The zero-bubble schedules (zbv, dualpipev) split each backward into an input-gradient and a later
    weight-gradient pass (torch.distributed.pipelining's stage_backward_input / stage_backward_weight), which
    find the weights through the stage module's *registered* parameters after the forward. When FSDP2 reshards
    a block after its forward, those are the sharded DTensors, not the unsharded tensors the autograd graph used:
    the weight pass then silently misses gradients (measured, PP2 x FSDP2, torch 2.13: the last stage's block got
    no gradient, inner stages' gradients 54-88% off). So under those schedules an unset stage is 2 (parameters
    kept gathered from forward to backward; gradients and optimizer state stay sharded); an explicit 3 (or
    reshard_after_forward=true) is refused by the rules."""
    if pcfg.zero_stage is not None:
        return pcfg.zero_stage
    if pcfg.dp_kind == "ddp":
        return 0
    if pcfg.reshard_after_forward is None:
        return 2 if pcfg.pp > 1 and pcfg.pp_schedule in V_SCHEDULES else 3
    return 3 if pcfg.reshard_after_forward else 2


def check_dp_fields(pcfg: ParallelSection) -> None:
    """zero_stage and reshard_after_forward, both given, must say the same (the table above)."""
    if pcfg.zero_stage is None or pcfg.dp_kind == "ddp" or pcfg.reshard_after_forward is None:
        return
    if (pcfg.zero_stage == 3) != pcfg.reshard_after_forward:
        raise ValueError(f"parallel.zero_stage={pcfg.zero_stage} with parallel.reshard_after_forward="
                         f"{str(pcfg.reshard_after_forward).lower()}: zero_stage 3 reshards (true), 2 keeps the "
                         f"parameters gathered (false); allowed: one of them, or both agreeing")


def effective_dp(pcfg: ParallelSection) -> tuple[str, bool]:
    """(dp_kind, reshard_after_forward) the runtime applies (FSDP's flag; ignored by ddp). Call after the rules."""
    return pcfg.dp_kind, zero_stage_of(pcfg) == 3


def stage_reshard_after_forward(pcfg: ParallelSection) -> bool:
    """FSDP's reshard_after_forward for the pipeline's stage modules (see `zero_stage_of` for the V schedules)."""
    return effective_dp(pcfg)[1]
