"""Pipeline parallelism: the model split into stages across the `pp` mesh dimension, microbatches flowing
through them on a schedule from torch.distributed.pipelining.

Layout
  * The single-device Llama is cut into S = pp x chunks stages by layer ranges (balanced by count, or
    `parallel.pp_layers`). The first stage keeps `tok_embeddings`, the last keeps `norm` and `output`; every
    stage keeps its layers under their global names (`layers.7....`), so checkpoints reshard across layouts.
  * Placement of stages on pp ranks: looped (stage s on rank s % pp) for gpipe / 1f1b / interleaved_1f1b;
    V-shaped (rank r holds stages r and 2pp-1-r) for the zero-bubble schedules zbv and dualpipev, which is why
    the last stage, and hence the loss, lives on pp rank 0 there.
  * This module only splits (`split_model`) and drives the schedule (`PipelineRunner`): `paratrain.parallel.
    parallelize` applies the mesh's other techniques to the stage modules with the same `apply_techniques` as to
    a whole model (one order, written once). With cp > 1 the runner hands the schedule each sequence's zig-zag
    s/cp slice (context.py), so the activations between stages are those slices.

Step semantics match the single-device runner exactly: the schedule computes the mean token loss of each
microbatch and scales gradients by 1/microbatches (`scale_grads=True`), i.e. the gradient of the mean loss.
The loss is produced on the rank that holds the last stage; it is broadcast over the pp group and averaged
over data-parallel (x context-parallel) ranks so that every rank reports the global batch's loss.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from paratrain.config import TrainConfig
from paratrain.config.pipeline import (  # noqa: F401 - the layout rules (torch-free), re-exported for the runtime
    PipelineLayout,
    balanced_layers,
    check_pipeline_layout,
    check_stages,
    plan_pipeline,
    stage_reshard_after_forward,
)
from paratrain.device import host, to_device
from paratrain.model.moe import reset_router_stats
from paratrain.parallel.mesh import DistEnv
from paratrain.parallel.runner import ParallelRunner, plain


class ScheduleDualPipeVSplit(ScheduleDualPipeV):
    """torch's DualPipeV with each paired forward+backward (OVERLAP_F_B) action split into its forward and its
    backward. torch 2.13's runtime runs a pair as F then B and its lowering places F's send after the pair, so the
    next stage waits a whole backward for its input (measured: DualPipeV's bubble 2.0-2.6x its theory, p = 2-4).
    Split, the send of F's output is lowered right after F. The order of compute on every rank is unchanged (a pair
    ran as F then B anyway), so the arithmetic is the same; only the messages leave earlier. On one device there is
    no F/B overlap to lose: the pair is two kernels streams apart only with DualPipe's own overlapped kernels."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pipeline_order = {rank: split_paired_actions(actions) for rank, actions in self.pipeline_order.items()}
        self._prepare_schedule_with_comms(self.pipeline_order)


def split_paired_actions(actions: list) -> list:
    """Each action with sub-actions (OVERLAP_F_B) replaced by its sub-actions, in order; others unchanged."""
    return [sub for a in actions for sub in ((a.sub_actions or (a,)) if a is not None else (a,))]


SINGLE_STAGE_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI_STAGE_SCHEDULES = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble,
                         "dualpipev": ScheduleDualPipeVSplit}


