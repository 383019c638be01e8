"""Distributed environment and the device mesh, built from the config and passed explicitly.

Mesh dimensions, outermost to innermost: pp, dp, cp, tp. Consecutive ranks share a tp group, so tensor
parallelism lands on the fastest links (the same NeuronLink ring / NVLink island); pipeline stages are
furthest apart, since they exchange the least (one activation per microbatch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.config import ParallelSection

MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("train.device='cuda' but this torch build sees no CUDA device; allowed here: cpu, auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_request: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the process group torchrun describes in the environment (or run as a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_request, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


def resolve_degrees(pcfg: ParallelSection, world_size: int) -> dict[str, int]:
    """The size of each mesh dimension; dp=-1 takes what the others leave. Errors name the fields."""
    other = pcfg.non_dp_degree()
    dp = world_size // other if pcfg.dp == -1 else pcfg.dp
    if dp < 1 or dp * other != world_size:
        raise ValueError(
            f"parallel: world size {world_size} != pp*dp*cp*tp = {pcfg.pp}*{pcfg.dp}*{pcfg.cp}*{pcfg.tp}; "
            f"allowed: degrees whose product is the number of ranks (set parallel.dp=-1 to infer dp)")
    if pcfg.dp_kind == "hsdp" and dp % pcfg.dp_replicate:
        raise ValueError(f"parallel.dp_replicate={pcfg.dp_replicate} must divide the data-parallel size {dp} "
                         f"(hsdp: dp = dp_replicate x dp_shard)")
    return {"pp": pcfg.pp, "dp": dp, "cp": pcfg.cp, "tp": pcfg.tp}


def build_mesh(pcfg: ParallelSection, env: DistEnv) -> DeviceMesh | None:
    """A DeviceMesh over all ranks, or None for a single process (no process group needed)."""
    degrees = resolve_degrees(pcfg, env.world_size)
    if env.world_size == 1:
        return None
    if pcfg.dp_kind == "hsdp":
        # dp split into (dp_replicate: across nodes) x (dp_shard: within); "dp" stays addressable as a whole.
        dims = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        sizes = (degrees["pp"], pcfg.dp_replicate, degrees["dp"] // pcfg.dp_replicate, degrees["cp"], degrees["tp"])
        mesh = init_device_mesh(env.device.type, sizes, mesh_dim_names=dims)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh
    return init_device_mesh(env.device.type, tuple(degrees[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
