"""Expert parallelism: each MoE layer's routed experts sharded over the `ep` ranks of the expert mesh (and each
expert's width over `etp`), applied by `parallelize()` after tensor and context parallelism.

Layout (the one fold of paratrain.config.rules; torchtitan's and Megatron-Core's "MoE parallel folding"): the
dp x cp x tp ranks of a pipeline stage, tp innermost, are refolded as (edp, ep, etp), etp innermost
(`expert_mesh`: the stage's ranks flattened and unflattened, one root mesh, so DTensor and FSDP2 accept the dense
and the expert submeshes side by side). etp = tp: each expert split over the tp ranks like the dense MLP, which see
the same tokens; ep borrows cp and dp ranks. etp = 1: experts keep their full width and ep also borrows the tp
ranks; each tp rank routes its 1/tp of the tokens (its sequence slice, as torchtitan's ReordererSequenceParallel
splits the routed tokens over tp). Rank r of an ep group holds experts [r * E/ep, (r+1) * E/ep) as DTensors on the
(ep, etp) mesh: w1/w3 (E, ffn, h) placed (Shard(0), Shard(1)), w2 (E, h, ffn) (Shard(0), Shard(2)), so
materialisation fills only that slice from the layout-independent init (parallel/materialize.py), DCP saves and
reshards them by their single-device names, and the gradient norm sums their squares over ep and etp exactly once
(parallel/grad_norm.py). The router and the shared experts stay data-parallel weights (the shared experts
TP-sharded like the dense MLP under tp).

Forward, per rank: route this rank's tokens, then
1. the per-expert assignment counts are exchanged (all_to_all_single of E counts), so every rank knows how many
   rows it sends to and receives from each peer;
2. the rows, grouped by expert, go to the experts' owners (all_to_all_single with those split sizes);
3. the owner regroups them by local expert and runs its experts (grouped_swiglu: one matmul per expert); under
   etp each rank computes its column slice and the partial sums are all-reduced over tp (Megatron's mappings);
4. the results return by the inverse all_to_all and are combined with the routing weights on the sending rank.
torch's functional all_to_all_single_autograd (as torchtitan's expert parallelism uses; torch.distributed.nn's
version is deprecated in 2.13) carries the gradients back through both exchanges.

Tokens of one microbatch routed on several ranks (`TokenSplit`: the sequence split over tp with etp = 1, context
parallelism's zig-zag chunks over cp): routing is still the single-device model's for that microbatch. Capacity
ranks an expert's assignments over the whole microbatch (earliest tokens first: the expert ids are all-gathered
over the split, with their sequence positions), and the aux loss uses the microbatch's f_e and P_e (reduced over
the split; P_e's reduction is differentiated: identity backward over tp, whose ranks hold one replicated loss,
a sum over cp, whose ranks are data-parallel). The router's gradient is summed over the tp ranks that routed
different tokens. Sequence parallelism: the block gets its sequence shard; the shared experts (and etp = tp
experts) take the all-gathered sequence, and the block returns its shard.

Gradients: an expert's gradient is, after backward, the sum over the ep group's tokens. Under fsdp the experts
are FSDP2-sharded over the expert mesh's edp ranks (the ranks holding the same expert shards; parallel/data.py
`shard_experts_fsdp`, torchtitan's layout), which reduce-scatters them there and divides by the dense
data-parallel degree dp x cp. Under ddp `ExpertGradReducer` adds the other edp replicas and divides by dp x cp
(each rank's loss is its local mean and the global loss their average; the tp ranks of a token split together
make one replica), so the step equals the single-device one; these parameters are left out of the dense DDP
buckets, which would average them over the wrong group.

Pipeline parallelism never calls the runner's aux_loss(); `attach_aux_to_backward` puts each MoE layer's aux
loss into backward through its output instead (Megatron-Core's MoEAuxLossAutoScaler).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from paratrain.config import ParallelSection
from paratrain.model.moe import (
    MoE,
    Routing,
    capacity,
    gate,
    grouped_swiglu,
    route,
    routing_stats,
    sort_by_expert,
    within_capacity,
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _differentiable_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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


class _ReduceTokens(torch.autograd.Function):
    """Sum over the ranks that split a microbatch's tokens (`group`); backward: the sum over its cp part only
    (cp ranks are data-parallel: each backpropagates its own copy of the loss), identity over its tp part
    (tp ranks hold one replicated loss; each rank's share already gets the whole gradient)."""

    @staticmethod
    def forward(ctx, x, group, cp_group):
        ctx.cp_group = cp_group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.cp_group is not None:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.cp_group)
        return grad, None, None


