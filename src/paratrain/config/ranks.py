"""How global ranks map onto the mesh dimensions (parallel.rank_order), written once for the runtime's DeviceMesh
(parallel/mesh.py), the launcher's host checks (launch/torchrun.py) and the planner's strides (plan/step.py).
torch-free (numpy only).

An order names the dimensions innermost first, as Megatron-Core's `order` does (megatron/core/parallel_state.py,
RankGenerator / generate_masked_orthogonal_rank_groups): in "tp-cp-dp-pp" consecutive ranks differ in their tp
index, and a rank is tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)). A dimension's stride is the product
of the sizes of the dimensions inside it; its groups are the ranks that differ only in its index.
"""

from __future__ import annotations

import numpy as np

RANK_DIMS = ("tp", "cp", "dp", "pp")
# today's (and every earlier release's) mapping: the mesh (pp, dp, cp, tp) outermost to innermost. It is
# Megatron-Core's default "tp-cp-ep-dp-pp" without ep (ep refolds dp x cp x tp here) and torchtitan's mesh
# [pp, dp_replicate, dp_shard, cp, tp] (torchtitan/distributed/parallel_dims.py).
DEFAULT_RANK_ORDER = "tp-cp-dp-pp"
# The mesh's dimension names, outermost to innermost, whatever the order: every module indexes mesh["dp"] etc.
MESH_DIMS = ("pp", "dp", "cp", "tp")
HSDP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def order_dims(order: str) -> tuple[str, ...]:
    """The dimension names of an order, innermost first (no check: see valid_order)."""
    return tuple(order.strip().lower().split("-"))


def valid_order(order: str) -> bool:
    """A permutation of tp, cp, dp, pp with tp first (innermost): TP exchanges activations in every layer on
    the compute's critical path, so it keeps the fastest links; every stack's order keeps it there."""
    dims = order_dims(order)
    return sorted(dims) == sorted(RANK_DIMS) and dims[0] == "tp"


def expand_hsdp(order: str) -> tuple[str, ...]:
    """An order's dimensions with dp split as HSDP splits it: dp_shard inside, dp_replicate outside (FSDP2's HSDP
    mesh, replicas outermost of the two), at dp's place."""
    out: list[str] = []
    for d in order_dims(order):
        out += ["dp_shard", "dp_replicate"] if d == "dp" else [d]
    return tuple(out)


def dim_strides(dims: tuple[str, ...], sizes: dict):
    """{dim: stride}: the product of the sizes of the dimensions inside it (dims innermost first). sizes may hold
    numpy arrays (the planner's grid): the strides are then arrays."""
    strides, inner = {}, 1
    for d in dims:
        strides[d] = inner
        inner = inner * sizes[d]
    return strides


def mesh_ranks(dims: tuple[str, ...], sizes: dict, mesh_dims: tuple[str, ...]) -> np.ndarray:
    """The global ranks laid out on a mesh whose axes are `mesh_dims` (any order): rank r sits at the indices of its
    coordinates under `dims` (innermost first). arange(world) reshaped outermost first, then the axes permuted."""
    outer_first = tuple(reversed(dims))
    grid = np.arange(int(np.prod([sizes[d] for d in outer_first]))).reshape(tuple(sizes[d] for d in outer_first))
    return np.transpose(grid, [outer_first.index(d) for d in mesh_dims])


def rank_groups(dims: tuple[str, ...], sizes: dict, group: tuple[str, ...]) -> list[list[int]]:
    """The process groups of the dimensions `group` together (Megatron's RankGenerator.get_ranks("dp-cp")): every
    set of ranks that differ only in those indices, ordered as Megatron orders them (inside a group by the group's
    dims innermost first, the groups by the other dims innermost first)."""
    outer_first = tuple(reversed(dims))
    others = tuple(d for d in outer_first if d not in group)
    grid = mesh_ranks(dims, sizes, others + tuple(d for d in outer_first if d in group))
    return grid.reshape(-1, int(np.prod([sizes[d] for d in group]))).tolist()


def group_geometry(dims: tuple[str, ...], sizes: dict, group: tuple[str, ...]):
    """A group of one or two dimensions as the planner's collective model reads it: (degree, stride, inner,
    outer_stride). The ranks are `inner` members `stride` apart, repeated every `outer_stride`; a contiguous group
    (one dimension, or two adjacent in the order) has inner = degree (outer_stride then unused). Works on numpy
    arrays of sizes element-wise (a dimension of size 1 adds nothing to where the group's members sit)."""
    strides = dim_strides(dims, sizes)
    if len(group) == 1:
        (d,) = group
        return sizes[d], strides[d], sizes[d], strides[d] * sizes[d]
    a, b = sorted(group, key=dims.index)  # a inside b
    na, nb, sa, sb = sizes[a], sizes[b], strides[a], strides[b]
    degree = na * nb
    if dims.index(b) == dims.index(a) + 1:  # adjacent: one run of degree ranks sa apart
        return degree, sa, degree, sa * degree
    # split by the dimensions between them; a size-1 part leaves the other's run alone
    one_a = np.asarray(na) == 1
    split = (np.asarray(na) > 1) & (np.asarray(nb) > 1) & (np.asarray(sb) != np.asarray(sa) * na)
    stride = np.where(one_a, sb, sa)
    inner = np.where(split, na, degree)
    outer = np.where(split, sb, stride * degree)
    if np.ndim(stride) == 0:
        stride, inner, outer = stride.item(), inner.item(), outer.item()
    return degree, stride, inner, outer


def group_span(stride, inner, outer_stride, degree):
    """The ranks from a group's first member to one past its last: inner x stride for a contiguous group,
    (degree / inner) x outer_stride for a split one (what decides whether it leaves a node)."""
    return np.where(inner >= degree, stride * degree, outer_stride * degree / np.maximum(inner, 1))
