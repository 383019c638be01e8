"""Data parallelism: FSDP2 (ZeRO-3, or ZeRO-2-like), HSDP (replicate x shard), and DDP (replicated).

- "fsdp": `fully_shard` per block, then the root. Parameters, gradients and optimizer state are sharded over
  the dp mesh; each block's parameters are all-gathered just before its forward/backward and its gradients
  reduce-scattered as soon as its backward is done (overlapping the earlier blocks' backward).
  reshard_after_forward=False keeps a block's parameters gathered from forward to backward (no second
  all-gather; memory like ZeRO-2 during the step).
- "hsdp": the same on a 2-D dp mesh (dp_replicate x dp_shard): shard within a node, replicate across nodes
  (reduce-scatter inside the shard group, then all-reduce across replicas).
- "ddp": every rank holds all parameters; `BucketedGradReducer` all-reduces gradients in buckets launched
  asynchronously from post-accumulate-grad hooks, so reduction of the last layers' gradients runs while the
  earlier layers' backward computes (as torch DDP and Megatron's DDP do). It works on plain and DTensor
  (tensor-parallel) parameters alike: it reduces each gradient's local shard over the dp group only, which is
  what TP x DP needs and what torch DDP does not support.
- mixture-of-experts experts (parallel/expert.py, already sharded over ep and tp): under fsdp/hsdp each block's
  experts are one more FSDP2 unit over the expert-data-parallel mesh (the ranks holding the same expert shards:
  the expert mesh's edp, or edp_replicate x edp with hsdp; parallel/expert.py expert_mesh), fully_shard'ed before
  their block as torchtitan does, with gradients divided by the whole dp degree (`ExpertShards`); under ddp they
  stay replicated and parallel/expert.py's reducer sums them over edp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from paratrain.config import ParallelSection
from paratrain.device import all_gather_single, host
from paratrain.parallel.precision import FP32, Precision

DEFAULT_BUCKET_BYTES = ParallelSection().ddp_bucket_bytes  # the config's default, through its one conversion


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def bucket_params(params: Iterable[nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[nn.Parameter]]:
    """Gradient buckets: reverse registration order (about the order gradients become ready in backward), filled
    greedily up to `bucket_bytes`. The one bucketing rule of the DDP reducer and the stale-gradient runner: gloo's
    sum order depends on the bucket layout, so both must form identical buckets for s = 0 to be bitwise DDP."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in [p for p in params if p.requires_grad][::-1]:
        nbytes = local(p).numel() * local(p).element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class BucketedGradReducer:
    """Average gradients over `group` in buckets, each launched as soon as all its gradients are final.

    Gradients are views into one flat buffer per bucket (torch DDP's gradient_as_bucket_view): `begin_step`
    points every plain parameter's .grad at its zeroed slice, backward accumulates there in place, and each
    bucket is divided and all-reduced where it lies, so nothing is copied into a bucket or back. Buckets holding
    DTensor parameters (TP) keep the gradients autograd makes, whose placement (Partial, or Replicate for a
    sharded parameter) and so local shape a fixed view cannot promise: they are concatenated and copied back
    as before. When the reduction dtype differs from the gradients' (train.reduce_dtype) a cast copy is
    reduced and written back."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype | None = None):
        self.group = group
        self.reduce_dtype = reduce_dtype  # None: the gradients' own dtype (fp32); see parallel/precision.py
        self.world = dist.get_world_size(group)
        self.buckets = bucket_params(params, bucket_bytes)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._pending: list[int] = []
        self._ready: list[int] = []
        self._work: list[tuple[dist.Work, torch.Tensor, int]] = []
        self.sync = True
        # gradient-as-bucket-view for buckets of plain parameters; None for buckets with DTensors
        self._flats = [None if any(isinstance(p, DTensor) for p in b) else _bucket_buffer(b) for b in self.buckets]
        self._views = [None if flat is None else bucket_views(b, flat)
                       for b, flat in zip(self.buckets, self._flats, strict=True)]
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._reset()

    def begin_step(self) -> None:
        """Before the step's first backward: zero the buckets and make each .grad its bucket slice again (the
        optimizer's zero_grad(set_to_none=True) dropped them). A gradient still set (accumulation the caller
        manages) is copied in once."""
        for bucket, views in zip(self.buckets, self._views, strict=True):
            if views is None:  # a bucket of DTensor gradients: autograd's own, concatenated at launch
                continue
            for p, view in zip(bucket, views, strict=True):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._work = []

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        i = self._bucket_of[id(param)]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i: int) -> None:
        flat = self._bucket(i)
        flat.div_(self.world)  # pre-divided in the gradients' dtype: a bf16 sum of n terms cannot overflow
        if self.reduce_dtype is not None and flat.dtype != self.reduce_dtype:
            flat = flat.to(self.reduce_dtype)
        self._work.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, i))

    def _bucket(self, i: int) -> torch.Tensor:
        """Bucket i's gradients as one flat tensor: the bucket buffer itself when every .grad is still its view
        (the normal case), else a copy into it (a caller replaced a .grad)."""
        flat = self._flats[i]
        if flat is None:  # DTensor gradients: concatenated as they are
            for p in self.buckets[i]:
                if p.grad is None:  # no gradient this step: reduce zeros (written back into it)
                    p.grad = torch.zeros_like(p)
            return flat_grads(self.buckets[i])
        for p, view in zip(self.buckets[i], self._views[i], strict=True):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        return flat

    def reduce_all_now(self) -> None:
        """Reduce every bucket now, after backward (no overlap): the communication-alone time of a step."""
        self.sync = True
        for i in range(len(self.buckets)):
            self._ready[i] = len(self.buckets[i])
            self._launch(i)
        self.finish()

    def finish(self) -> None:
        """Wait for every bucket and write the averaged gradients back (call after the last backward)."""
        if not self.sync:
            return
        if len(self._work) != len(self.buckets):
            missing = [i for i in range(len(self.buckets)) if self._ready[i] != len(self.buckets[i])]
            for i in missing:  # parameters that got no gradient this step: reduce what is there (zeros)
                self._launch(i)
        for work, flat, i in self._work:
            work.wait()
            if self._flats[i] is None:  # DTensor gradients: written back (copy_ casts to the grad's dtype)
                copy_into_grads(self.buckets[i], flat)
            elif flat.data_ptr() != self._flats[i].data_ptr():  # reduced in another dtype: cast back once
                self._flats[i].copy_(flat)
        self._reset()


def _bucket_buffer(bucket: list[nn.Parameter]) -> torch.Tensor:
    """One flat gradient buffer for a bucket, in the parameters' (local shards') dtype and device."""
    first = local(bucket[0])
    if any(local(p).dtype != first.dtype for p in bucket):
        raise ValueError(f"a DDP gradient bucket mixes parameter dtypes {sorted({str(local(p).dtype) for p in bucket})}; "
                         f"allowed: one dtype for all parameters (train.dtype sets compute, not storage)")
    return torch.zeros(sum(local(p).numel() for p in bucket), dtype=first.dtype, device=first.device)


def flat_grads(bucket: list[nn.Parameter]) -> torch.Tensor:
    """A bucket's gradients (local shards, in bucket order) concatenated into one new flat tensor; zeros for a
    parameter without one. What is reduced for a bucket that is not a gradient view (DTensor gradients here, every
    bucket of the stale-gradient runner, whose reductions outlive the step)."""
    grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket]
    return torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()


def copy_into_grads(bucket: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Write a reduced flat bucket back into its parameters' .grad (laid out as `flat_grads` made it; by the
    gradients' own local shapes, which with TP can differ from the parameters')."""
    offset = 0
    for p in bucket:
        g = local(p.grad)
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def bucket_views(bucket: list[nn.Parameter], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's (local shard's) gradient slot in `flat`, shaped like it."""
    views, offset = [], 0
    for p in bucket:
        shard = local(p)
        views.append(flat[offset:offset + shard.numel()].view_as(shard))
        offset += shard.numel()
    return views


class DataParallel:
    """What the runner needs from data parallelism: gradient-sync control, completion, and the loss group."""

    def __init__(self, kind: str, group: dist.ProcessGroup | None, fsdp_modules: list[FSDPModule] | None = None,
                 reducer: BucketedGradReducer | None = None, experts=None):
        self.kind = kind
        self.group = group
        self.fsdp_modules = fsdp_modules or []
        self.reducer = reducer
        self.experts = experts  # parallel/expert.py ExpertGradReducer: expert weights, reduced over their group
        self.pending_ddp: tuple | None = None  # DDP set up once the weights exist

    def sync_context(self, sync: bool):
        """Within the context, backward reduces gradients only if `sync` (the last microbatch)."""
        for m in self.fsdp_modules:
            m.set_requires_gradient_sync(sync, recurse=False)
        if self.reducer is not None:
            self.reducer.sync = sync
        return contextlib.nullcontext()

    def begin_step(self) -> None:
        """Before a step's first backward (the DDP reducer's gradients are views into its buckets)."""
        if self.reducer is not None:
            self.reducer.begin_step()

    def finish(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()
        if self.experts is not None:
            self.experts.finish()

    def ready(self) -> None:
        """Finish what needs the weights, once they exist (after materialising a meta model; `apply_dp` calls
        it at once for a model that has them): DDP checks that every replica holds the same weights and hooks
        its reducer onto the final parameter tensors."""
        if self.pending_ddp is not None:
            params, bucket_bytes, reduce_dtype = self.pending_ddp
            _check_replicas_equal(params, self.group)
            self.reducer = BucketedGradReducer(params, self.group, bucket_bytes, reduce_dtype=reduce_dtype)
            self.pending_ddp = None


def dp_group(dp_mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group spanning the whole dp mesh (flattened when it is 2-D, as for HSDP)."""
    if dp_mesh.ndim == 1:
        return dp_mesh.get_group()
    return dp_mesh._flatten().get_group()


