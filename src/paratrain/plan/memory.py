"""Memory per device: the activations one layer keeps per token (Korthikanti et al. 2022; torchtitan's per-op
selective checkpointing), the weights, gradients, optimizer state and activations of each pipeline rank, the
communicators' buffers, and whether the rank that needs the most fits.
"""

from __future__ import annotations

import numpy as np

from paratrain.model.config import ModelConfig
from paratrain.plan.kernels import fp8_copies, low_precision_bytes
from paratrain.plan.layer import attention_out_dim, key_value_dims, query_dim
from paratrain.plan.numeric import select
from paratrain.plan.pipeline import _rank_params, inflight_microbatches
from paratrain.plan.precision import (
    BF16_BYTES,
    BF16_OPTIMIZER_BYTES,
    OPTIMIZER_BYTES,
    WEIGHT_BYTES,
)
from paratrain.plan.stages import Loads, balanced_loads, same_rank


def optimizer_state_bytes(opts) -> float:
    """The optimizer's state per parameter: the run's where it names it (Options.optimizer_state_bytes), else fp32
    master, m, v (12) or, without a master copy, bf16 m, v (4)."""
    if opts.optimizer_state_bytes is not None:
        return opts.optimizer_state_bytes
    return OPTIMIZER_BYTES if opts.master_weights else BF16_OPTIMIZER_BYTES


def activation_bytes_per_token(model: ModelConfig, seq: int, attention: str, fp8: bool = False, dropout: bool = True):
    """Korthikanti et al. 2022 activation memory per token per layer, split by how it shards.

    Returns (sp_part, tp_part, core_part) in bytes: sp_part is replicated across TP ranks unless sequence
    parallelism shards it; tp_part is always split by TP; core_part (softmax/dropout of attention scores) is
    split by TP and dropped by selective recompute. GPT: 10h + 24h + 5as = 34h + 5as per token, the paper's
    s*b*h*(34 + 5as/h). Llama: no dropout, RMSNorm, SwiGLU (gate, up and their product kept: 6f), GQA (K,V
    are 2kv each). fp8: the inputs of the FP8 matmuls are kept for backward in FP8, 1 byte (Transformer Engine
    saves the cast input for the weight gradient): QKV and MLP inputs (h each), the output projection's input
    (heads x head_dim) and the second MLP matmul's input (f). dropout False (a GPT run configured with attention
    and hidden dropout 0, Options.dropout): no masks (2h) and, unfused, only the softmax output of the scores (2as).
    """
    h, f, kv, a, q = model.hidden, model.ffn, model.kv_dim, model.heads, query_dim(model)
    if model.arch == "gpt":
        sp_part = 4 * h + 2 * h + 2 * h + 2 * h  # 2 LayerNorm inputs, QKV input, MLP input, 2 dropout masks
        tp_part = 2 * q + 2 * kv + 2 * kv + 2 * q + 2 * f + 2 * f  # Q, K, V, proj input, fc1 out, GeLU out
        core = 5 * a * seq if attention == "unfused" else 4 * a  # softmax (2), dropout mask (1) and output (2)
        if not dropout:  # p = 0: nn.Dropout returns its input, so no masks and the softmax output feeds P x V
            sp_part, core = sp_part - 2 * h, (2 * a * seq if attention == "unfused" else core)
    else:
        sp_part = 4 * h + 2 * h + 2 * h  # 2 RMSNorm inputs, QKV input, MLP input
        tp_part = 2 * q + 2 * kv + 2 * kv + 2 * q + 6 * f  # Q, K, V, proj input, gate, up, gate*up
        core = 2 * a * seq if attention == "unfused" else 4 * a  # softmax output, or fp32 log-sum-exp (flash)
    o = q
    if model.mla is not None:
        latent, tp_part = _mla_activation_bytes(model)
        sp_part, tp_part, o = sp_part + latent, tp_part + 6 * f, attention_out_dim(model)
    if fp8:  # QKV input, MLP input, projection input and second MLP input stored at 1 byte instead of 2
        sp_part, tp_part = sp_part - 2 * h, tp_part - o - f
        if model.mla is not None:  # the up-projections' inputs too
            sp_part = sp_part - (model.mla.q_lora_rank or 0) - model.mla.kv_lora_rank
    return float(sp_part), float(tp_part), float(core)