def _gather_seq(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """(b, s/tp, h) sequence shards -> the whole (b, s, h) on every tp rank; backward keeps this rank's slice of
    the (complete, replicated) gradient (Megatron's gather from the sequence-parallel region)."""
    return DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False).redistribute(tp_mesh, [Replicate()]).to_local()


def _split_seq(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """The whole (b, s, h) -> this tp rank's (b, s/tp, h) slice; backward all-gathers the slices' gradients."""
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(1)]).to_local()


@dataclass(frozen=True)
class TokenSplit:
    """How a microbatch's tokens are spread over the ranks that route them separately: its sequence split over
    tp (`split_tp`, etp = 1) and/or cp's zig-zag chunks. group: all those ranks (None: this rank routes whole
    microbatches); cp_group: their cp part. tp_mesh: the dense tp mesh (tp > 1); sp: the block input arrives as
    this rank's sequence shard (sequence parallelism)."""

    group: dist.ProcessGroup | None
    size: int
    cp_group: dist.ProcessGroup | None
    cp: int
    cp_rank: int
    tp_mesh: DeviceMesh | None
    split_tp: bool
    sp: bool

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Positions in the whole sequence of this rank's `local_len` routed positions."""
        tp = self.tp_mesh.size() if self.split_tp else 1
        cp_len = local_len * tp
        if self.cp > 1:
            from paratrain.parallel.context import zigzag_positions

            pos = zigzag_positions(cp_len * self.cp, self.cp, self.cp_rank, device)
        else:
            pos = torch.arange(cp_len, device=device)
        start = self.tp_mesh.get_local_rank() * local_len if self.split_tp else 0
        return pos[start:start + local_len]


