"""Parallel techniques, applied to the single-device model by `parallelize()` in a fixed order.

Order (as torchtitan): pipeline split -> tensor/sequence parallel -> activation recomputation ->
data parallel (FSDP2/DDP/HSDP). Each technique lives in its own small file.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from paratrain.config import TrainConfig
from paratrain.parallel.mesh import DistEnv
from paratrain.parallel.runner import Runner


def parallelize(model: nn.Module, cfg: TrainConfig, mesh: DeviceMesh | None, env: DistEnv) -> Runner:
    """Wrap `model` for the layout in cfg.parallel and return the runner the training loop drives."""
    if mesh is None:
        model.to(env.device)
        return Runner(model, cfg.train.microbatch, env.device, cfg.train.dtype)
    raise NotImplementedError("multi-rank layouts are being built (issue 3)")