@dataclass(frozen=True)
class ExpertShards:
    """How FSDP/HSDP shards the expert-parallel experts (torchtitan's llama4/deepseek_v3 apply_fsdp): over `mesh`,
    the ranks that hold the same expert shards (edp; edp_replicate x edp for hsdp), on
    tensor dim `dim` (0, or 1 where edp x ep > num_experts: dim 0 would leave ranks empty), with gradients
    divided by `divide`, the whole data-parallel degree (each rank's loss is its local mean, the global loss their
    average), not by the mesh's size as FSDP would."""

    mesh: DeviceMesh
    divide: int
    dim: int = 0


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool,
               precision: Precision = FP32, ignored: set[nn.Parameter] | None = None,
               experts: ExpertShards | None = None) -> list[FSDPModule]:
    """fully_shard each block, then the root (embedding, final norm, head): one all-gather unit per block.
    Under bf16 every unit gathers bf16 copies and reduces in precision.reduce (parallel/precision.py).
    `ignored`: parameters FSDP must leave alone (a vocab-parallel embedding/head: parallel/vocab.py).
    `experts`: each block's expert-parallel experts get their own unit over the expert-data-parallel mesh first
    (`shard_experts_fsdp`); the block's unit then skips them (FSDP2 leaves a sub-unit's parameters to it)."""
    units = []
    mp = {"mp_policy": policy} if (policy := precision.fsdp_policy()) is not None else {}
    if ignored:
        mp["ignored_params"] = ignored
    for block in model.layers.values():
        if experts is not None:
            units.extend(shard_experts_fsdp(block, experts, reshard_after_forward, precision))
        units.append(fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **mp))
    # The root's parameters are needed again first in backward (the head): resharding them buys nothing.
    units.append(fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **mp))
    return units