class ShardedExperts(nn.Module):
    """GroupedExperts' w1/w3/w2 as DTensors over the expert mesh: this rank's experts (and etp slice) only; plain
    parameters (every expert whole) when `dims` is empty (ep = etp = 1: replicated, reduced by ExpertGradReducer)."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh | None, dims: tuple[str, ...]):
        super().__init__()
        for name, tp_dim in (("w1", 1), ("w3", 1), ("w2", 2)):
            full = getattr(experts, name)
            if not dims:
                self.register_parameter(name, nn.Parameter(full.detach().clone(), requires_grad=full.requires_grad))
                continue
            placements = [Shard(0) if d == "ep" else Shard(tp_dim) for d in dims]
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
        w1, w3, w2 = (_differentiable_local(getattr(self, n)).to(rows.dtype) for n in ("w1", "w3", "w2"))
        return grouped_swiglu(rows, counts, w1, w3, w2)


class ExpertParallelMoE(MoE):
    """The MoE block `moe` with this rank's slice of its experts (copied from `moe`, which may be on the meta
    device); same forward contract: x (b, s, h) -> (b, s, h) (this rank's sequence shard in and out under
    sequence parallelism), `last_aux_loss`, `last_routing`, and the same parameter names (router.weight,
    experts.w1/w3/w2, shared_experts.*). A MoE subclass so that model.llama.aux_loss and the router metrics find
    it; MoE.__init__ is skipped (it would build full experts). mesh/dims: the expert mesh and its sharded
    dimensions ("ep", "etp"; "tp" is read as "etp"); tokens: how a microbatch's tokens are split (None: whole)."""

    def __init__(self, moe: MoE, mesh: DeviceMesh | None, dims: tuple[str, ...], tokens: TokenSplit | None = None):
        nn.Module.__init__(self)
        self.cfg = moe.cfg
        n_exp = self.cfg.num_experts
        dims = tuple("etp" if d == "tp" else d for d in dims)
        sizes = dict(zip(dims, mesh.shape, strict=True)) if dims else {}
        self.ep, etp = sizes.get("ep", 1), sizes.get("etp", 1)
        if n_exp % self.ep:
            raise ValueError(f"model.num_experts={n_exp} with ep={self.ep}: ep must divide num_experts")
        self.local = n_exp // self.ep
        self.ep_group = mesh.get_group(dims.index("ep")) if self.ep > 1 else None
        self.tp_group = mesh.get_group(dims.index("etp")) if etp > 1 else None
        self.tokens = tokens
        self.router, self.shared_experts = moe.router, moe.shared_experts
        self.experts = ShardedExperts(moe.experts, mesh, dims)
        self.last_aux_loss = None
        self.last_routing = None
        self.router_stats = None  # MoE.record_routing adds each forward's routing (router metrics)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):  # sequence parallelism: ffn_norm's output, this rank's sequence shard
            x = x.to_local()
        t = self.tokens
        tp_mesh = t.tp_mesh if t is not None else None
        whole = _gather_seq(x, tp_mesh) if tp_mesh is not None and t.sp else x  # the shared experts' input
        if tp_mesh is not None and t.split_tp:  # etp = 1: this rank routes its sequence slice
            out = self.routed_out(x if t.sp else _split_seq(x, tp_mesh))
            out = out if t.sp else _gather_seq(out, tp_mesh)
        else:  # every tp rank routes the whole sequence (etp = tp), keeping its shard under sp
            out = self.routed_out(whole)
            out = _split_seq(out, tp_mesh) if tp_mesh is not None and t.sp else out
        if self.shared_experts is not None:  # TP plan: replicated output, or the sequence shard under sp
            out = out + self.shared_experts(whole)
        return out

    def routed_out(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' combined output of the tokens x (b, s', h) this rank routes."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weight = self.router.weight
        if self.tokens is not None and self.tokens.split_tp:  # tp ranks route different tokens: sum their grads
            weight = _CopyToTP.apply(weight, self.tokens.tp_mesh.get_group())
        routing = self.route(F.linear(x, weight), shape)
        token, assignment, counts = sort_by_expert(routing, self.cfg.num_experts)
        y = self.dispatch_compute_combine(x[token], counts)
        self.last_aux_loss = self.cfg.aux_loss_coef * routing.aux_loss
        self.record_routing(routing)
        return MoE.combine(x, routing, (y, assignment)).view(shape)

    def record_routing(self, routing: Routing) -> None:
        """MoE.record_routing; with the tokens split over tp (etp = 1) each tp rank's statistics are summed over
        tp first (the runner sums over dp/cp, whose tp ranks otherwise see the same tokens)."""
        t = self.tokens
        if t is None or not t.split_tp or torch._C._current_graph_task_id() != -1:
            return MoE.record_routing(self, routing)
        self.last_routing = routing
        stats = routing_stats(routing, self.cfg.num_experts)
        group = t.tp_mesh.get_group()
        dist.all_reduce(stats.counts, group=group)
        dist.all_reduce(stats.entropy_sum, group=group)
        self.router_stats = stats if self.router_stats is None else self.router_stats + stats
        return None

    def route(self, logits: torch.Tensor, shape) -> Routing:
        """The single-device model's routing of the whole microbatch, for the tokens this rank holds."""
        t = self.tokens
        if t is None or t.group is None:
            return route(logits, self.cfg)
        weights, experts, probs = gate(logits, self.cfg)
        n_exp = self.cfg.num_experts
        counts = F.one_hot(experts, n_exp).float().sum((0, 1))
        dist.all_reduce(counts, group=t.group)
        prob_sum = _ReduceTokens.apply(probs.sum(0), t.group, t.cp_group)
        total = logits.shape[0] * t.size
        aux = n_exp * ((counts / total) * (prob_sum / total)).sum()
        return Routing(experts, weights, self.kept(experts, shape), probs, aux)

    def kept(self, experts: torch.Tensor, shape) -> torch.Tensor:
        """(T, k) capacity mask of this rank's assignments, ranked over the whole microbatch: every rank's expert
        ids all-gathered with their positions, placed in sequence order, ranked as the single-device model does."""
        t, k = self.tokens, experts.shape[1]
        b, local_len = shape[0], shape[1]
        cap = capacity(b * local_len * t.size, self.cfg)
        if cap is None:
            return torch.ones_like(experts, dtype=torch.bool)
        pos = t.positions(local_len, experts.device)
        pieces = [torch.empty(b, local_len, k, dtype=experts.dtype, device=experts.device) for _ in range(t.size)]
        places = [torch.empty_like(pos) for _ in range(t.size)]
        dist.all_gather(pieces, experts.view(b, local_len, k).contiguous(), group=t.group)
        dist.all_gather(places, pos, group=t.group)
        whole = experts.new_empty(b, local_len * t.size, k)
        for piece, place in zip(pieces, places, strict=True):
            whole[:, place] = piece
        kept = within_capacity(whole.view(-1, k), cap, self.cfg.num_experts).view(b, -1, k)
        return kept[:, pos].reshape(-1, k)

    def dispatch_compute_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (N, h) grouped by global expert, counts (E,) -> expert outputs in the same order."""
        if self.ep_group is None:
            return self.compute(rows, counts.tolist())
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)  # [peer, local expert]: rows peer sends
        per_peer = recv_counts.view(self.ep, self.local)
        send_splits = counts.view(self.ep, self.local).sum(1).tolist()
        recv_splits = per_peer.sum(1).tolist()  # one host sync per layer: split sizes must be known on the host
        received = all_to_all_single_autograd(rows, recv_splits, send_splits, self.ep_group)
        # Received rows are peer-major; regroup by local expert (stable: each peer's rows keep their order).
        local_ids = torch.arange(self.local, device=rows.device).repeat(self.ep).repeat_interleave(per_peer.flatten())
        order = local_ids.argsort(stable=True)
        computed = self.compute(received[order], per_peer.sum(0).tolist())
        back = computed[order.argsort()]
        # in the outputs' dtype, not the rows': under autocast the experts compute in bf16 from fp32 rows
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.ep_group)

    def compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on their rows (grouped by local expert); under etp the slices' sums reduced."""
        if self.tp_group is None:
            return self.experts(rows, counts)
        out = self.experts(_CopyToTP.apply(rows, self.tp_group), counts)
        return _ReduceFromTP.apply(out, self.tp_group)


