"""The gradient norm and clipping of every runner: single process, DDP, FSDP/HSDP, TP/SP, PP, CP and stale.

One routine, so that every layout does the same arithmetic:
- per-tensor L2 norms of the local gradients (a DTensor's local shard) with `torch._foreach_norm`, accumulated
  in fp32 (`dtype=float32`: bf16 gradients are read, never copied; no fp64 copy of every gradient either);
- their squares all-reduced over exactly the mesh groups a gradient is sharded over (a replica never counts
  twice), placed in a vector by parameter index, summed over `extra_groups` (pipeline stages), then added up
  in the single-device model's parameter order;
- the result stays a 0-dim fp32 tensor on the device: no host synchronisation (the loop reads it when it logs).
Clipping multiplies by the clamped coefficient min(max_norm / (norm + 1e-6), 1), as torch.nn.utils.clip_grad_norm_
does, with `_foreach_mul_` on the local tensors (a foreach over DTensors would reject a mix of meshes).

Where the gradients are bitwise those of the single process and unsharded (pipeline parallelism over whole
stages), the norm is bitwise the single-process norm, and so is the whole run (tested). DDP's reduced gradients
differ from the single process's by the all-reduce's rounding; sharded layouts also sum shards in another
order: equal within fp32 reduction-order rounding (the norm within 1e-6 relative, tested).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard


def _local_and_groups(g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The tensor this rank holds and the groups its shards are spread over."""
    if not isinstance(g, DTensor):
        return g, ()
    if any(p.is_partial() for p in g.placements):  # unreduced (e.g. replicated kv heads): reduce first
        g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
    # FSDP over TP-sharded parameters places dp as _StridedShard, which is not is_shard() in torch 2.13.
    groups = tuple(g.device_mesh.get_group(i) for i, p in enumerate(g.placements)
                   if p.is_shard() or isinstance(p, _StridedShard))
    return g.to_local(), groups


def global_grad_norm(grads: list[torch.Tensor | None], device: torch.device, extra_groups: tuple = (),
                     slots: list[int] | None = None, num_slots: int | None = None) -> torch.Tensor:
    """L2 norm of all gradients of the model across every rank (0-dim fp32 tensor on `device`).

    Each gradient's square norm goes to its slot of one vector (`slots`: its parameter's index in the
    single-device model's order, of `num_slots`; default: the list order); ranks that hold other parameters
    (pipeline stages, `extra_groups`) fill the other slots, the vector is summed over them (adding zeros is
    exact) and then summed in that fixed order. So a layout whose gradients are bitwise the single process's
    (pipeline parallelism without sharding) gets its norm bitwise too. None entries (no gradient) count 0."""
    slots = list(range(len(grads))) if slots is None else slots
    by_groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for slot, g in zip(slots, grads, strict=True):
        if g is not None:
            local, groups = _local_and_groups(g.detach())
            by_groups.setdefault(groups, []).append((slot, local))
    squares = torch.zeros(len(grads) if num_slots is None else num_slots, dtype=torch.float32, device=device)
    for groups, items in by_groups.items():
        sq = torch.stack(torch._foreach_norm([t for _, t in items], 2, dtype=torch.float32)).square()
        for group in groups:
            dist.all_reduce(sq, group=group)
        squares[[slot for slot, _ in items]] = sq
    for group in extra_groups:
        dist.all_reduce(squares, group=group)
    return squares.sum().sqrt()


def clip_grads_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients in place by min(max_norm / (norm + 1e-6), 1) (no host read of the norm)."""
    torch._foreach_mul_([_local(g) for g in grads], clip_coefficient(norm, max_norm))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(max_norm / (norm + 1e-6), 1), as a tensor (torch.nn.utils.clip_grad_norm_'s coefficient)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_grad_norm_(grads: list[torch.Tensor | None], max_norm: float, device: torch.device,
                    extra_groups: tuple = (), slots: list[int] | None = None,
                    num_slots: int | None = None) -> torch.Tensor:
    """The global norm before clipping (see global_grad_norm); clips in place when max_norm > 0."""
    norm = global_grad_norm(grads, device, extra_groups, slots, num_slots)
    present = [g for g in grads if g is not None]
    if max_norm > 0 and present:
        clip_grads_(present, max_norm, norm)
    return norm


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