def shard_experts_fsdp(block: nn.Module, experts: ExpertShards, reshard_after_forward: bool,
                       precision: Precision = FP32) -> list[FSDPModule]:
    """fully_shard the expert module of `block` (parallel/expert.py ShardedExperts, already sharded over ep and
    tp) over experts.mesh: FSDP2 composes the placements into one DTensor over (edp..., ep, tp). Its gradients are
    reduce-scattered over that mesh only (the ep ranks hold other experts)."""
    from paratrain.parallel.expert import ShardedExperts

    mp = {"mp_policy": policy} if (policy := precision.fsdp_policy()) is not None else {}
    if experts.dim:
        mp["shard_placement_fn"] = lambda _param: Shard(experts.dim)
    units = []
    for module in block.modules():
        if not isinstance(module, ShardedExperts):
            continue
        unit = fully_shard(module, mesh=experts.mesh, reshard_after_forward=reshard_after_forward, **mp)
        unit.set_gradient_divide_factor(float(experts.divide))
        # Sum, then divide: a divide factor other than the shard group's size is a PREMUL_SUM otherwise, which
        # gloo lacks. Not with a one-rank shard group: torch 2.13 then divides while copying (no reduce-scatter)
        # and, forced to sum, divides again after (gradients 1/divide too small; the parity test caught it).
        unit.set_force_sum_reduction_for_comms(experts.mesh.size(experts.mesh.ndim - 1) > 1)
        units.append(unit)
    return units