# --------------------------------------------------------------------------------------------------------
# Stage modules
# --------------------------------------------------------------------------------------------------------
def carve_stage(model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """A module of the model's class holding only `layer_ids` (under their global names), plus the embedding
    on the first stage and norm + output head on the last. Shares the parameter tensors with `model` (no copy);
    a fresh module object, so hooks that TP/FSDP register on one stage never leak into another."""
    stage = type(model).__new__(type(model))
    nn.Module.__init__(stage)
    for key, value in vars(model).items():
        if not key.startswith("_") and key != "training":
            setattr(stage, key, value)  # plain attributes such as the model config
    stage.train(model.training)
    for name, buf in model.named_buffers(recurse=False):
        stage.register_buffer(name, buf, persistent=name not in model._non_persistent_buffers_set)
    stage.tok_embeddings = model.tok_embeddings if first else None
    stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
    stage.norm = model.norm if last else None
    stage.output = model.output if last else None
    return stage


def split_model(model: nn.Module, layout: PipelineLayout, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """(stage index, stage module) for each stage this pp rank holds; the rest of `model` is dropped."""
    last = layout.num_stages - 1
    return [(s, carve_stage(model, layout.layer_ids(s), s == 0, s == last)) for s in layout.stages_of_rank(pp_rank)]


# --------------------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------------------
class _Stage(PipelineStage):
    """A PipelineStage whose metadata inference (torch 2.13 runs one real forward of each stage on the first
    step, before the microbatches) is not counted in the MoE router statistics of the step."""

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        reset_router_stats([self.submod])


class PipelineRunner(ParallelRunner):
    """Runs one optimizer step's microbatches through the pipeline schedule.

    - loss: each microbatch's mean token loss is computed on the last stage (under loss_parallel with TP);
      the mean over microbatches is broadcast over the pp group and averaged over dp (x cp), so every rank
      reports the global batch's loss.
    - context parallelism: batches are sharded zig-zag along the sequence before the schedule and eval.
    - gradients: the schedule scales them by 1/microbatches. FSDP stage modules are driven by the pipeline
      stage itself (gradient sync off until its final reduce); the bucketed DDP reducer is held off during the
      schedule and reduces every bucket once it ends (the schedule's order of backward/weight-gradient work
      varies, so "last microbatch" has no single meaning here).
    - clipping: the inherited global norm over all TP/DP shards, summed over the pp group (`norm_groups`),
      whose ranks hold disjoint parameters.
    """

    def __init__(self, stages: list[tuple[int, nn.Module]], layout: PipelineLayout, mesh: DeviceMesh,
                 cfg: TrainConfig, env: DistEnv, dp=None):
        self.pp_group = mesh["pp"].get_group()
        super().__init__(stages[0][1], cfg.train.microbatch, env.device, cfg.train.dtype,
                         dp_rank=mesh["dp"].get_local_rank(), dp_size=mesh["dp"].size(), dp=dp,
                         loss_parallel=mesh["tp"].size() > 1, norm_groups=(self.pp_group,))
        self.layout = layout
        self.parts = [module for _, module in stages]
        self.pp_rank = mesh["pp"].get_local_rank()
        self.stage_ids = [s for s, _ in stages]
        self.has_first = 0 in self.stage_ids
        self.has_last = layout.num_stages - 1 in self.stage_ids
        self.loss_src = layout.rank_of_stage(layout.num_stages - 1)  # pp-group rank that computes the loss
        self.cp_size, self.cp_rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
        if self.cp_size > 1 and dp is None:
            raise ValueError("context parallelism needs gradient reduction over the (dp, cp) mesh")
        self.norm_slots = self._norm_slots()
        self.schedule = self._build_schedule(stages)

    def _norm_slots(self) -> tuple[list[int], int]:
        """Each local parameter's index in the single-device model's order (stages hold contiguous ranges, in
        stage order, names unchanged), and the model's parameter count: asked of the pp group once, at build."""
        counts = {s: sum(1 for _ in part.parameters()) for s, part in zip(self.stage_ids, self.parts, strict=True)}
        gathered: list[dict[int, int] | None] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, counts, group=self.pp_group)
        every = {s: n for stage_counts in gathered for s, n in stage_counts.items()}
        offsets = {s: sum(n for t, n in every.items() if t < s) for s in self.stage_ids}
        slots = [offsets[s] + i for s in self.stage_ids for i in range(counts[s])]
        return slots, sum(every.values())

    def _build_schedule(self, stages):
        pipe_stages = [_Stage(module, s, self.layout.num_stages, self.device, group=self.pp_group)
                       for s, module in stages]
        loss_fn = self._microbatch_loss
        name, m = self.layout.pp_schedule, self.layout.microbatches
        if name in SINGLE_STAGE_SCHEDULES:
            return SINGLE_STAGE_SCHEDULES[name](pipe_stages[0], m, loss_fn=loss_fn, scale_grads=True)
        return MULTI_STAGE_SCHEDULES[name](pipe_stages, m, loss_fn=loss_fn, scale_grads=True)

    def _microbatch_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, targets)

    def step_context(self):
        """Around a whole schedule step: loss parallel (TP) for the loss and its backward, and autocast."""
        stack = contextlib.ExitStack()
        stack.enter_context(super().step_context())
        stack.enter_context(self.autocast())
        return stack

    def _check_batch(self, inputs: torch.Tensor) -> None:
        expected = self.layout.microbatches * self.microbatch
        if inputs.shape[0] != expected:
            raise ValueError(f"pipeline runner got {inputs.shape[0]} sequences on this dp rank; the schedule was "
                             f"built for {self.layout.microbatches} microbatches x {self.microbatch} = {expected}")

    def shard_sequence(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallelism: this cp rank's zig-zag slice of every sequence (every stage of the rank's
        pipeline then works on s/cp tokens, and the activations between stages are those slices)."""
        if self.cp_size == 1:
            return inputs, targets
        from paratrain.parallel.context import shard_batch

        return shard_batch(inputs, targets, self.cp_size, self.cp_rank)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self._check_batch(inputs)
        inputs, targets = self.shard_sequence(inputs, targets)
        args = (to_device(inputs, self.device),) if self.has_first else ()
        target = to_device(targets, self.device) if self.has_last else None
        losses: list[torch.Tensor] = []
        reducer = self.dp.reducer if self.dp is not None else None
        if self.dp is not None:
            self.dp.begin_step()
        if reducer is not None:
            reducer.sync = False
        with self.step_context():
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if reducer is not None:
            reducer.sync = True
        if self.dp is not None:  # DDP's buckets and the expert gradients (FSDP stages reduce in the schedule)
            self.dp.finish()
        return self._broadcast_loss(losses)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only, microbatch by microbatch through the stages in order (plain send/recv on the pp
        group). Not `schedule.eval()`: the V schedules run their backward actions in eval mode in torch 2.13,
        and switching a schedule between modes re-runs its shape inference each time."""
        inputs, targets = self.shard_sequence(inputs, targets)
        losses = []
        modules = dict(zip(self.stage_ids, self.parts, strict=True))
        last = self.layout.num_stages - 1
        for x, y in zip(inputs.split(self.microbatch), targets.split(self.microbatch), strict=True):
            h = None
            with self.step_context():
                for s in sorted(modules):
                    if s == 0:
                        h = to_device(x, self.device)
                    elif self.layout.rank_of_stage(s - 1) != self.pp_rank:
                        h = _recv_activation(self.layout.rank_of_stage(s - 1), self.pp_group, self.device)
                    h = modules[s](h)
                    if s == last:
                        losses.append(plain(self.loss_fn(h, to_device(y, self.device))))
                    elif self.layout.rank_of_stage(s + 1) != self.pp_rank:
                        _send_activation(h, self.layout.rank_of_stage(s + 1), self.pp_group)
        return self._broadcast_loss(losses)

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean microbatch loss (equal-size microbatches: the batch mean), from the last stage to the pp group,
        then averaged over dp."""
        if self.has_last:
            loss = torch.stack([plain(x.detach()).float() for x in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self.loss_src)
        return self.reduce_loss(loss)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Mean over dp, or over dp x cp with context parallelism (`self.dp` is built on that flattened mesh):
        each cp rank's loss is the mean of its s/cp tokens, all equal in number, so the average is the mean over
        every token of the global batch."""
        if self.cp_size == 1:
            return super().reduce_loss(loss)
        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp.group)
        return loss


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_MAX_NDIM = 8