def _mla_activation_bytes(model: ModelConfig) -> tuple[float, float]:
    """(latent, split) bytes per token MLA's block keeps for backward (Megatron-Core MLASelfAttention, bf16):
    latent: the down-projections' outputs, the two latent RMSNorms' inputs and the up-projections' inputs (q_lora_rank
    and kv_lora_rank each twice) and the shared rope key, on every TP rank (the down-projections are duplicated;
    counted with the SP-sharded part, a few per cent of the block's); split (by TP): the attention core's Q, K, V
    (heads x 192, 192, 128 for DeepSeek-V3) and its output, the output projection's input (heads x v). Fused RoPE
    keeps nothing of its own."""
    mla = model.mla
    latent = 2 * (2 * (mla.q_lora_rank or 0) + 2 * mla.kv_lora_rank + mla.qk_rope_head_dim)
    k, v = key_value_dims(model)
    return float(latent), float(2 * (query_dim(model) + k + v) + 2 * attention_out_dim(model))


def selective_ops_bytes_per_token(model: ModelConfig, tp, sp):
    """Activation bytes per token of one layer kept by torchtitan's per-op selective checkpointing
    (Options.selective_ops), without the attention core's log-sum-exp: the block input (sharded with SP), the
    outputs of the kept matmuls and SDPA (split by TP; Llama: wq, wv, w1 and w2, whose output is kept before its
    reduction, full width on every rank; GPT: qkv and fc1) and, under TP, the reduce-scatters' outputs."""
    h, q, kv, f = model.hidden, query_dim(model), model.kv_dim, model.ffn
    sp_scale = np.where(sp, 1.0 / tp, 1.0)
    if model.arch == "llama":
        split, full = 2 * q + kv + f, h
    else:
        split, full = 2 * q + 2 * kv + f, 0
    return BF16_BYTES * (h * sp_scale + full + np.where(tp > 1, 2.0 * h / tp, 0.0) + split / tp)


def process_groups(tp, pp, dp, cp, dp_shard, ep=1, etp=1):
    """Communicators one rank holds buffers for: the default (world) group, which every launcher's barrier
    uses, plus each parallel dimension it communicates in: TP, data parallel (dp x cp ranks reduce gradients
    together), CP's attention exchange, PP's sends (one group of neighbours), HSDP's replica group across the
    shards, and for a MoE model the expert all-to-all group and the experts' own data-parallel group
    (tp x cp x dp / (etp x ep) ranks). NCCL allocates each communicator's buffers at its first collective
    (NVIDIA/nccl issue #986: more communicators, more memory)."""
    tp, cp, ep = (np.asarray(x, dtype=float) for x in (tp, cp, ep))
    dp_group = np.asarray(dp) * cp
    expert_dp = tp * dp_group / (np.asarray(etp) * ep)
    return (1.0 + (tp > 1) + (dp_group > 1) + (cp > 1) + (np.asarray(pp) > 1) + (np.asarray(dp_shard) < dp_group)
            + (ep > 1) + ((ep > 1) & (expert_dp > 1)))


def moe_blocks_held(moe: dict, layers):
    """How many average layers of plan.moe.memory_terms' per-layer terms (each `share` of one MoE block) a pipeline
    rank holding `layers` MoE layers carries: layers / share. DeepSeek-V3's stages after the first (MoE layers
    only) hold 61 / 58 times the average layer's expert state."""
    return np.asarray(layers, dtype=float) / moe["share"]


def offload_kept_bytes(model, T, tp, rc):
    """Bytes per offloaded layer and microbatch that stay on the device: under selective recompute the
    checkpointed attention core's inputs (Q, K, V), which the checkpoint holds itself, outside the saved-tensor
    hooks that move the rest (paratrain.parallel.offload); nothing otherwise (full recompute is not offloaded:
    config.rules offload_full_recompute)."""
    q, (k, v) = query_dim(model), key_value_dims(model)
    return np.where(np.asarray(rc) == 1, T * BF16_BYTES * (q + k + v) / tp, 0.0)


