"""Expert parallelism: each MoE layer's routed experts sharded over the `ep` mesh dimension (and each expert's
width over `tp`), applied by `parallelize()` after tensor parallelism.

Layout (torchtitan's dp2ep, mesh.py): ep borrows ep of the dp ranks, dp = dp_mod_ep x ep. Rank r of an ep group
holds experts [r * E/ep, (r+1) * E/ep) as DTensors on the (ep, tp) mesh: w1/w3 (E, ffn, h) placed
(Shard(0), Shard(1)), w2 (E, h, ffn) (Shard(0), Shard(2)), so materialisation fills only that slice from the
layout-independent init (parallel/materialize.py), DCP saves and reshards them by their single-device names, and
the gradient norm sums their squares over ep and tp exactly once (parallel/grad_norm.py). The router and the
shared experts stay data-parallel weights (TP-sharded like the dense MLP under tp).

Forward, per rank: route this rank's tokens (capacity counts this rank's tokens, as Megatron-Core and GShard do,
which is also what one microbatch of the single-device model sees), then
1. the per-expert assignment counts are exchanged (all_to_all_single of E counts), so every rank knows how many
   rows it sends to and receives from each peer;
2. the rows, grouped by expert, go to the experts' owners (all_to_all_single with those split sizes);
3. the owner regroups them by local expert and runs its experts (grouped_swiglu: one matmul per expert); under
   tp each rank computes its column slice and the partial sums are all-reduced over tp (Megatron's mappings);
4. the results return by the inverse all_to_all and are combined with the routing weights on the sending rank.
torch.distributed.nn.functional.all_to_all_single carries the gradients back through both exchanges.

Gradients: an expert's gradient is, after backward, the sum over the ep group's tokens. Under fsdp/hsdp the
experts are FSDP2-sharded over the dp ranks that hold the same experts (dp_mod_ep; parallel/data.py
`shard_experts_fsdp`, torchtitan's layout), which reduce-scatters them there and divides by the whole dp degree.
Under ddp `ExpertGradReducer` adds the other dp_mod_ep replicas and divides by the whole dp degree (each rank's
loss is its local mean and the global loss their average), so the step equals the single-device one; these
parameters are left out of the dense DDP buckets, which would average them over the wrong group.

Pipeline parallelism never calls the runner's aux_loss(); `attach_aux_to_backward` puts each MoE layer's aux
loss into backward through its output instead (Megatron-Core's MoEAuxLossAutoScaler).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard

from paratrain.model.moe import MoE, grouped_swiglu, route, sort_by_expert


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient over tp backward (the input of column-sharded experts)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over tp forward (row-sharded w2's partial sums), identity backward: every tp rank holds the
    whole gradient of the reduced output already (torch's autograd all_reduce would sum it tp times)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AuxLossInBackward(torch.autograd.Function):
    """Returns `out`; its backward also starts the aux loss's backward with gradient 1 (the pipeline schedule
    then scales every gradient by 1/microbatches, as the single-device runner divides loss + aux)."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class ShardedExperts(nn.Module):
    """GroupedExperts' w1/w3/w2 as DTensors over the expert mesh: this rank's experts (and tp slice) only."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh, dims: tuple[str, ...]):
        super().__init__()
        for name, tp_dim in (("w1", 1), ("w3", 1), ("w2", 2)):
            placements = [Shard(0) if d == "ep" else Shard(tp_dim) for d in dims]
            full = getattr(experts, name)
            local = full.detach()
            for mesh_dim, placement in enumerate(placements):
                size = full.shape[placement.dim] // mesh.size(mesh_dim)
                local = local.narrow(placement.dim, mesh.get_local_rank(mesh_dim) * size, size)
            dt = DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=full.shape,
                                    stride=full.stride())
            self.register_parameter(name, nn.Parameter(dt, requires_grad=full.requires_grad))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on `rows` (grouped by local expert). A module call, so that FSDP2 (which may shard
        these weights further over the expert-data-parallel ranks: parallel/data.py) gathers them around it."""
        w1, w3, w2 = (getattr(self, n).to_local().to(rows.dtype) for n in ("w1", "w3", "w2"))
        return grouped_swiglu(rows, counts, w1, w3, w2)


