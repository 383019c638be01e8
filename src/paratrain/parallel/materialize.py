"""Materialise a model built on the meta device, shard by shard, after the layout has been applied.

The torchtitan way: the model is constructed on `meta` (no memory), `parallelize()` applies the layout
(pipeline split, TP/SP, CP, recompute, FSDP/HSDP) to the meta parameters, and only then does each rank
allocate its own shards (`to_empty`) and fill them. A rank never holds a full copy of a parameter that the
layout shards: each shard is filled from a *row source* (`paratrain.model.init` for the layout-independent
random initialisation, `paratrain.model.hf` for Hugging Face safetensors), which produces the rows the shard
needs one aligned read (one or more blocks) at a time; consecutive rows are copied into the shard in batches of
at most 2^20 values.
Peak memory beyond the shards: one batch (never more than the shard itself).

Which global rows/columns a shard holds comes from DTensor's own rule for its placements (Shard and FSDP's
_StridedShard, including uneven splits), the rule DCP uses to reshard checkpoints, so a shard filled here is
exactly the slice of the single-device tensor that the layout puts on this rank. Plain (unsharded) parameters
are filled whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _is_shard_like

from paratrain.model.init import (
    build_on_meta,  # noqa: F401 - re-exported: build, parallelize, materialize
    rows_per_read,
)

# name, global shape -> row source (see paratrain.model.init)
SourceOf = Callable[[str, tuple[int, ...]], object]


def on_meta(modules: Iterable[nn.Module]) -> bool:
    """Whether the modules' parameters are still unmaterialised (meta)."""
    return any(_local(p).is_meta for m in modules for p in m.parameters())


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if isinstance(p, DTensor) else p


def shard_index(p: torch.Tensor) -> tuple[tuple[int, ...], list[torch.Tensor | None]]:
    """(global shape, per dim: the global indices this rank's local tensor holds, in order; None = all)."""
    shape = tuple(p.shape)
    index: list[torch.Tensor | None] = [None] * len(shape)
    if not isinstance(p, DTensor):
        return shape, index
    mesh, coord = p.device_mesh, p.device_mesh.get_coordinate()
    sizes = list(shape)
    for mesh_dim, placement in enumerate(p.placements):
        if not _is_shard_like(placement):
            continue
        d = placement.dim
        size, offsets = _get_shard_size_and_offsets(sizes[d], mesh.size(mesh_dim), coord[mesh_dim], placement,
                                                    index[d], shape[d], False)
        sizes[d] = size
        index[d] = offsets.long() if size > 0 else torch.empty(0, dtype=torch.long)
    local_shape = tuple(p._local_tensor.shape)
    if tuple(sizes) != local_shape:  # DTensor's rule and the actual shard disagree: never fill silently
        raise RuntimeError(f"shard of shape {local_shape} but placements {p.placements} of a {shape} tensor give "
                           f"{tuple(sizes)}")
    return shape, index


def _runs(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first global row, number of rows, first local row) of each run of consecutive global rows."""
    if rows.numel() == 0:
        return []
    breaks = (torch.nonzero(rows[1:] - rows[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, rows.numel()]
    return [(int(rows[s]), e - s, s) for s, e in zip(starts, ends, strict=True)]


def _is_range(idx: torch.Tensor) -> bool:
    return idx.numel() == 0 or bool((idx == torch.arange(int(idx[0]), int(idx[0]) + idx.numel())).all())


@torch.no_grad()
def fill_shard_(local: torch.Tensor, shape: tuple[int, ...], index: list[torch.Tensor | None], source) -> None:
    """Write the rows/columns `index` of a `shape` tensor, read block by block from `source`, into `local`."""
    if local.numel() == 0:
        return
    rows = index[0] if index[0] is not None else torch.arange(shape[0])
    bounds, picks = [], []
    for idx in index[1:]:
        if idx is None:
            bounds.append(None)
            picks.append(None)
        else:
            lo = int(idx.min())
            bounds.append((lo, int(idx.max()) + 1))
            picks.append(None if _is_range(idx) else idx - lo)
    step = rows_per_read(source)
    batch = _CopyBatch(local)
    for first, count, k in _runs(rows):
        r = first
        while r < first + count:
            stop = min(first + count, (r // step + 1) * step)  # never cross an aligned read
            chunk = source.read(r, stop, bounds)
            for d, pick in enumerate(picks, start=1):
                if pick is not None:
                    chunk = chunk.index_select(d, pick)
            batch.add(k + r - first, chunk)
            r = stop
    batch.flush()


class _CopyBatch:
    """Consecutive rows gathered on the host and copied into the (device) shard together, up to FLUSH_ELEMS
    values: one host-to-device copy per few MB instead of one per row (a matrix's random block is one row)."""

    FLUSH_ELEMS = 2**20

    def __init__(self, local: torch.Tensor):
        self.local, self.chunks, self.start, self.rows, self.numel = local, [], 0, 0, 0

    def add(self, at: int, chunk: torch.Tensor) -> None:
        if self.chunks and (at != self.start + self.rows or self.numel + chunk.numel() > self.FLUSH_ELEMS):
            self.flush()
        if not self.chunks:
            self.start = at
        self.chunks.append(chunk)
        self.rows += chunk.shape[0]
        self.numel += chunk.numel()

    def flush(self) -> None:
        if self.chunks:
            rows = self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)
            self.local[self.start:self.start + self.rows].copy_(rows)
        self.chunks, self.rows, self.numel = [], 0, 0

def _to_empty(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)` keeping every parameter object (swapped in place, not replaced), so references
    taken while the layout was applied on meta (FSDP2's, DDP's parameter list) see the real tensors. Hooks
    registered on a meta parameter do not survive the swap: DDP registers its hooks after (`DataParallel.ready`).
    FSDP2 re-pads its shards in its `_apply` override."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


@torch.no_grad()
def materialize(parts: list[nn.Module], device: torch.device | None, source_of: SourceOf) -> None:
    """Allocate this rank's shards of every parameter of `parts` on `device` and fill them from `source_of`;
    recompute the derived buffers (RoPE tables). Parameter names are the single-device model's.
    device=None: the parameters are already allocated; only fill them."""
    for part in parts:
        if device is not None:
            _to_empty(part, device)
        for name, p in part.named_parameters():
            shape, index = shard_index(p)
            fill_shard_(_local(p), shape, index, source_of(name, shape))
        if hasattr(part, "init_buffers"):
            part.init_buffers()


def random_init(cfg) -> SourceOf:
    """The layout-independent random initialisation of cfg's model (a TrainConfig) for seed cfg.train.seed."""
    from paratrain.model.init import init_source

    seed, layers = cfg.train.seed, cfg.model_shape().layers
    return lambda name, shape: init_source(seed, name, shape, layers)


def place(parts: list[nn.Module], device: torch.device, meta: bool, source_of: SourceOf, dp=None) -> None:
    """Materialise meta parts on `device` (else move them there), then finish the data-parallel setup that
    needs the weights (DDP's replica check and gradient hooks)."""
    if meta:
        materialize(parts, device, source_of)
    else:
        for part in parts:
            part.to(device)
    if dp is not None:
        dp.ready()
