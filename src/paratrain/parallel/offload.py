"""Activation offloading (parallel.offload_layers): the tensors the first N blocks of each model part save for
backward wait in host memory from their forward to their backward, as Megatron-Core's --cpu-offloading-num-layers
(Transformer Engine's cpu_offload: saved-tensor hooks on each layer's forward) and torch's
torch.autograd.graph.save_on_cpu do.

Each offloaded block's `forward` runs under torch.autograd.graph.saved_tensors_hooks: pack copies a saved tensor
to the host (paratrain.device.host_copy: page-locked memory on an accelerator), unpack brings it back to the
device it came from when backward reads it. Parameters are left where they are (their storage outlives the step;
Transformer Engine skips them too). What a checkpointed region keeps (recompute.py) is held by the checkpoint, not
through saved-tensor hooks, and stays on the device: recompute="full" is refused with offloading
(config.rules offload_full_recompute); with "selective" the attention core's inputs stay, the rest moves. The
copies run on the compute stream (no separate copy stream yet): on an accelerator they do not overlap the
block's compute the way Megatron-Core's do, which the planner's timing assumes (plan.step.offload_exposed_s).

Apply after recompute (the checkpoint then runs inside the offloaded forward and keeps its own hooks innermost)
and before compile (the compiled attention and MLP run inside the hooks). The block's `forward` is replaced in
place, so parameter names stay those of the single-device model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextvars import ContextVar

from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from paratrain.device import host_copy, to_device

# Observers of the tensors moved to the host, scoped like observe_kept_tensors (recompute.py): a context variable
_OFFLOAD_OBSERVERS: ContextVar[tuple[Callable, ...]] = ContextVar("paratrain_offload_observers", default=())


@contextlib.contextmanager
def observe_offloaded(callback: Callable):
    """Call `callback(module, host_tensor)` for each saved tensor an offloaded block moves to the host (tests)."""
    token = _OFFLOAD_OBSERVERS.set((*_OFFLOAD_OBSERVERS.get(), callback))
    try:
        yield
    finally:
        _OFFLOAD_OBSERVERS.reset(token)


def _hooks(module: nn.Module) -> saved_tensors_hooks:
    def pack(t):
        if isinstance(t, nn.Parameter):
            return None, t
        kept = host_copy(t)
        for observe in _OFFLOAD_OBSERVERS.get():
            observe(module, kept)
        return t.device, kept

    def unpack(packed):
        device, t = packed
        return t if device is None else to_device(t, device)

    return saved_tensors_hooks(pack, unpack)


def offload_module(module: nn.Module) -> nn.Module:
    """Keep what `module`'s forward saves for backward in host memory until its backward; names unchanged."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with _hooks(module):
            return inner(*args, **kwargs)

    module.forward = forward
    module._paratrain_offload = True
    return module


def apply_offload(model: nn.Module, layers: int) -> nn.Module:
    """Offload the activations of the first `layers` blocks of `model` (a Llama or one pipeline stage; all of
    them where it holds fewer)."""
    for block in list(model.layers.values())[:layers]:
        offload_module(block)
    return model