def _send_activation(h: torch.Tensor, group_dst: int, group) -> None:
    """Shape and dtype first (a stage's output shape depends on TP/SP), then the tensor."""
    h = h.to_local() if isinstance(h, DTensor) else h
    header = torch.tensor([h.ndim, _DTYPES.index(h.dtype), *h.shape, *[0] * (_MAX_NDIM - h.ndim)])
    dist.send(header.to(h.device), group=group, group_dst=group_dst)
    dist.send(h.contiguous(), group=group, group_dst=group_dst)


def _recv_activation(group_src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.zeros(2 + _MAX_NDIM, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=group_src)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    h = torch.empty([int(d) for d in header[2:2 + ndim]], dtype=dtype, device=device)
    dist.recv(h, group=group, group_src=group_src)
    return h


# --------------------------------------------------------------------------------------------------------
# Schedule analysis: the bubble of the action lists the schedules execute, with fixed action costs
# --------------------------------------------------------------------------------------------------------
def schedule_action_lists(layout: PipelineLayout, schedule_cls: type | None = None) -> dict[int, list]:
    """pp rank -> the compute actions (torch `_Action`s) it executes, in order (`schedule_cls`: another
    multi-stage schedule class than paratrain's for layout.pp_schedule, to compare).

    Multi-stage schedules: torch's own `pipeline_order` (what their runtime executes), built in this process on
    a fake process group, so call it where no process group is initialised. GPipe and 1F1B: their step loops
    (torch 2.13's recorded `pipeline_order` for 1F1B numbers microbatches differently from what runs)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    p, m = layout.pp, layout.microbatches
    if layout.pp_schedule in SINGLE_STAGE_SCHEDULES:
        lists = {}
        for r in range(p):
            fwd = [_Action(r, _ComputationType.FORWARD, i) for i in range(m)]
            bwd = [_Action(r, _ComputationType.FULL_BACKWARD, i) for i in range(m)]
            if layout.pp_schedule == "gpipe":
                lists[r] = fwd + bwd
                continue
            warmup = min(m, p - r)  # as Schedule1F1B: then one backward, one forward, ...; then the rest
            acts = fwd[:warmup]
            for i in range(m - warmup):
                acts += [bwd[i], fwd[warmup + i]]
            lists[r] = acts + bwd[m - warmup:]
        return lists
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("schedule_action_lists builds torch schedules on a fake process group: call it in a "
                           "process without an initialised process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
    try:
        ids = layout.stages_of_rank(0)
        stages = [PipelineStage(nn.Linear(1, 1), s, layout.num_stages, host()) for s in ids]
        cls = schedule_cls or MULTI_STAGE_SCHEDULES[layout.pp_schedule]
        schedule = cls(stages, m, loss_fn=lambda out, _: out.sum())
        return {r: [a for a in acts if a is not None] for r, acts in schedule.pipeline_order.items()}
    finally:
        dist.destroy_process_group()


def ideal_idle_fraction(lists: dict[int, list], num_stages: int, cost: dict[str, float]) -> float:
    """Mean idle fraction over ranks when each action takes `cost[type]` ("F", "B", "I", "W") and messages are
    free: every rank runs its list in order, an action starting once its inputs exist (F after the previous
    stage's F; B/I after its own F and the next stage's B/I; W after its I). A paired action (sub-actions, torch's
    OVERLAP_F_B) is modelled as torch 2.13 runs it: its parts one after the other, and their results reach the
    other stages only when the whole pair ends (the sends follow the pair). Raises on a deadlock."""
    from torch.distributed.pipelining.schedules import _ComputationType as Op

    kind = {Op.FORWARD: "F", Op.FULL_BACKWARD: "B", Op.BACKWARD_INPUT: "I", Op.BACKWARD_WEIGHT: "W"}

    def deps(a) -> list[tuple]:
        k, s, mb = kind[a.computation_type], a.stage_index, a.microbatch_index
        if k == "F":
            return [("F", s - 1, mb)] if s > 0 else []
        if k == "W":
            return [("B", s, mb)]
        return [("F", s, mb)] + ([("B", s + 1, mb)] if s < num_stages - 1 else [])

    def done_key(a) -> tuple:
        k = kind[a.computation_type]
        return ("F" if k == "F" else "W" if k == "W" else "B", a.stage_index, a.microbatch_index)

    # per rank: groups of compute actions whose results are published together (a pair, or one action)
    groups = {r: [[x for x in (a.sub_actions or (a,)) if x.computation_type in kind] for a in acts]
              for r, acts in lists.items()}
    groups = {r: [g for g in gs if g] for r, gs in groups.items()}
    finish: dict[tuple, float] = {}
    clock = dict.fromkeys(groups, 0.0)
    busy = dict.fromkeys(groups, 0.0)
    pos = dict.fromkeys(groups, 0)

    def ready(group: list) -> bool:  # inputs from inside the same group are produced in it
        inside = {done_key(x) for x in group}
        return all(d in finish or d in inside for x in group for d in deps(x))

    progress = True
    while progress:
        progress = False
        for r, gs in groups.items():
            while pos[r] < len(gs) and ready(gs[pos[r]]):
                local: dict[tuple, float] = {}
                for a in gs[pos[r]]:
                    c = cost[kind[a.computation_type]]
                    clock[r] = max([clock[r]] + [local.get(d, finish.get(d, 0.0)) for d in deps(a)]) + c
                    busy[r] += c
                    local[done_key(a)] = clock[r]
                finish.update(dict.fromkeys(local, clock[r]))  # published when the group ends
                pos[r] += 1
                progress = True
    if any(pos[r] < len(gs) for r, gs in groups.items()):
        raise RuntimeError("schedule deadlocks under the dependency model")
    makespan = max(clock.values())
    return sum(1 - b / makespan for b in busy.values()) / len(busy)


def theory_idle_fraction(layout: PipelineLayout) -> float:
    """Closed forms: (p-1)/(m+p-1) for GPipe/1F1B; (p-1)/(v m+p-1) interleaved; (p-1)/(6m+p-1) for the V
    schedules with F = I = W per chunk (only the fill of p-1 chunk forwards is left; see docs/pipeline.md)."""
    p, m = layout.pp, layout.microbatches
    if layout.pp_schedule in SINGLE_STAGE_SCHEDULES:
        return (p - 1) / (m + p - 1)
    if layout.pp_schedule == "interleaved_1f1b":
        return (p - 1) / (layout.chunks_per_rank * m + p - 1)
    return (p - 1) / (6 * m + p - 1)


__all__ = ["PipelineLayout", "PipelineRunner", "balanced_layers", "carve_stage",
           "check_pipeline_layout", "check_stages", "ideal_idle_fraction", "plan_pipeline",
           "schedule_action_lists", "split_model", "split_paired_actions", "theory_idle_fraction"]
