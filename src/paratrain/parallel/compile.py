"""torch.compile of each block's attention and MLP (train.compile = true).

Submodules, not whole blocks: compiling a whole tensor-parallel block fails in backward in torch 2.13
(DTensor's '_local_tensor' under the compiled graph), while attention and MLP compile under TP, SP and
recompute alike. Each distinct submodule shape compiles once (~30 s cold on CPU; set
TORCHINDUCTOR_CACHE_DIR to keep the cache between runs).
"""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module, enabled: bool) -> nn.Module:
    if not enabled:
        return model
    for module in model.modules():
        if type(module).__name__ in ("Attention", "FeedForward"):
            module.compile()
    return model
