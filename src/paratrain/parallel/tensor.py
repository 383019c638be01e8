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
  gathered. Both shard the (vocab, hidden) matrix on dim 0, so a tied embedding is one parameter for both.
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

from paratrain.config.layout import check_tp_layout  # noqa: F401 - re-exported
from paratrain.device import all_gather_single
from paratrain.model.config import ModelConfig
from paratrain.parallel.recompute import notify_kept
from paratrain.parallel.vocab import tie_embeddings


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


def block_plan(model_cfg: ModelConfig, tp: int, sp: bool, moe: bool = False) -> dict[str, ParallelStyle]:
    """The parallel style of each submodule of one TransformerBlock (`moe`: a mixture-of-experts layer, whose
    routed experts parallel/expert.py shards over tp; its shared experts are split like the dense MLP)."""
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
    if moe:  # parallel/expert.py takes the block's input as it comes (replicated, or the sp shard)
        for key in ("feed_forward", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"):
            del plan[key]
        if model_cfg.shared_experts:
            plan |= {"feed_forward.shared_experts.w1": ColwiseParallel(),
                     "feed_forward.shared_experts.w3": ColwiseParallel(),
                     "feed_forward.shared_experts.w2": RowwiseParallel(output_layouts=residual)}
    return plan


class _ShardHolder:
    """What autograd keeps instead of a sequence-gathered activation: this rank's sequence shard."""

    def __init__(self, shard: torch.Tensor):
        self.shard = shard
        self.full: torch.Tensor | None = None  # re-gathered once in backward, shared by every saved view
        self._gather: tuple | None = None  # (work, buffer) of an all-gather started ahead of its use

    def start_gather(self, group, tp: int) -> None:
        """Launch the all-gather of the shard without waiting (idempotent)."""
        if self.full is None and self._gather is None:
            shape = (tp * self.shard.shape[0], *self.shard.shape[1:])  # the ranks' shards stacked along dim 0
            buffer = torch.empty(shape, dtype=self.shard.dtype, device=self.shard.device)
            self._gather = (all_gather_single(buffer, self.shard, group=group, async_op=True), buffer)

    def gathered(self, group, tp: int) -> torch.Tensor:
        """The full (b, s, h) activation: waits for the gather started ahead, or runs it now."""
        if self.full is None:
            self.start_gather(group, tp)
            work, buffer = self._gather
            work.wait()
            self.full = torch.cat(buffer.chunk(tp, dim=0), dim=1)  # rank order along the sequence
            self._gather = None
        return self.full


def _local_of(t: torch.Tensor) -> torch.Tensor:
    while True:
        if isinstance(t, DTensor):
            t = t._local_tensor
        elif type(t).__name__ == "AsyncCollectiveTensor":
            t = t.trigger_wait()
        else:
            return t


class SaveGatheredInputAsShard:
    """Sequence parallelism's last factor of t: keep only the local shard of the all-gathered TP-region input.

    Entering attention/feed_forward, SP all-gathers the normalised activation along the sequence; the
    column-parallel linears then save that full (b, s, h) tensor for their weight gradients, on every rank.
    Like Megatron-LM, keep this rank's (b, s/t, h) slice instead and all-gather it again when backward needs
    it (one extra all-gather per TP region in backward), so every saved activation divides by t.
    That all-gather is started as soon as backward reaches the region's output (a gradient hook), and waited for
    only when the column-parallel linears need their input: it runs behind the region's later backward work
    (the row-parallel output projection and, for attention, the attention core), as Megatron-LM overlaps it.
    Skipped inside a fully recomputed block (that keeps only the block input anyway)."""

    def __init__(self, tp_mesh: DeviceMesh, block: nn.Module):
        self.group = tp_mesh.get_group()
        self.tp, self.rank = tp_mesh.size(), tp_mesh.get_local_rank()
        self.block = block
        self._gathered: torch.Tensor | None = None
        self._holders: dict[int, _ShardHolder] = {}
        self._ctx = None

    def register(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._enter)  # after PrepareModuleInput's gather (registered earlier)
        module.register_forward_hook(self._exit, always_call=True)

    def _enter(self, _module, args):
        if getattr(self.block, "_paratrain_recompute", False) or not torch.is_grad_enabled():
            return
        self._gathered = _local_of(args[0])
        self._holders = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def _exit(self, _module, _args, output):
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx, self._gathered = None, None
            holders = list(self._holders.values())
            if holders and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._prefetch_hook(holders))

    def _prefetch_hook(self, holders: list[_ShardHolder]):
        def prefetch(grad):  # backward has reached this region's output: gather its input behind its backward
            for holder in holders:
                holder.start_gather(self.group, self.tp)
            return grad

        return prefetch

    def _pack(self, t: torch.Tensor):
        loc, gathered = _local_of(t), self._gathered
        ptr = loc.untyped_storage().data_ptr()
        if (gathered is None or ptr != gathered.untyped_storage().data_ptr() or loc.numel() != gathered.numel()
                or not loc.is_contiguous() or not gathered.is_contiguous()):
            notify_kept((t,))
            return t
        if ptr not in self._holders:  # wq, wk, wv (or w1, w3) save the same tensor: keep one shard
            seq_shard = gathered.chunk(self.tp, dim=1)[self.rank]
            self._holders[ptr] = _ShardHolder(seq_shard.clone())
            notify_kept((self._holders[ptr].shard,))
        meta = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return self._holders[ptr], loc.shape, meta

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        holder, local_shape, meta = packed
        local = holder.gathered(self.group, self.tp).view(local_shape)
        if meta is None:
            return local
        mesh, placements, shape, stride = meta
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sp: bool, loss_parallel: bool = True,
             save_shards: bool = True) -> nn.Module:
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
    if cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        tie_embeddings(model)  # one Shard(0) parameter for both (no pipeline split: the config refuses tied + pp)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(cfg, tp, sp, moe=cfg.is_moe_layer(block.layer_id)))
        if sp and save_shards:
            for region in (block.attention, block.feed_forward):
                SaveGatheredInputAsShard(tp_mesh, block).register(region)
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
