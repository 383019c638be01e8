"""Tensor parallelism (Megatron column/row), sequence parallelism and loss parallelism, with DTensor styles.

Plan for one block (t = tensor-parallel degree):
- attention: wq/wk/wv column-parallel (each rank holds heads/t query heads and kv_heads/t kv heads), wo
  row-parallel; feed_forward: w1 (gate) and w3 (up) column-parallel, w2 (down) row-parallel. One all-reduce
  of the block-half output in forward (and one of the input gradient in backward) per half.
- sequence parallel (sp=True): the norms and residual stream between the TP regions are sharded along the
  sequence (dim 1). Entering a TP region all-gathers the sequence, leaving it reduce-scatters (instead of the
  all-reduce), so norm inputs/outputs and the residual take 1/t of the memory.
- vocabulary-parallel embedding (rows = vocab sharded) and a column-parallel output head whose logits stay
  sharded on the vocab dimension; the loss is computed under `loss_parallel()`, so full logits are never
  gathered.
- grouped-query attention with kv_heads < t (and t % kv_heads == 0): wk/wv stay whole on every rank (replicated,
  they are small), each rank keeps the kv head its query heads use, and their weight gradients are summed over
  the TP group (a Partial gradient) since every query head contributes on exactly one rank.

The residual stream between blocks is a plain local tensor: (b, s, h) without SP, the local sequence shard
(b, s/t, h) with SP. A pipeline stage without the embedding therefore receives (and one without the head
returns) the local shard when SP is on.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from paratrain.model.config import ModelConfig
from paratrain.parallel.layout import check_tp_layout  # noqa: F401 - re-exported


class ReplicatedKVProjection(ParallelStyle):
    """wk/wv when kv_heads < tp: the whole (small) weight on every rank; each rank keeps its kv head.

    The output slice's gradient is marked Partial, so the weight gradient is summed over the TP group and the
    input gradient is all-reduced like a column-parallel input's."""

    def __init__(self, head_dim: int, kv_heads: int):
        super().__init__()
        self.head_dim, self.kv_heads = head_dim, kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        kv_index = device_mesh.get_local_rank() * self.kv_heads // tp
        cols = slice(kv_index * self.head_dim, (kv_index + 1) * self.head_dim)

        def partition(_name, mod, mesh):
            for name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def prepare_input(_mod, inputs, mesh):
            x = inputs[0]
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False) if not isinstance(x, DTensor) else x

        def prepare_output(_mod, out, _mesh):
            return out.to_local(grad_placements=[Partial()])[..., cols]

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)


def block_plan(model_cfg: ModelConfig, tp: int, sp: bool) -> dict[str, ParallelStyle]:
    """The parallel style of each submodule of one TransformerBlock."""
    residual = Shard(1) if sp else Replicate()
    kv_style = (ColwiseParallel() if model_cfg.n_kv_heads % tp == 0
                else ReplicatedKVProjection(model_cfg.head_dim, model_cfg.n_kv_heads))
    plan: dict[str, ParallelStyle] = {
        "attention": PrepareModuleInput(input_layouts=(residual, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": kv_style,
        "attention.wv": kv_style,
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sp: bool, loss_parallel: bool = True) -> nn.Module:
    """Shard a Llama (or a pipeline stage of one: tok_embeddings/norm/output may be None) over `tp_mesh`.

    With loss_parallel the model returns logits as a DTensor sharded on the vocab dimension; compute the loss
    inside `torch.distributed.tensor.parallel.loss_parallel()` (ParallelRunner does)."""
    tp = tp_mesh.size()
    cfg: ModelConfig = model.cfg
    residual = Shard(1) if sp else Replicate()
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        # Vocab-parallel embedding: each rank looks up its vocab rows, the partial sums are reduced
        # (all-reduce, or reduce-scatter onto sequence shards with SP).
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=residual,
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(cfg, tp, sp))
    if sp and model.tok_embeddings is None:
        model.register_forward_pre_hook(_full_sequence_positions(tp), with_kwargs=True)
    return model


def _full_sequence_positions(tp: int):
    """A stage fed the local sequence shard (SP) must still take RoPE tables for the whole sequence."""

    def hook(_module, args, kwargs):
        if kwargs.get("positions") is None and (len(args) < 2 or args[1] is None):
            hidden = args[0]
            kwargs["positions"] = torch.arange(hidden.shape[1] * tp, device=hidden.device)
        return args, kwargs

    return hook