def offloaded_layers(offload, layers, chunks=1.0):
    """Blocks of a rank (`layers` over `chunks` model chunks) whose activations go to the host: the first
    `offload` of each of its stages, all of a stage that holds fewer (parallel.offload_layers)."""
    return np.minimum(np.asarray(offload, dtype=float) * chunks, layers)


def layer_activation_bytes(model, seq, opts, *, T, tp, cp, sp, rc):
    """(per_layer, rebuilt): the activation bytes one layer keeps per microbatch under recompute `rc`, and what
    one layer's backward holds again while it is rebuilt (once per rank). The one activation model of the memory
    estimate and of the offload copies (plan.step)."""
    sp_part, tp_part, core = activation_bytes_per_token(model, seq / 1, opts.attention, opts.fp8, opts.dropout)
    if model.arch == "llama":  # two RMSNorms a layer, each keeping its input at Options.norm_saved_bytes
        sp_part = sp_part + 2 * (opts.norm_saved_bytes - BF16_BYTES) * model.hidden
    if opts.attention == "unfused":
        core = core / cp  # scores over the local query rows only
    sp_scale = np.where(sp, 1.0 / tp, 1.0)
    # DTensor TP (Options.tp_saves_gathered_input): the QKV and MLP inputs (sp_part's, 1 byte under fp8) kept
    # all-gathered, at the full sequence, not its shard
    gathered = (1.0 - sp_scale) * 2 * model.hidden * (1 if opts.fp8 else BF16_BYTES) if opts.tp_saves_gathered_input else 0.0
    layer_full = T * (sp_part * sp_scale + gathered + tp_part / tp + core / tp)
    # recompute_mlp keeps the MLP block's input (already counted) instead of its gate/up (fc1/GeLU) outputs
    mlp_kept = (6 if model.arch == "llama" else 4) * model.ffn if opts.recompute_mlp else 0
    layer_selective = T * (sp_part * sp_scale + gathered + (tp_part - mlp_kept) / tp)
    if not opts.recompute_core_attention:  # the core is not replayed: its saved state is kept (Options)
        layer_selective = layer_selective + T * core / tp
    if opts.selective_ops:  # torchtitan's per-op SAC keeps the save list's outputs, plus the log-sum-exp (core)
        layer_selective = T * (selective_ops_bytes_per_token(model, tp, sp) + core / tp)
    layer_input = T * 2 * model.hidden * sp_scale
    if opts.distribute_saved_activations:  # the checkpointed input split over the TP group (already split with SP)
        layer_input = layer_input / np.where(sp, 1, tp)
    # full recompute with Options.recompute_every N checkpoints one layer in N; the other layers keep everything
    rf = 1.0 / opts.recompute_every
    per_layer = select([rc == 0, rc == 1], [layer_full, layer_selective], rf * layer_input + (1.0 - rf) * layer_full)
    # one layer rebuilt during backward: full recompute its whole block, selective recompute its attention core (the
    # s x s scores of unfused attention are held again for that layer's backward; flash keeps only the log-sum-exp),
    # per-op SAC every op off its save list: torch.utils.checkpoint's selective checkpointing (create_selective_
    # checkpoint_contexts, torchtitan's apply_ac op mode at 9dec370) replays the block's forward in its backward,
    # the saved ops' outputs taken from the cache (counted in per_layer), the others computed again (memacc)
    replayed_core = (opts.attention == "unfused") and not opts.selective_ops and opts.recompute_core_attention
    sac_rebuilt = np.maximum(layer_full - layer_selective, 0.0) if opts.selective_ops else 0.0
    rebuilt = select([rc == 2, (rc == 1) & replayed_core, rc == 1], [layer_full, T * core / tp, sac_rebuilt], 0.0)
    if opts.recompute_mla_up_proj and model.mla is not None:  # Q, K, V dropped after the core, rebuilt one layer
        qkv = T * BF16_BYTES * (query_dim(model) + sum(key_value_dims(model))) / tp  # at a time before its backward
        per_layer = per_layer - np.where(rc == 2, 1.0 - rf, 1.0) * qkv
        rebuilt = rebuilt + np.where(rc == 2, 0.0, qkv)
    return per_layer, rebuilt + cp_gathered_kv_bytes(model, opts, T=T, tp=tp, cp=cp)


