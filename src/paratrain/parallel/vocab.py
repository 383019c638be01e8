"""Vocabulary parallelism over the data-parallel ranks (parallel.vocab_parallel = "dp"): Megatron's
VocabParallelEmbedding and vocab-parallel cross entropy, over the FSDP/DDP group instead of the TP group.

Why: under FSDP the embedding and the output head belong to the root unit, which is gathered whole on every rank
from the first forward to the end of backward, with its unsharded gradient beside it. For Llama 3.2 3B that is a
128,256 x 3,072 (tied) matrix, 0.79 GB in bf16, several times one block, gathered on every rank: it, not the
blocks, sets each rank's peak. Here each dp rank keeps rows [r V/dp, (r+1) V/dp) of the (tied) matrix for good,
outside FSDP, and what moves instead are the token ids and hidden states of the dp group's microbatches, which
are small at the sequence lengths this is for (dp * b * s * hidden values, against vocab * hidden):
- embedding: all-gather the token ids of every dp rank, look up the local rows (ids outside the local range
  masked to zero), reduce-scatter the partial sums back onto each rank's own batch rows;
- head: all-gather the final hidden states, multiply by the local rows: logits of the whole dp batch for the
  local vocab slice (dp*b, s, V/dp), never the full vocabulary; the cross entropy then reduces max, sum-exp and
  the target logit over the dp group (torch's loss_parallel), with the targets all-gathered likewise.

Built from DTensor's own styles on the 1-D dp mesh: RowwiseParallel of an nn.Embedding is the masked lookup +
reduce(-scatter) (MaskPartial), ColwiseParallel of the head gathers its input and keeps the logits sharded on
the vocabulary, and `loss_parallel()` is the vocab-parallel cross entropy. What they do not cover, and is
written here: the gradient scale. loss_parallel's loss is the mean over the whole dp batch (every rank gets the
same value, the global loss L = mean_q L_q), so the weight shards' gradients come out as FSDP's averaged ones
(dL/dW, nothing to reduce), but the hidden states' gradients come out 1/dp of what the blocks expect: FSDP/DDP
average the blocks' gradients over the ranks themselves (they start from each rank's own loss L_q). So the
head's input gradient is multiplied by dp and the embedding's output gradient divided by dp (exact in binary
for powers of two, and one rounding otherwise).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by `factor` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    return _ScaleGrad.apply(x, factor) if factor != 1 and x.requires_grad else x


def tie_embeddings(model: nn.Module) -> None:
    """Point the head at the embedding's (now sharded) parameter again: parallelize_module replaced each module's
    weight with its own DTensor. Both styles shard the (vocab, hidden) matrix on dim 0 over the same mesh, so the
    one parameter serves both, and its gradient accumulates both uses (as on one device)."""
    emb, head = model.tok_embeddings.weight, model.output.weight
    if emb.placements != head.placements or emb.device_mesh != head.device_mesh:
        raise RuntimeError(f"tied embedding/head sharded differently: {emb.placements} vs {head.placements}")
    model.output.weight = emb


def apply_vocab_dp(model: nn.Module, dp_mesh: DeviceMesh) -> set[nn.Parameter]:
    """Shard the embedding and output head of a whole Llama by vocabulary rows over the 1-D `dp_mesh`; returns
    their parameters, which data parallelism must leave alone (they are sharded already, and their gradients are
    complete on each rank: nothing to reduce)."""
    dp = dp_mesh.size()
    parallelize_module(model, dp_mesh, {
        # token ids (b, s) of this rank -> all-gathered (dp*b, s) -> masked local lookup (Partial) -> reduce-scatter
        # onto this rank's rows (b, s, h)
        "tok_embeddings": RowwiseParallel(input_layouts=Shard(0), output_layouts=Shard(0)),
        # hidden (b, s, h) -> all-gathered (dp*b, s, h) -> logits (dp*b, s, V) sharded on the vocabulary
        "output": ColwiseParallel(input_layouts=Shard(0), output_layouts=Shard(-1), use_local_output=False),
    })
    if model.cfg.tie_embeddings:
        tie_embeddings(model)
    head_dtype = model.output.weight.dtype

    def head_input(_module, args):  # runs before ColwiseParallel's gather (prepended)
        h = args[0]
        if h.is_floating_point() and h.dtype != head_dtype and not torch.is_autocast_enabled(h.device.type):
            h = h.to(head_dtype)  # FSDP's mixed precision does not cover these weights: compute in their dtype
        return (scale_grad(h, float(dp)), *args[1:])

    model.output.register_forward_pre_hook(head_input, prepend=True)
    model.tok_embeddings.register_forward_hook(lambda _m, _a, out: scale_grad(out, 1.0 / dp))
    return {model.tok_embeddings.weight, model.output.weight}


def gather_targets(targets: torch.Tensor, dp_mesh: DeviceMesh) -> torch.Tensor:
    """Every dp rank's targets, stacked along the batch in rank order: the rows of the gathered logits."""
    return DTensor.from_local(targets, dp_mesh, [Shard(0)], run_check=False).full_tensor()