def expert_mesh(mesh: DeviceMesh, pcfg: ParallelSection) -> DeviceMesh:
    """The (edp, ep, etp) refold of this stage's dp x cp x tp ranks (paratrain.config.rules): the dense dims
    flattened in mesh order, then unflattened with etp innermost. Same root mesh as the dense one. With hsdp
    the replicas stay outermost, (edp_replicate, edp, ep, etp): ep borrows ranks of one shard group only (rule
    ep_hsdp, torchtitan's dp_shard_in_ep), and the experts are HSDP over (edp_replicate, edp)."""
    ep, etp = pcfg.ep, mesh["tp"].size() if pcfg.etp > 1 else 1
    if "dp_shard" in mesh.mesh_dim_names:
        stage = mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("expert_stage")
        replicas = mesh["dp_replicate"].size()
        sizes = (replicas, stage.size() // (replicas * ep * etp), ep, etp)
        return stage._unflatten(0, sizes, ("edp_replicate", "edp", "ep", "etp"))
    stage = mesh["dp", "cp", "tp"]._flatten("expert_stage")
    return stage._unflatten(0, (stage.size() // (ep * etp), ep, etp), ("edp", "ep", "etp"))


def expert_data_mesh(emesh: DeviceMesh) -> DeviceMesh:
    """The ranks holding the same expert shards: edp, or (edp_replicate, edp) with hsdp."""
    return emesh["edp_replicate", "edp"] if "edp_replicate" in emesh.mesh_dim_names else emesh["edp"]


def token_split(mesh: DeviceMesh, pcfg: ParallelSection) -> TokenSplit | None:
    """How this rank's tokens sit in their microbatch (None: whole microbatches, no sequence parallelism)."""
    tp, cp = mesh["tp"].size(), mesh["cp"].size()
    split_tp = tp > 1 and pcfg.etp == 1
    if not (cp > 1 or (tp > 1 and (split_tp or pcfg.sp))):
        return None
    group, size = None, 1
    if split_tp and cp > 1:
        group, size = mesh["cp", "tp"]._flatten("expert_tokens").get_group(), cp * tp
    elif split_tp or cp > 1:
        group, size = mesh["tp" if split_tp else "cp"].get_group(), tp if split_tp else cp
    return TokenSplit(group=group, size=size, cp_group=mesh["cp"].get_group() if cp > 1 else None, cp=cp,
                      cp_rank=mesh["cp"].get_local_rank(), tp_mesh=mesh["tp"] if tp > 1 else None,
                      split_tp=split_tp, sp=pcfg.sp and tp > 1)


def shard_experts(parts: list[nn.Module], mesh: DeviceMesh, pcfg: ParallelSection):
    """Replace every MoE block of `parts` by its ExpertParallelMoE on the expert mesh (nothing when the ranks
    of a stage are data-parallel only: the experts stay in DDP/FSDP); returns (expert parameters, expert mesh)
    for the data-parallel step to leave them to ExpertGradReducer (([], None) when nothing was replaced)."""
    tokens = token_split(mesh, pcfg)
    if pcfg.ep == 1 and mesh["tp"].size() == 1 and tokens is None:
        return [], None
    emesh = expert_mesh(mesh, pcfg)
    dims = tuple(d for d in ("ep", "etp") if emesh[d].size() > 1)
    sub = (emesh[dims] if len(dims) > 1 else emesh[dims[0]]) if dims else None
    params = []
    for part in parts:
        for block in getattr(part, "layers", {}).values():
            if isinstance(block.feed_forward, MoE) and not isinstance(block.feed_forward, ExpertParallelMoE):
                block.feed_forward = ExpertParallelMoE(block.feed_forward, sub, dims, tokens)
                params.extend(block.feed_forward.experts.parameters())
    return params, emesh


def attach_aux_to_backward(parts: list[nn.Module]) -> None:
    """For runners that differentiate only the language-model loss (pipeline schedules): each MoE layer's aux
    loss enters backward through the layer's output."""
    for part in parts:
        for m in part.modules():
            if isinstance(m, MoE):
                m.register_forward_hook(lambda mod, _args, out: _AuxLossInBackward.apply(out, mod.last_aux_loss))


class ExpertGradReducer:
    """After the step's last backward: sum the expert gradients over the edp replicas (`group`, None when there
    is one) and divide by the dense data-parallel degree dp x cp (`divide`), in one flat all-reduce. Called by
    DataParallel.finish; not overlapped with backward (simple and exact at the sizes the tests run)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, divide: int,
                 mesh: DeviceMesh | None = None):
        self.params, self.group, self.divide = params, group, divide
        self.mesh = mesh  # the expert mesh (edp, ep, etp): FSDP shards the experts over its edp (parallel/data.py)

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


def expert_reducer(params: list[nn.Parameter], emesh: DeviceMesh | None, dp: int) -> ExpertGradReducer | None:
    """The reducer of `params` on the expert mesh (dp: the dense data-parallel degree, cp included), or None."""
    if not params:
        return None
    edp = expert_data_mesh(emesh)
    group = (edp._flatten().get_group() if edp.ndim > 1 else edp.get_group()) if edp.size() > 1 else None
    return ExpertGradReducer(params, group, dp, emesh)