def apply_dp(parts: list[nn.Module], dp_mesh: DeviceMesh, kind: str, reshard_after_forward: bool = True,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, precision: Precision = FP32,
             ignored: set[nn.Parameter] | None = None, experts=None,
             expert_shards: ExpertShards | None = None) -> DataParallel:
    """Apply data parallelism of `kind` ("ddp" | "fsdp" | "hsdp") over `dp_mesh` to every model part.

    For "hsdp" pass a 2-D mesh (replicate, shard); FSDP2 then shards over the inner and replicates over the
    outer dimension. `ignored` parameters are neither sharded nor reduced (already sharded over dp, gradients
    complete on each rank: parallel/vocab.py). `experts` (parallel/expert.py ExpertGradReducer): the expert
    parameters. Under fsdp/hsdp they are FSDP-sharded: over `expert_shards.mesh` in their own units (ep > 1), or
    with their block over dp like any tensor-parallel weight (ep = 1, expert_shards None). Under ddp they stay
    replicated, left out of the buckets and reduced by `experts` when the step's backward is done."""
    group = dp_group(dp_mesh)
    ignored = set(ignored or ())
    if kind in ("fsdp", "hsdp"):
        if kind == "hsdp" and dp_mesh.ndim != 2:
            raise ValueError("parallel.dp_kind='hsdp' needs a 2-D dp mesh (dp_replicate x dp_shard)")
        units = [u for part in parts
                 for u in apply_fsdp(part, dp_mesh, reshard_after_forward, precision, ignored, expert_shards)]
        return DataParallel(kind, group, fsdp_modules=units)
    if kind == "ddp":
        skip = {id(p) for p in ignored} | {id(p) for p in (experts.params if experts is not None else ())}
        params = [p for part in parts for p in part.parameters() if id(p) not in skip]
        dp = DataParallel(kind, group, experts=experts)
        dp.pending_ddp = (params, bucket_bytes, precision.reduce)
        if not any(local(p).is_meta for p in params):  # else: once materialised (parallelize calls ready())
            dp.ready()
        return dp
    raise ValueError(f"parallel.dp_kind='{kind}': allowed: ddp, fsdp, hsdp")


@torch.no_grad()
def _check_replicas_equal(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Every replica must start from the same weights (all ranks build the model from the same seed); a
    one-number checksum catches a layout bug or a nondeterministic init before training diverges silently."""
    device = local(params[0]).device if params else host()  # NCCL reduces device tensors only
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for p in params:
        total += local(p).double().sum()
    gathered = torch.zeros(dist.get_world_size(group), dtype=torch.float64, device=device)
    all_gather_single(gathered, total, group=group)
    if not torch.allclose(gathered, gathered[0].expand_as(gathered), rtol=0, atol=0):
        raise RuntimeError(f"ddp: parameter checksums differ across data-parallel ranks: {gathered.tolist()}")
