"""Activation recomputation (Korthikanti et al. 2022), with non-reentrant torch.utils.checkpoint.

- "none": autograd keeps every activation its backward needs.
- "selective": only the attention core (softmax(QK^T)V, `CoreAttention`) is recomputed: its score/probability
  tensors (b x heads x s x s, the 5as/h term that grows with sequence length) are not kept; q, k, v are.
- "full": each transformer block is recomputed from its input in backward: only the block input is kept.

The checkpointed module's `forward` is replaced in place (not wrapped in a new module), so parameter names
stay those of the single-device model (checkpoints and pipeline stages rely on them). Apply after tensor
parallelism (the recomputed region then contains the TP collectives, which rerun in backward) and before
FSDP (whose hooks unshard a block's parameters before its backward, hence before the recompute).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextvars import ContextVar

from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.model.llama import CoreAttention

MODES = ("none", "selective", "full")
# Observers are scoped to a `with observe_kept_tensors(...)` block, like torch's own saved_tensors_hooks: a
# context variable (an immutable tuple per context), not a module-level list that callers mutate.
_KEPT_OBSERVERS: ContextVar[tuple[Callable, ...]] = ContextVar("paratrain_kept_observers", default=())


@contextlib.contextmanager
def observe_kept_tensors(callback: Callable):
    """Call `callback(tensors)` with tensors that paratrain's own mechanisms keep for backward outside the
    saved-tensor hooks a caller may install: the inputs a checkpointed region keeps for its recompute, and
    what sequence parallelism keeps in place of gathered activations (its hooks are innermost, so an outer
    saved_tensors_hooks does not see those). Used by the activation-memory accounting."""
    token = _KEPT_OBSERVERS.set((*_KEPT_OBSERVERS.get(), callback))
    try:
        yield
    finally:
        _KEPT_OBSERVERS.reset(token)


def notify_kept(tensors) -> None:
    for observe in _KEPT_OBSERVERS.get():
        observe(tensors)


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make `module` recompute its forward in backward (non-reentrant checkpoint); names unchanged."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        notify_kept(args)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module._paratrain_recompute = True
    return module


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Apply recompute `mode` ("none" | "selective" | "full") to every block of `model` (a Llama or a stage)."""
    if mode not in MODES:
        raise ValueError(f"parallel.recompute='{mode}': allowed: {', '.join(MODES)}")
    if mode == "none":
        return model
    for block in model.layers.values():
        if mode == "full":
            checkpoint_module(block)
        else:
            for sub in block.modules():
                if isinstance(sub, CoreAttention):
                    checkpoint_module(sub)
    return model
