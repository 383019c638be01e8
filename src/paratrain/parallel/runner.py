"""The step runner: forward and backward over the microbatches of one optimizer step.

`Runner` is what the training loop talks to. This base class runs the model on one device with gradient
accumulation; the parallel techniques in this package wrap the model and extend the runner (data-parallel
gradient sync, pipeline schedules), so the loop itself never changes with the layout.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.device import autocast, to_device
from paratrain.model.llama import aux_loss, cross_entropy_loss
from paratrain.parallel import grad_norm


def plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (e.g. a loss-parallel loss) as an ordinary tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def multi_tensor_kernels_take(params) -> bool:
    """Whether AdamW's multi-tensor kernels (foreach, fused) take these parameters in one call: they reject a
    mix of DTensor and plain tensors (TP without SP leaves norm weights plain; experts under DDP are DTensors
    among plain dense weights). DTensors on different meshes (experts on their own (edp, ep, etp) mesh) are
    fine: DTensor checks a foreach op's meshes index by index (torch 2.13; the expert layouts of
    tests/test_expert_layouts.py against the single device). The per-parameter loop such layouts got before
    propagated the sharding of each of its ~8 ops per parameter the first time a layout was seen: ~1 CPU-s a
    rank of the 2-layer tiny MoE model under EP2 x TP2 x FSDP, most of that case's first run."""
    return len({isinstance(p, DTensor) for p in params}) <= 1


class StepHooks:
    """What the training loop asks of a runner around each optimizer step, besides forward/backward: an explicit
    hook object (`runner.hooks`), so the loop never guesses a runner's kind from its attributes. These defaults
    are synchronous training's; the stale-gradient runner passes its own (parallel/stale_dp.py `StaleStepHooks`)."""

    def attach_optimizer(self, optimizer, scheduler=None) -> None:
        """Called once, right after the optimizer and its schedule are built."""

    def applied_update(self) -> bool:
        """Whether this step applied a gradient (the learning-rate schedule advances only then)."""
        return True

    def step_tokens(self, default_tokens: int) -> int:
        """Tokens the step's update was computed from."""
        return default_tokens

    def step_metrics(self) -> dict:
        """Extra fields for the step's metrics record."""
        return {}

    def stragglers(self) -> list[int]:
        """Data-parallel ranks flagged as straggling now."""
        return []

    def straggler_ratios(self) -> list[float]:
        """Each data-parallel rank's step time over the typical one (empty when unknown)."""
        return []

    def hosts(self) -> list[str]:
        """Host name of every data-parallel rank (eviction requests name hosts)."""
        return []

    def finish(self) -> None:
        """The run ends: wait for communication still in flight."""


class Runner:
    norm_groups: tuple = ()  # groups whose ranks hold different parameters (pipeline stages): none here
    norm_slots: tuple = (None, None)  # (slot of each parameter in the single-device order, count): all held here

    def __init__(self, model: nn.Module, microbatch: int, device: torch.device, dtype: str = "fp32",
                 dp_rank: int = 0, dp_size: int = 1):
        self.model = model
        self.parts: list[nn.Module] = [model]
        self.microbatch = microbatch
        self.device = device
        self.autocast_dtype = torch.bfloat16 if dtype == "bf16" else None
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.hooks: StepHooks = StepHooks()

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
        return autocast(self.device, self.autocast_dtype)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's local batch; return the global loss."""
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        chunks = list(zip(inputs.split(self.microbatch), targets.split(self.microbatch), strict=True))
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(chunks):
            with self.no_sync(last=i == len(chunks) - 1):
                with self.autocast():
                    loss = self.loss_fn(self.model(x), y) / len(chunks)
                    aux = aux_loss(self.model)  # MoE load balancing: trained, not reported in the loss
                # two roots, one backward: a loss-parallel loss is a DTensor, the aux loss a plain tensor
                torch.autograd.backward([loss] if aux is None else [loss, aux / len(chunks)])
            total += plain(loss.detach())
        return self.reduce_loss(total)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        losses = []
        for x, y in zip(inputs.split(self.microbatch), targets.split(self.microbatch), strict=True):
            with self.autocast():
                losses.append(plain(self.loss_fn(self.model(x), y)))
        return self.reduce_loss(torch.stack(losses).mean())

    def reduce_layer_sums(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a per-layer statistic (a tensor indexed by the single-device layer number, zeros for layers this
        rank does not hold; e.g. router token counts) over the ranks that see other tokens and hold other
        layers: none in one process."""
        return t

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm (0 disables clipping); returns the norm before clipping as a 0-dim
        device tensor (reading it is the caller's host synchronisation, when it logs)."""
        return grad_norm.clip_grad_norm_([p.grad for p in self.parameters()], max_norm, self.device)


class ParallelRunner(Runner):
    """A Runner for tensor/sequence/data-parallel layouts on one DeviceMesh.

    - loss parallel: forward and backward run under `loss_parallel()`, so the cross-entropy of vocab-sharded
      logits is computed without gathering them (each rank reduces max/sum-exp/target-logit over the TP group).
    - data parallel: gradients are reduced only on the last microbatch (`dp.sync_context`), and `dp.finish()`
      waits for the reductions still in flight when backward ends; the reported loss is averaged over dp.
    - the gradient norm is global: each gradient's local shard contributes its sum of squares, reduced over
      exactly the mesh dimensions it is sharded on (never double counting replicas).
    """

    def __init__(self, model: nn.Module, microbatch: int, device: torch.device, dtype: str = "fp32",
                 dp_rank: int = 0, dp_size: int = 1, dp=None, loss_parallel: bool = False,
                 norm_groups: tuple = (), vocab_mesh=None):
        super().__init__(model, microbatch, device, dtype, dp_rank, dp_size)
        self.vocab_mesh = vocab_mesh  # dp mesh of a vocab-parallel head (parallel/vocab.py): targets gathered
        self.dp = dp
        self.loss_parallel = loss_parallel
        self.norm_groups = norm_groups  # extra groups whose ranks hold different parameters (pipeline stages)
        # (slot of each parameter in the single-device order, number of slots); None = this rank holds them all
        self.norm_slots: tuple = (None, None)

    def step_context(self):
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.vocab_mesh is not None:  # the logits are the whole dp group's rows: so are the targets
            from paratrain.parallel.vocab import gather_targets

            targets = gather_targets(targets, self.vocab_mesh)
        return super().loss_fn(logits, targets)

    def no_sync(self, last: bool):
        return self.dp.sync_context(last) if self.dp is not None else contextlib.nullcontext()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.dp is not None:
            self.dp.begin_step()
        with self.step_context():
            loss = super().forward_backward(inputs, targets)
        if self.dp is not None:
            self.dp.finish()
        return loss

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.step_context():
            return super().eval_loss(inputs, targets)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.dp is None or self.dp_size == 1:
            return loss
        import torch.distributed as dist

        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp.group)
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return grad_norm.clip_grad_norm_([p.grad for p in self.parameters()], max_norm, self.device,
                                         self.norm_groups, *self.norm_slots)

    def reduce_layer_sums(self, t: torch.Tensor) -> torch.Tensor:
        """Summed over the data-parallel group the loss is averaged over (dp, and cp: ranks that see other
        tokens; expert-parallel ranks are dp ranks; tp ranks see the same tokens and are not summed) and over
        `norm_groups` (pipeline stages: other layers, whose slots are zeros here)."""
        import torch.distributed as dist

        t = t.clone()
        groups = ((self.dp.group,) if self.dp is not None else ()) + tuple(self.norm_groups)
        for group in groups:
            dist.all_reduce(t, group=group)
        return t
