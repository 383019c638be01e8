"""Expert parallelism: a MoE block's routed experts sharded over an `ep` process group.

Rank r of the group holds experts [r * E/ep, (r+1) * E/ep); the router and shared experts stay replicated (they
see this rank's tokens only, like data parallelism, and their gradients are reduced by the data-parallel wrapper
as every replicated weight is). Each rank routes its own tokens (capacity, when set, counts this rank's tokens, as
Megatron-Core and GShard do), then:
1. the per-expert assignment counts are exchanged (all_to_all_single of E counts), so every rank knows how many
   rows it sends to and receives from each peer;
2. the rows, grouped by expert, go to the experts' owners (all_to_all_single with those split sizes);
3. the owner regroups them by local expert and runs its experts (GroupedExperts: one matmul per expert);
4. the results return by the inverse all_to_all and are combined with the routing weights on the sending rank.
torch.distributed.nn.functional.all_to_all_single carries the gradients back through both exchanges.

Only this block is distributed here; wiring into `parallelize()` (a parallel.ep degree over the dp ranks) and
composition with TP / FSDP / PP / CP are not done yet (docs/moe.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from paratrain.model.moe import GroupedExperts, MoE, Routing, route, sort_by_expert


class ExpertParallelMoE(nn.Module):
    """The MoE block `moe` with this rank's slice of its experts (weights copied from `moe`, which may be a meta or
    a full single-device block); same forward contract: x (b, s, h) -> (b, s, h), `last_aux_loss`, `last_routing`."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.cfg, self.group = moe.cfg, group
        self.ep, rank = dist.get_world_size(group), dist.get_rank(group)
        n_exp = self.cfg.num_experts
        if n_exp % self.ep:
            raise ValueError(f"model.num_experts={n_exp} with ep={self.ep}: ep must divide num_experts")
        self.local = n_exp // self.ep
        self.router, self.shared_experts = moe.router, moe.shared_experts
        self.experts = GroupedExperts(self.local, self.cfg.hidden, self.cfg.moe_ffn).to(moe.experts.w1.device)
        with torch.no_grad():
            for name, p in self.experts.named_parameters():
                p.copy_(getattr(moe.experts, name)[rank * self.local:(rank + 1) * self.local])
        self.last_aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None

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
        self.last_routing = routing
        return out.view(shape)

    def dispatch_compute_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (N, h) grouped by global expert, counts (E,) -> expert outputs in the same order."""
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [peer, local expert]: rows peer sends me
        per_peer = recv_counts.view(self.ep, self.local)
        send_splits = counts.view(self.ep, self.local).sum(1).tolist()
        recv_splits = per_peer.sum(1).tolist()  # one host sync per layer: split sizes must be known on the host
        received = all_to_all_single(rows.new_empty(sum(recv_splits), rows.shape[1]), rows, recv_splits,
                                     send_splits, group=self.group)
        # Received rows are peer-major; regroup by local expert (stable: each peer's rows keep their order).
        local_ids = torch.arange(self.local, device=rows.device).repeat(self.ep).repeat_interleave(per_peer.flatten())
        order = local_ids.argsort(stable=True)
        computed = self.experts(received[order], per_peer.sum(0).tolist())
        back = computed[order.argsort()]
        return all_to_all_single(rows.new_empty(rows.shape), back, send_splits, recv_splits, group=self.group)