def cp_gathered_kv_bytes(model, opts, *, T, tp, cp):
    """The other CP ranks' K and V that an all-gather CP holds while one layer's attention runs (forward, and the
    backward that gathers them again), on top of the local K/V the layer count keeps: torch's context_parallel
    (_AllGatherRotater.exchange_buffers: one all_gather_tensor of the concatenated local K and V, kept as
    _aggregated_buffer for the whole ring, torch/distributed/tensor/experimental/_attention.py) and Llama 3's
    all-gather CP (Dubey et al. 2024 sec. 3.3.2: K and V all-gathered, then attention for the local queries). K/V are
    query-wide where the model repeats them before the attention op (Options.cp_kv_repeated: torchtitan). Not for
    cp_comm "ring" (Megatron-Core's p2p ring). Once per rank: one layer's attention runs at a time."""
    if opts.cp_comm not in ("allgather", "allgather_rotate"):
        return 0.0
    width = query_dim(model) if opts.cp_kv_repeated else sum(key_value_dims(model)) / 2
    return (np.asarray(cp, dtype=float) - 1.0) * T * 2 * width * BF16_BYTES / tp


def head_gathered_input_bytes(model, opts, *, T, tp, sp):
    """The output projection's all-gathered input that DTensor TP keeps for its weight gradient on the head's rank
    (torchtitan's plan: "output" ColwiseParallel(input_layouts=Shard(1)), the final norm's output gathered to the
    full sequence; bf16: the head is not converted to Float8Linear), beyond the shard: live at the loss."""
    if not opts.tp_saves_gathered_input:
        return 0.0
    return T * model.hidden * BF16_BYTES * (1.0 - np.where(sp, 1.0 / tp, 1.0))


def fsdp_pool_bytes(opts, *, unit, root, grads_sharded):
    """What FSDP's own CUDA streams keep cached beyond the tensors counted elsewhere (Options.fsdp_stream_pools), per
    rank: the reduce-scatter stream's reduce-dtype inputs of a layer and of the root (the root's, reduced last, does
    not fit the layer's freed block between the sharded gradients written after it) plus, where the gradients are
    counted unsharded (FSDP kept gathered under a pipeline), the sharded gradients it writes; the all-gather copy-in
    stream's gathered buffers of the root and the first layer, live together (the root's freed at the layer's
    copy-out). unit, root: parameters of one layer and of the root unit on this rank (after TP)."""
    if not opts.fsdp_stream_pools:
        return 0.0
    return (unit + root) * (opts.grad_bytes + opts.param_bytes) + grads_sharded


def pp_stage_buffer_bytes(opts, *, boundary, m, inflight, n_recv, n_grad):
    """What torch.distributed.pipelining keeps per pipeline stage beyond the saved activations (Options.
    pp_stage_buffers), on one rank at its peak, its last forward (`inflight` microbatches held, m - inflight done):
    `_prepare_forward_infra` preallocates one activation receive buffer per microbatch for every stage that receives
    (stage.py `args_recv_info[chunk_id]` for chunk_id in range(num_microbatches)), alive for the whole run: the
    in-flight ones are the first block's saved input (counted with the layers), the m - inflight done ones are not,
    and those carry the input gradient backward accumulated into them (`stage_backward` reads `val.grad`; cleared
    only by the next step's clear_runtime_states, until pytorch PR #164329, Oct 2025); `_prepare_backward_infra`
    one gradient receive buffer per microbatch for every stage that is not the last (`grad_recv_info`), and such a
    stage keeps every microbatch's output (forward_one_chunk appends it to output_chunks on every stage until
    pytorch PR #153383, May 2025; fwd_cache holds it to its backward). boundary: bytes of one microbatch's stage
    input / output (the block output, sequence-sharded under SP); n_recv, n_grad: the rank's stages that receive
    activations / gradients."""
    if not opts.pp_stage_buffers:
        return 0.0
    return boundary * (2.0 * n_recv * np.maximum(m - inflight, 0.0) + 2.0 * n_grad * m)


