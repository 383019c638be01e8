"""The step runner: forward and backward over the microbatches of one optimizer step.

`Runner` is what the training loop talks to. This base class runs the model on one device with gradient
accumulation; the parallel techniques in this package wrap the model and extend the runner (data-parallel
gradient sync, pipeline schedules), so the loop itself never changes with the layout.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from paratrain.model.llama import cross_entropy_loss


class Runner:
    def __init__(self, model: nn.Module, microbatch: int, device: torch.device, dtype: str = "fp32",
                 dp_rank: int = 0, dp_size: int = 1):
        self.model = model
        self.parts: list[nn.Module] = [model]
        self.microbatch = microbatch
        self.device = device
        self.autocast_dtype = torch.bfloat16 if dtype == "bf16" else None
        self.dp_rank, self.dp_size = dp_rank, dp_size

    # -- hooks that parallel techniques override ---------------------------------------------------------
    def no_sync(self, last: bool):
        """Context for one microbatch's backward: skip gradient sync except on the last one."""
        return contextlib.nullcontext()

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(logits, targets)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel ranks, so every rank reports the global batch's loss."""
        return loss

    # -- the step -------------------------------------------------------------------------------------
    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's local batch; return the global loss."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        chunks = list(zip(inputs.split(self.microbatch), targets.split(self.microbatch), strict=True))
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(chunks):
            with self.no_sync(last=i == len(chunks) - 1):
                with self.autocast():
                    loss = self.loss_fn(self.model(x), y) / len(chunks)
                loss.backward()
            total += loss.detach()
        return self.reduce_loss(total)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        losses = []
        for x, y in zip(inputs.split(self.microbatch), targets.split(self.microbatch), strict=True):
            with self.autocast():
                losses.append(self.loss_fn(self.model(x), y))
        return self.reduce_loss(torch.stack(losses).mean())

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global gradient norm; returns the norm before clipping."""
        params = [p for p in self.parameters() if p.grad is not None]
        if max_norm <= 0:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            return float(norm)
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
