"""Distributed environment and the device mesh, built from the config and passed explicitly.

Mesh dimensions, outermost to innermost: pp, dp, cp, tp (expert parallelism refolds dp x cp x tp as edp x ep x etp:
parallel/expert.py expert_mesh). Which ranks sit where on them is parallel.rank_order (paratrain.config.ranks,
the rule the launcher and the planner read too): by default consecutive ranks share a tp group, so tensor
parallelism lands on the fastest links (the same NeuronLink ring / NVLink island), and pipeline stages are
furthest apart, since they exchange the least (one activation per microbatch); tp-cp-pp-dp puts dp outermost
instead (Llama 3's layout). The mesh's axes keep their names and order either way, so mesh["dp"] etc. hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.config import MESH_DIMS, ParallelSection, resolve_degrees  # noqa: F401 (re-exported)
from paratrain.config.ranks import HSDP_MESH_DIMS, expand_hsdp, mesh_ranks, order_dims
from paratrain.device import backend_for, pick_device  # noqa: F401 (pick_device re-exported)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_request: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the process group torchrun describes in the environment (or run as a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_request, local_rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device.type), timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


def shutdown_distributed() -> None:
    """Leave the process group cleanly once every rank is done: without this, gloo's worker threads and any
    pipeline send still held by a work object are torn down by the interpreter at exit, which aborts the
    process now and then ("terminate called without an active exception") after a successful run."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def build_mesh(pcfg: ParallelSection, env: DistEnv) -> DeviceMesh | None:
    """A DeviceMesh over all ranks, or None for a single process (no process group needed)."""
    degrees = resolve_degrees(pcfg, env.world_size)
    if env.world_size == 1:
        return None
    if pcfg.dp_kind == "hsdp":
        # dp split into (dp_replicate: across nodes) x (dp_shard: within); "dp" stays addressable as a whole.
        sizes = {**degrees, "dp_replicate": pcfg.dp_replicate, "dp_shard": degrees["dp"] // pcfg.dp_replicate}
        mesh = _mesh(env, expand_hsdp(pcfg.rank_order), sizes, HSDP_MESH_DIMS)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh
    return _mesh(env, order_dims(pcfg.rank_order), degrees, MESH_DIMS)


def _mesh(env: DistEnv, order: tuple[str, ...], sizes: dict[str, int], names: tuple[str, ...]) -> DeviceMesh:
    """The mesh with axes `names` whose ranks sit as `order` (innermost first) places them. The default order's
    grid is init_device_mesh's own (row-major arange); any other is DeviceMesh's explicit mesh tensor (torch 2.13
    keeps it as a rank map, so slicing and _flatten follow the real ranks)."""
    ranks = mesh_ranks(order, sizes, names)
    if order == tuple(reversed(names)):
        return init_device_mesh(env.device.type, ranks.shape, mesh_dim_names=names)
    return DeviceMesh(env.device.type, torch.from_numpy(ranks.copy()), mesh_dim_names=names)