def loss_peak_bytes_per_logit(opts, tp):
    """Bytes per logit the loss backward holds on the last stage: the stack's loss, or its TP loss where tp > 1 and
    the stack runs another there (Options.tp_loss_peak_bytes_per_logit: torch's DTensor loss_parallel)."""
    if opts.tp_loss_peak_bytes_per_logit is None:
        return opts.loss_peak_bytes_per_logit
    return np.where(np.asarray(tp) > 1, opts.tp_loss_peak_bytes_per_logit, opts.loss_peak_bytes_per_logit)


def memory_per_device(model, system, seq, opts, *, T, tp, pp, dp, cp, sp, rc, sched, v, m, zero, dp_shard,
                      loads: Loads | None = None, moe: dict | None = None, ep=1, etp=1, offload=0):
    """Memory of the rank that needs the most (loads: layers per rank, default the balanced split). Each rank
    holds its own schedule's microbatches in flight: the first rank the most, the last (with the head and its
    logits) the fewest, the inner ranks counted as the second, the most loaded of them. moe: plan.moe.memory_terms,
    the routed experts' bytes per layer on top of the dense view (`model`).

    offload (parallel.offload_layers): the activations of a rank's first `offload` blocks of each microbatch
    wait in host memory from their forward to their backward; what stays is the rank's other blocks, what
    offload_kept_bytes leaves on the device, and one offloaded block in flight (the copy out at the end of the
    forward, the prefetched one in the backward; Transformer Engine's offload scheduler, which Megatron-Core
    runs, keeps "at most (model_layers - num_layers) sets of activations" on the GPU and stalls compute to hold
    that). Also returned: offload_min_layers, the fewest offloaded blocks that make the layout fit (0 where it fits,
    inf where no count does), which `search` tries.

    What is counted is what torch's caching allocator reserves at the peak where the stack says so: FSDP's stream
    pools (fsdp_pool_bytes), its root kept gathered, torch.distributed.pipelining's per-microbatch buffers
    (pp_stage_buffer_bytes), and on the head's rank the larger of the loss and rebuild phases."""
    v_shape = np.asarray(sched) >= 3
    loads = loads or balanced_loads(model.layers, pp, v, v_shape)
    fp8_weight_bytes = fp8_copies(system, opts) * low_precision_bytes(system, opts) if opts.fp8 else 0.0
    per_layer, rebuilt = layer_activation_bytes(model, seq, opts, T=T, tp=tp, cp=cp, sp=sp, rc=rc)
    kept = offload_kept_bytes(model, T, tp, rc)
    logits = T * model.vocab / tp * loss_peak_bytes_per_logit(opts, tp)  # the loss backward's peak, last stage
    one = same_rank(pp, v_shape)
    ranks = []  # (weights, grads, optimizer, activations) of the first, last and inner ranks
    pinned = (np.asarray(zero) == 3) & (np.asarray(pp) > 1) & opts.fsdp_pp_unsharded
    # ZeRO-3 / FSDP over more than one rank gathers a unit (a layer) at a time: at the start of backward the last layer's unsharded
    # parameters, the prefetched next one's, the layer's unsharded gradient (param dtype) and the reduce-scatter input
    # it is copied into (reduce dtype; torch FSDP2 foreach_reduce, FSDP1 _reduce_grad); during the loss backward before
    # it, the loss's peak beside the last layer's parameters (not resharded after forward). Both are transient: counted
    # with the activations
    unit = model.params_per_layer() / tp
    sharded = (np.asarray(zero) == 3) & (np.asarray(dp_shard) > 1)
    fsdp_unit = np.where(sharded & ~pinned, 1.0, 0.0)
    # the reduce-scatter input is the RS stream's (fsdp_pool_bytes) where those pools are counted
    working = fsdp_unit * unit * (3 * opts.param_bytes + (0.0 if opts.fsdp_stream_pools else opts.grad_bytes))
    # the head's rank: the loss backward (logits, the gathered head input, the last layer's parameters, kept
    # gathered) runs before any layer is rebuilt, so its peak is the larger of the two phases, not their sum
    loss_phase = logits + head_gathered_input_bytes(model, opts, T=T, tp=tp, sp=sp) + fsdp_unit * unit * opts.param_bytes
    # torch.distributed.pipelining's last stage keeps every microbatch's bf16 logits (output_chunks) to the step's
    # end, the current one's too (under pp 1 torchtitan deletes them before the backward; the loss peak excludes them)
    kept_logits = np.where((np.asarray(pp) > 1) & opts.pp_last_stage_keeps_outputs,
                           np.asarray(m, dtype=float) * T * model.vocab / tp * BF16_BYTES, 0.0)
    ranks_at = (0.0, np.where(one, 0.0, pp - 1), np.minimum(1.0, pp - 1))  # pipeline rank of first, last, inner
    # stages per rank that receive activations / gradients (first, last, inner): a rank holds `chunks` stages; the
    # first stage receives no activations, the last no gradients (ZB-V's V: rank 0 holds both, the last rank neither)
    chunks_r = np.where(np.asarray(sched) >= 2, v, 1.0)
    recv_grad = ((chunks_r - 1.0, chunks_r - np.where(v_shape, 1.0, 0.0)),
                 (chunks_r, chunks_r - np.where(v_shape, 0.0, 1.0)), (chunks_r, chunks_r))
    boundary = T * model.hidden * BF16_BYTES * np.where(sp, 1.0 / tp, 1.0)
    staged = (np.asarray(pp) > 1) & ~np.asarray(one)
    moved = []  # per rank: (activation bytes offloading takes off the device per offloaded block, microbatches in flight)
    for params, layers, head, r, (n_recv, n_grad) in zip(
            _rank_params(model, loads, pp, v_shape), (loads.first, loads.last, loads.inner), (one, True, False),
            ranks_at, recv_grad, strict=True):
        params_dev = params / tp
        inflight = inflight_microbatches(sched, pp, v, m, r)
        stage_buffers = np.where(staged, pp_stage_buffer_bytes(opts, boundary=boundary, m=m, inflight=inflight,
                                                               n_recv=n_recv, n_grad=n_grad), 0.0)
        # FP8 with a weight cache keeps the cast weight between microbatches in the copies its GEMMs need
        # (plan.kernels.fp8_copies: with its transpose on Hopper, alone on Blackwell, row- and column-wise MX)
        fp8_cache = np.where((zero < 3) & opts.fp8 & opts.fp8_weight_cache, fp8_weight_bytes, 0.0) * params_dev
        # FP8 primary weights (Options.fp8_param_gather): those FP8 copies are the weights; no bf16 copy
        bf16_weights = np.where((zero < 3) & opts.fp8_primary_weights & opts.fp8_weight_cache, 0.0, WEIGHT_BYTES)
        ex = moe or {"weights": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "once": 0.0}
        # the model's first dense layers (DeepSeek-V3: 3) sit on the first rank: the others hold MoE layers only,
        # more expert state than the average layer. The first rank keeps the average (the dense view gives its
        # dense layers the average FFN width, less than theirs, which the average's expert share offsets)
        held = np.where(r == 0, layers, moe_blocks_held(ex, layers)) if moe else layers
        # the head's rank runs the multi-token-prediction layers too (plan.pipeline.mtp_rank_params; MoE layers where
        # the model's are: one whole block each)
        mtp = np.where(head, model.mtp_layers, 0.0)
        layers = layers + mtp
        held = held + (mtp / ex["share"] if moe else mtp)
        # FSDP kept gathered under a pipeline (Options.fsdp_pp_unsharded): the gathered copy beside the shard, and
        # the gradients accumulated unsharded in the reduce dtype until the last backward
        gathered = np.where(pinned, params_dev * opts.param_bytes, 0.0)
        # FSDP's shard is the fp32 master itself where the stack keeps no low-precision copy of it
        shard_copy = np.where((zero == 3) & ~np.asarray(opts.fsdp_low_precision_shard), 0.0, bf16_weights)
        # the root unit (embedding / final norm / head) and the FSDP streams' cached buffers, whole-step
        root = params_dev - layers * unit
        root_held = np.where(opts.fsdp_root_unsharded, fsdp_unit * root * opts.param_bytes, 0.0)
        pools = np.where(sharded, fsdp_pool_bytes(opts, unit=unit, root=root, grads_sharded=np.where(
            pinned, params_dev * opts.grad_bytes / dp_shard, 0.0)), 0.0)
        transient = np.where(head, np.maximum(loss_phase, rebuilt + working) + kept_logits, rebuilt + working)
        ranks.append((params_dev * shard_copy / np.where(zero == 3, dp_shard, 1.0) + gathered + fp8_cache
                      + held * ex["weights"],
                      params_dev * opts.grad_bytes / np.where((zero >= 2) & ~pinned, dp_shard, 1.0) + held * ex["grads"],
                      params_dev * optimizer_state_bytes(opts)
                      / np.where(zero >= 1, dp_shard, 1.0) + held * ex["optimizer"],
                      (per_layer * layers + ex["activations"] * held) * inflight + ex["once"] + transient
                      + root_held + pools + stage_buffers))
        # the host's share of an offloaded block: its average activations (MoE experts included) less what stays
        off = np.maximum((per_layer * layers + ex["activations"] * held) / np.maximum(layers, 1) - kept, 0.0)
        moved.append((off, inflight, layers))
    shape = np.broadcast_shapes(*(np.shape(x) for r in ranks for x in r))
    parts = np.array([[np.broadcast_to(x, shape) for x in r] for r in ranks])  # rank, part, layouts...
    eff = system.efficiency
    groups = process_groups(tp, pp, dp, cp, dp_shard, ep, etp)
    reserved = eff.runtime_reserved_bytes + groups * eff.comm_buffer_bytes_per_group
    capacity = (system.device_memory_bytes - reserved) * eff.memory_usable_fraction
    chunks = np.where(np.asarray(sched) >= 2, v, 1.0)
    stage_cap = np.ceil(model.layers / np.where(np.asarray(pp) > 1, pp * chunks, 1.0))
    fewest = _fewest_offloaded(parts.sum(axis=1), moved, capacity, stage_cap, chunks)
    if np.any(np.asarray(offload) > 0):  # each rank's offloaded blocks leave, one of them in flight stays
        for i, (off, inflight, layers) in enumerate(moved):
            n = offloaded_layers(offload, layers, chunks)
            parts[i, 3] -= np.broadcast_to(n * off * inflight - np.where(n > 0, off, 0.0), shape)
    worst = np.asarray(np.argmax(parts.sum(axis=1), axis=0))
    weights, grads, optimizer, activations = np.take_along_axis(parts, worst[None, None], axis=0)[0]
    total = weights + grads + optimizer + activations
    return {"memory_weights_bytes": weights, "memory_grads_bytes": grads, "memory_optimizer_bytes": optimizer,
            "memory_activations_bytes": activations, "memory_per_device_bytes": total,
            "memory_capacity_bytes": capacity * np.ones_like(total), "fits": total <= capacity,
            "offload_min_layers": fewest}


def _fewest_offloaded(totals, moved, capacity, stage_cap, chunks):
    """The fewest offloaded blocks per stage with which every rank fits (memory_per_device's offload term: n
    blocks of each of a rank's chunks take n x chunks x off x inflight off it and leave one block's off in
    flight): 0 where the layout fits without, inf where no count up to a stage's layers (config.rules
    offload_stage_layers) does."""
    need = []
    for total, (off, inflight, layers) in zip(totals, moved, strict=True):
        excess = total - capacity
        with np.errstate(divide="ignore", invalid="ignore"):
            n = np.ceil((excess + off) / (off * inflight * chunks))
        n = np.where(excess <= 0, 0.0, np.where((off > 0) & (n * chunks <= layers), np.maximum(n, 1.0), np.inf))
        need.append(n)
    fewest = np.max(np.array(np.broadcast_arrays(*need)), axis=0)
    return np.where(fewest <= stage_cap, fewest, np.inf)