class ExpertParallelMoE(MoE):
    """The MoE block `moe` with this rank's slice of its experts (copied from `moe`, which may be on the meta
    device); same forward contract: x (b, s, h) -> (b, s, h), `last_aux_loss`, `last_routing`, and the same
    parameter names (router.weight, experts.w1/w3/w2, shared_experts.*). A MoE subclass so that
    model.llama.aux_loss and the router metrics find it; MoE.__init__ is skipped (it would build full experts)."""

    def __init__(self, moe: MoE, mesh: DeviceMesh, dims: tuple[str, ...]):
        nn.Module.__init__(self)
        self.cfg = moe.cfg
        n_exp = self.cfg.num_experts
        sizes = dict(zip(dims, mesh.shape, strict=True))
        self.ep, tp = sizes.get("ep", 1), sizes.get("tp", 1)
        if n_exp % self.ep:
            raise ValueError(f"model.num_experts={n_exp} with ep={self.ep}: ep must divide num_experts")
        self.local = n_exp // self.ep
        self.ep_group = mesh.get_group(dims.index("ep")) if self.ep > 1 else None
        self.tp_group = mesh.get_group(dims.index("tp")) if tp > 1 else None
        self.router, self.shared_experts = moe.router, moe.shared_experts
        self.experts = ShardedExperts(moe.experts, mesh, dims)
        self.last_aux_loss = None
        self.last_routing = None
        self.router_stats = None  # MoE.record_routing adds each forward's routing (router metrics)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = route(self.router(x), self.cfg)
        token, assignment, counts = sort_by_expert(routing, self.cfg.num_experts)
        y = self.dispatch_compute_combine(x[token], counts)
        out = MoE.combine(x, routing, (y, assignment))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        self.last_aux_loss = self.cfg.aux_loss_coef * routing.aux_loss
        self.record_routing(routing)
        return out.view(shape)

    def dispatch_compute_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (N, h) grouped by global expert, counts (E,) -> expert outputs in the same order."""
        if self.ep_group is None:
            return self.compute(rows, counts.tolist())
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)  # [peer, local expert]: rows peer sends
        per_peer = recv_counts.view(self.ep, self.local)
        send_splits = counts.view(self.ep, self.local).sum(1).tolist()
        recv_splits = per_peer.sum(1).tolist()  # one host sync per layer: split sizes must be known on the host
        received = all_to_all_single(rows.new_empty(sum(recv_splits), rows.shape[1]), rows, recv_splits,
                                     send_splits, group=self.ep_group)
        # Received rows are peer-major; regroup by local expert (stable: each peer's rows keep their order).
        local_ids = torch.arange(self.local, device=rows.device).repeat(self.ep).repeat_interleave(per_peer.flatten())
        order = local_ids.argsort(stable=True)
        computed = self.compute(received[order], per_peer.sum(0).tolist())
        back = computed[order.argsort()]
        # the outputs' dtype, not the rows': under autocast the experts compute in bf16 from fp32 rows
        return all_to_all_single(back.new_empty(rows.shape), back, send_splits, recv_splits, group=self.ep_group)

    def compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on their rows (grouped by local expert); under tp the slices' sums reduced."""
        if self.tp_group is None:
            return self.experts(rows, counts)
        out = self.experts(_CopyToTP.apply(rows, self.tp_group), counts)
        return _ReduceFromTP.apply(out, self.tp_group)


def expert_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh dimensions the experts are sharded over: ep and tp, where larger than 1."""
    return tuple(d for d in ("ep", "tp") if d in (mesh.mesh_dim_names or ()) and mesh[d].size() > 1)


def shard_experts(parts: list[nn.Module], mesh: DeviceMesh) -> list[nn.Parameter]:
    """Replace every MoE block of `parts` by its ExpertParallelMoE over the (ep, tp) mesh (nothing when both
    are 1); returns the expert parameters (for the data-parallel step to leave alone)."""
    dims = expert_dims(mesh)
    if not dims:
        return []
    expert_mesh = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    params = []
    for part in parts:
        for block in getattr(part, "layers", {}).values():
            if isinstance(block.feed_forward, MoE) and not isinstance(block.feed_forward, ExpertParallelMoE):
                block.feed_forward = ExpertParallelMoE(block.feed_forward, expert_mesh, dims)
                params.extend(block.feed_forward.experts.parameters())
    return params


def attach_aux_to_backward(parts: list[nn.Module]) -> None:
    """For runners that differentiate only the language-model loss (pipeline schedules): each MoE layer's aux
    loss enters backward through the layer's output."""
    for part in parts:
        for m in part.modules():
            if isinstance(m, MoE):
                m.register_forward_hook(lambda mod, _args, out: _AuxLossInBackward.apply(out, mod.last_aux_loss))


class ExpertGradReducer:
    """After the step's last backward: sum the expert gradients over the dp_mod_ep replicas (`group`, None when
    there is one) and divide by the whole dp degree (`divide`), in one flat all-reduce. Called by
    DataParallel.finish; not overlapped with backward (a comment in the module doc says why it is kept simple)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, divide: int):
        self.params, self.group, self.divide = params, group, divide

    def finish(self) -> None:
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            return
        torch._foreach_div_(grads, float(self.divide))
        if self.group is None:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def expert_reducer(params: list[nn.Parameter], mesh: DeviceMesh, dp: int) -> ExpertGradReducer | None:
    """The reducer of `params` on `mesh` (dp = the data-parallel degree, cp included), or None without experts."""
    if not params:
        return None
    names = mesh.mesh_dim_names or ()
    group = mesh["dp_mod_ep"].get_group() if "dp_mod_ep" in names and mesh["dp_mod_ep"].size() > 1 else None
    if "dp_mod_ep" not in names and dp > 1:  # ep = 1 (experts sharded over tp only): replicated over all of dp
        group = mesh["dp"].get_group()
    return ExpertGradReducer(params, group, dp)
