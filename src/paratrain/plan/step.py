"""The analytic performance model: step time, FLOPs, memory and communication of one parallel layout.

Every formula works element-wise on numpy arrays, so `search` evaluates tens of thousands of layouts in one
pass and `estimate` is the same code on arrays of length one. No torch (fast import). The formulas, their
sources and their assumptions are written up in docs/planner.md.

Conventions: T = tokens of one microbatch on one device (b * s / cp); h hidden, f ffn, kv = kv heads * head
dim, a heads, t = tp, L layers. Bytes: bf16 activations/weights (2), fp32 gradients (4, Megatron's main
grads), fp32 Adam master + m + v (12).

This module assembles the whole step (`evaluate`: per layer compute, TP and CP exchanges, MoE terms, stage
extras, pipeline, data parallel, optimizer, FLOPs, memory); the terms live beside it, imports pointing one way
(tests/test_layering.py): precision (bytes per element) <- options <- collectives, kernels <- layer <- pipeline,
memory, data_parallel <- moe <- step.
"""

from __future__ import annotations

import numpy as np

from paratrain.config.names import PP_SCHEDULES
from paratrain.config.ranks import DEFAULT_RANK_ORDER, dim_strides, group_geometry, group_span, order_dims
from paratrain.hardware.catalog import System
from paratrain.model.config import ModelConfig
from paratrain.plan import moe as moe_plan
from paratrain.plan.collectives import collective_time_s, p2p_time_s, tiny_allreduce_s
from paratrain.plan.data_parallel import _data_parallel_s, dp_bytes_per_step
from paratrain.plan.kernels import (
    block_scaled,
    cast_cost,
    flash_causal_fraction,
    low_precision_flops,
    matmul_time_s,
    memory_time_s,
    weight_cast_bytes,
)
from paratrain.plan.layer import (
    _mlp_params_per_layer,
    _op_sac_recomputed,
    _per_layer_compute,
    cp_merge_s,
    host_issue_s,
    key_value_dims,
    mla_matmuls,
    mla_up_proj_replay_s,
    query_dim,
    unfused_rope_s,
)
from paratrain.plan.memory import (
    layer_activation_bytes,
    memory_per_device,
    offload_kept_bytes,
    offloaded_layers,
)
from paratrain.plan.options import Options
from paratrain.plan.pipeline import _largest_rank, _slowest_rank, overlapped_p2p_path_s, pipeline_bubble_s
from paratrain.plan.precision import ADAM_STEP_BYTES, BF16_ADAM_STEP_BYTES, BF16_BYTES, FP8_BYTES
from paratrain.plan.stages import Loads, balanced_loads, best_loads

STAGE_SPLITS = ("balanced", "auto")  # the runtime's default split, or the one that minimises the slowest stage
# the trainer's names (paratrain.config.names); evaluate's integer codes index them: schedule codes >= 3 are the
# V-shaped zero-bubble schedules (zbv, dualpipev)
SCHEDULES = PP_SCHEDULES
# Attention FLOPs per token per layer per hidden unit, forward: QK^T and AV over the keys a query sees. Causal
# (what is computed with flash attention and what MFU counts here): 2 x 2 x s/2 x h; the full square (Narayanan et
# al. 2021, PaLM): 2 x 2 x s x h. Both MFUs are reported; only the causal one is bounded by the timing model.
ATTENTION_CONVENTION = "causal"
CAUSAL_ATTENTION_FLOPS = 2.0


FLASH_BWD_MATMULS = 5  # per attention block in FlashAttention-2's backward (forward: 2)
# FlashAttention's backward reaches a lower fraction of peak than its forward: "up to 73% of the theoretical max
# throughput in the forward pass, and up to 63% ... in the backward pass" (Dao 2023, FlashAttention-2, sec. 1; the
# dS = P o (dP - D) elementwise step, the recomputed P and the dQ accumulation are the extra non-matmul work). The
# only published forward/backward split; applied to every flash kernel (FA2, cuDNN/FA3, NKI) as their ratio
FLASH_BWD_EFF = 63 / 73


def _overlapped_p2p(opts, sched, pp, v, m, send, chunk_fwd, attn_mm, pipeline, p2p_path):
    """(pipeline, p2p_path) with the interleaved schedule's sends as Megatron-Core waits for them under
    overlap_p2p_comm (plan.pipeline.overlapped_p2p_path_s). A steady iteration's exchange hides behind the next
    chunk's forward; with EP A2A overlap (ep_overlap > 0: overlap_moe_expert_parallel_comm, which runs
    combined_1f1b_schedule_for_interleaved_pipelining; core_v0.17.1 models/common/model_chunk_schedule_plan.py
    TransformerModelChunkSchedulePlan.run) both exchanges are posted at the end of the merged forward-backward step
    and waited at the start of the next, behind only the delayed attention wgrad of its first layer
    (delay_wgrad_compute: attn.backward_dw; attn_mm, the layer's matmuls less the MLP's); with core >= 0.18's
    forward-send wait (Options.p2p_fwd_send_wait) behind nothing."""
    combined = opts.ep_overlap > 0
    hidden = 0.0 if opts.p2p_fwd_send_wait else (np.maximum(attn_mm, 0.0) if combined else chunk_fwd)
    capped = not (combined or opts.p2p_fwd_send_wait)
    overlapped = np.where(sched == 2, overlapped_p2p_path_s(pp, v, m, send, hidden, capped), p2p_path)
    return pipeline + overlapped - p2p_path, overlapped


def evaluate(model: ModelConfig, system: System, seq: int, global_batch: int, *, nodes, tp, pp, dp, cp,
             microbatch, sp, recompute, pp_schedule, virtual_stages, zero_stage, dp_kind, opts: Options,
             split: str = "balanced", stage_loads: Loads | None = None, ep=1, etp=1, dp_replicate=None,
             rank_order: str = DEFAULT_RANK_ORDER, offload=0) -> dict:
    """Evaluate layouts (numpy arrays of equal length, or scalars). Integer codes index RECOMPUTE, SCHEDULES
    and DP_KINDS. Returns a dict of arrays (times in s, bytes, FLOPs); no validity filtering here.

    Pipeline stage sizes (plan/stages.py): split "balanced" is the runtime's default (equal layer counts),
    "auto" the split that minimises the slowest rank's time (kept balanced where the faster split would not
    fit in memory and the balanced one does); stage_loads (layers per rank of an explicit split) overrides
    both. The loads used come back as stage_layers_{first,last,inner} and stage_balanced. ep, etp: expert
    parallelism of a MoE model (plan/moe.py: the dense formulas time its dense view, the routed experts add on).
    virtual_stages: model chunks per pipeline rank (2 under the V schedules). dp_replicate (HSDP): replica groups,
    None = one per node. rank_order: how ranks map onto tp, cp, dp, pp (paratrain.config.ranks, the trainer's
    parallel.rank_order; one for all layouts): each group's stride, and so which groups stay inside a node.
    offload: parallel.offload_layers, blocks per stage whose activations wait in host memory (memory:
    plan.memory.memory_per_device; time: offload_exposed_s)."""
    if split not in STAGE_SPLITS:
        raise ValueError(f"split = {split!r}: allowed: {', '.join(STAGE_SPLITS)}")
    f64 = lambda x: np.asarray(x, dtype=float)  # noqa: E731
    nodes, tp, pp, dp, cp, b, v, ep, etp, offload = map(f64, (nodes, tp, pp, dp, cp, microbatch, virtual_stages, ep,
                                                               etp, offload))
    flops_model = model  # FLOPs count the real model (a MoE's active parameters); the rest its dense view
    model = moe_plan.dense_view(model) if model.num_experts else model
    sp = np.asarray(sp, dtype=bool) & (tp > 1)
    rc = np.asarray(recompute)
    sched = np.asarray(pp_schedule)
    zero = np.asarray(zero_stage)
    kind = np.asarray(dp_kind)
    eff_sys = system.efficiency
    L, h, V = model.layers, model.hidden, model.vocab
    devices = nodes * system.devices_per_node
    m = global_batch / (dp * b)  # microbatches per replica per step
    T = b * seq / cp  # tokens of one microbatch on one device
    # where each dimension's groups sit (the one rule the runtime's mesh follows): strides, and the dp x cp
    # gradient group's geometry (one run of ranks, or split apart where the order puts pp between dp and cp)
    dims = order_dims(rank_order)
    if flops_model.num_experts and dims != order_dims(DEFAULT_RANK_ORDER):
        raise ValueError(f"rank_order = {rank_order!r} with a mixture-of-experts model: allowed: {DEFAULT_RANK_ORDER} "
                         f"(rule rank_order_experts)")
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    strides = dim_strides(dims, sizes)
    stride_pp, stride_cp = strides["pp"], strides["cp"]
    _, grad_stride, grad_inner, grad_outer = group_geometry(dims, sizes, ("dp", "cp"))
    split_apart = abs(dims.index("dp") - dims.index("cp")) > 1
    dp_split = (grad_inner, grad_outer) if split_apart else None

    # -- compute per layer, forward; backward = 2x matmuls and attention, 2x elementwise traffic --
    mm, core, elem, mlp_fwd, column_mm, sac_mm, split_fwd, split_bwd, tail_mm = _per_layer_compute(
        model, system, seq, opts, T, tp, sp, cp, zero)
    moe = moe_plan.layer_terms(flops_model, system, opts, T=T, tp=tp, sp=sp, ep=ep, etp=etp, rc=rc) \
        if flops_model.num_experts else None
    quantize = 0.0  # per-expert operand quantization launches (plan.moe), once forward and once backward
    bias_fwd = bias_bwd = 0.0  # eager expert work outside the fused kernels: output bias, activation clamp (plan.moe)
    if moe is not None:  # routed experts: grouped GEMMs (their weight gradients too) and permute/router kernels
        quantize, (bias_fwd, bias_bwd) = moe[6], moe[7]
        mm, elem, mlp_fwd = mm + moe[0], elem + moe[1], mlp_fwd + moe[0] + moe[1] + quantize + bias_fwd
    rope_fwd, rope_bwd = unfused_rope_s(model, system, T, tp)  # YaRN models on Megatron-Core's unfused RoPE
    merge_fwd, merge_bwd = cp_merge_s(model, system, opts, T, tp, cp)  # torch's ring attention: fp32 merges per step
    core = core + merge_fwd  # part of the attention op: replayed with it (selective, full), kept with it (op SAC)
    fwd_compute = mm + split_fwd + core + elem + quantize + bias_fwd + rope_fwd
    selective = (core if opts.recompute_core_attention else 0.0) + (mlp_fwd if opts.recompute_mlp else 0.0)
    if opts.selective_ops:  # torchtitan's per-op SAC: three matmuls and every elementwise op, not the attention core
        selective = sac_mm + elem + quantize + bias_fwd + rope_fwd
    # full recompute checkpoints one layer in Options.recompute_every (torchtitan's selective layer AC); the others
    # keep every activation and replay nothing: rf, the recomputed fraction of the layers
    rf = 1.0 / opts.recompute_every
    if rf < 1.0 and flops_model.num_experts:
        raise ValueError("recompute_every > 1 (layer-selective checkpointing) is modelled for dense models only")
    recompute_fwd = np.where(rc == 2, rf * fwd_compute, np.where(rc == 1, selective, 0.0))
    # the replay's last down-projection and its TP reduction feed nothing the backward reads: dropped by the
    # compiler where Options.replay_drops_dead_tail (a dense model's full recompute, or the MLP block replayed)
    tail_dead = (rc == 2) | ((rc == 1) & opts.recompute_mlp & (not opts.selective_ops))
    tail_dead = tail_dead & opts.replay_drops_dead_tail & (moe is None)
    recompute_fwd = recompute_fwd - np.where(tail_dead, np.where(rc == 2, rf, 1.0) * tail_mm, 0.0)
    if opts.recompute_norm_act:  # Megatron-Core's recompute_modules "layernorm", "moe_act" (plan.moe)
        norm_act = moe_plan.norm_act_replay_s(flops_model, system, T, tp, sp, etp, moe[5] if moe is not None else 0.0)
        recompute_fwd = recompute_fwd + np.where(rc == 2, 1.0 - rf, 1.0) * norm_act
    if opts.recompute_mla_up_proj:  # MLA's up-projections and RoPE rerun before the core's backward (Options)
        recompute_fwd = recompute_fwd + np.where(rc == 2, 1.0 - rf, 1.0) * mla_up_proj_replay_s(model, system, opts, T,
                                                                                                tp)
    # FlashAttention's backward recomputes the scores and probabilities and runs 5 matmuls to the forward's 2
    # (Dao 2023, FlashAttention-2 sec. 3.2), at a lower fraction of peak than its forward (FLASH_BWD_EFF);
    # unfused attention keeps P and runs 4 (dP, dV, dQ, dK) as plain batched GEMMs
    core_bwd = FLASH_BWD_MATMULS / 2.0 / FLASH_BWD_EFF if opts.attention == "flash" else 2.0
    if opts.attention == "flash":  # the backward's key blocks against the forward's (chip.flash_*_key_tile)
        core_bwd = core_bwd * np.where(cp > 1, 1.0, flash_causal_fraction(seq, system.chip.flash_bwd_key_tile)
                                       / flash_causal_fraction(seq, system.chip.flash_fwd_key_tile))
    bwd_compute = (2 * mm + split_bwd + core_bwd * (core - merge_fwd) + merge_bwd + 2 * elem + quantize + bias_bwd + rope_bwd
                   + recompute_fwd)
    if moe is not None:  # the expert weight gradients accumulate into the main_grad buffer (plan.moe)
        bwd_compute = bwd_compute + moe[8]
    a2a_fwd, a2a_bwd = moe_plan.exposed_alltoall(opts, moe[2], moe[3], fwd_compute, bwd_compute,
                                                 *moe_plan.overlap_limits(system, opts, sched, pp, v, m)) \
        if moe is not None else (0.0, 0.0)

    # -- tensor parallel, per layer: 2 all-reduces forward and 2 backward (Megatron's f/g), or with SP an
    # all-gather + reduce-scatter pair in place of each (same volume, twice the calls); full recompute
    # replays the forward ones. Counted per call: each pays the link's latency and per-call overhead. --
    act_bytes = T * h * BF16_BYTES
    ar = collective_time_s(system, "allreduce", act_bytes, tp, 1.0)
    ag1 = collective_time_s(system, "allgather", act_bytes, tp, 1.0)
    rs1 = collective_time_s(system, "reducescatter", act_bytes, tp, 1.0)
    ag_rs = ag1 + rs1
    # torchao's float8 TP (Options.fp8_tp_allgather): a layer's all-gathers carry FP8, its reduce-scatters BF16
    ag_l = collective_time_s(system, "allgather", T * h * FP8_BYTES, tp, 1.0) \
        if opts.fp8 and opts.fp8_tp_allgather else ag1
    ag_rs_l = ag_l + rs1
    tp_exposed = 1 - eff_sys.tp_overlap
    tp_fwd = np.where(tp > 1, 2 * np.where(sp, ag_rs_l, ar), 0.0) * tp_exposed
    # recompute replays the forward's TP collectives: all of them (full) or the MLP's one pair (recompute_mlp)
    # or under per-op SAC the all-gathers (not in its save list; the reduce-scatters' outputs are kept)
    replay = np.where(rc == 2, 1.0 + rf, np.where((rc == 1) & (opts.recompute_mlp | (opts.selective_ops & sp)), 1.5, 1.0))
    tp_bwd = tp_fwd * replay
    if opts.tp_bwd_overlap:
        # NxD's LinearWithAsyncCommunication.backward (neuronx_distributed/parallel_layers/layers.py), with SP: a
        # column-parallel linear re-gathers its input for the weight gradient while the input-gradient GEMM
        # (which does not need it) runs, then reduce-scatters that input gradient while the weight-gradient GEMM
        # runs; the Neuron compiler schedules collectives on their own queue beside independent compute
        # (neuron-runtime/explore/compute-comm-overlap.rst). A row-parallel linear's backward first gathers its
        # output gradient, which both its GEMMs need: exposed. Per layer: 2 exposed gathers, 2 gathers and
        # 2 reduce-scatters behind one GEMM each (the backward's two GEMMs per linear each take its forward time).
        hidden_bwd = sum(np.maximum(0.0, ag_l - g) + np.maximum(0.0, rs1 - g) for g in column_mm)
        bwd_sp = (2 * ag_l + hidden_bwd) * tp_exposed + tp_fwd * (replay - 1.0)  # + the replayed forward's
        tp_bwd = np.where((tp > 1) & sp, bwd_sp, tp_bwd)
    if opts.tp_comm_overlap:
        # Transformer Engine / Megatron (tp_comm_overlap) and torch async TP: with SP each all-gather is split
        # into tp chunks exchanged while the GEMM it feeds runs on the chunks already there, and each
        # reduce-scatter likewise behind the GEMM that produces it. Exposed: what the layer's GEMMs cannot cover,
        # plus the first chunk of each collective (nothing to compute on before it arrives).
        comm = 2 * ag_rs_l
        hidden = lambda c, gemm: np.maximum(0.0, c - gemm) + c / tp  # noqa: E731
        tp_fwd = np.where((tp > 1) & sp, hidden(comm, mm), tp_fwd)
        # A column-parallel linear keeps its input as the sequence shard and all-gathers it again in the backward for
        # its weight gradient, beside its input-gradient GEMM (Transformer Engine's LayerNormLinear/Linear backward:
        # ub_bulk_dgrad "Overlap inputmat all-gather with dgrad compute", or without userbuffers
        # gather_along_first_dim(async_op=True) before the dgrad GEMM; v1.11 c27ee60 and v2.9 70f5366): hidden
        # behind that one GEMM (the forward's shape), exposed where the gather outlasts it (a GQA model's narrow QKV
        # at TP 8 in FP8). Not where the stack saves the gathered input (torchtitan's DTensor TP); dense attention
        # only (a MoE layer's experts gather as plan.moe times them, MLA's latent path is not this pair): not counted
        regather = 0.0 if opts.tp_saves_gathered_input or moe is not None or model.mla is not None else \
            sum(np.maximum(0.0, ag_l - g) for g in column_mm)
        tp_bwd = np.where((tp > 1) & sp, hidden(comm, 2 * mm) * replay + regather, tp_bwd)
    # the dead tail's reduce-scatter (all-reduce without SP), one call of the replayed forward's collectives
    tp_bwd = tp_bwd - np.where(tail_dead & (tp > 1) & (not opts.tp_comm_overlap),
                               np.where(sp, rs1, ar) * tp_exposed, 0.0)
    tp_bwd = tp_bwd + kv_replica_grad_s(system, model, opts, T, tp)  # NxD's K/V replicas (exposed)
    if opts.distribute_saved_activations:  # each replayed layer first re-gathers its split checkpointed input
        tp_bwd = tp_bwd + np.where((rc == 2) & (tp > 1) & ~sp, rf * ag1, 0.0) * tp_exposed
    # Embedding and head under TP: the vocabulary-parallel embedding's all-reduce (reduce-scatter with SP);
    # with SP the final norm's output is gathered for the head; vocabulary-parallel cross-entropy all-reduces
    # three [tokens] fp32 vectors (max logit, sum of exponentials, target logit); backward, the head's input
    # gradient is all-reduced (gather + reduce-scatter with SP).
    ar_small = collective_time_s(system, "allreduce", T * 4.0, tp, 1.0)
    half_ag_rs = ag_rs / 2  # one of the two calls (same volume each)
    tp_embed = np.where(tp > 1, np.where(sp, half_ag_rs, ar), 0.0) * tp_exposed
    tp_head_fwd = np.where(tp > 1, np.where(sp, half_ag_rs, 0.0) + 3 * ar_small, 0.0) * tp_exposed
    tp_head_bwd = np.where(tp > 1, np.where(sp, ag_rs, ar), 0.0) * tp_exposed

    # -- context parallel: the K/V exchange of the attention core, as the stack runs it (Options.cp_comm) --
    cp_fwd, cp_bwd = _context_parallel_s(system, model, opts, T, tp, cp, core, core_bwd * (core - merge_fwd) + merge_bwd,
                                         stride_cp)
    # recompute that replays the attention op replays its K/V exchange too (torch.utils.checkpoint reruns the forward,
    # and with it the ring or all-gather inside the attention op: full recompute, and Korthikanti's selective, which
    # replays the attention core); torchtitan's per-op SAC saves SDPA's outputs, so its exchange is not replayed
    core_replayed = (not opts.selective_ops) and opts.recompute_core_attention
    cp_bwd = cp_bwd + np.where(rc == 2, rf, np.where((rc == 1) & core_replayed, 1.0, 0.0)) * cp_fwd

    layer_fwd = fwd_compute + tp_fwd + cp_fwd + a2a_fwd
    layer_bwd = bwd_compute + tp_bwd + cp_bwd + a2a_bwd
    host_wait = 0.0  # per layer and microbatch: how long the GPU waits for the host to issue its kernels
    if opts.host_launch_s:  # an eager loop whose host issues kernels slower than the GPU runs them: the GPU waits
        host_fwd, host_bwd = host_issue_s(model, opts, np.where(tp > 1, np.where(sp, 4.0, 2.0), 0.0), rc)
        host_wait = np.maximum(host_fwd - layer_fwd, 0.0) + np.maximum(host_bwd - layer_bwd, 0.0)
        layer_fwd, layer_bwd = np.maximum(layer_fwd, host_fwd), np.maximum(layer_bwd, host_bwd)

    # -- first/last stage extras: embedding lookup, output projection (logits) and cross-entropy --
    logits_mm = matmul_time_s(system, T, V / tp, h, opts=opts)
    ce_bytes = T * (V / tp) * opts.ce_bytes_per_logit  # the loss's traffic over the logits, both directions
    head_fwd = logits_mm + memory_time_s(system, ce_bytes / 2, 2) + tp_head_fwd
    head_bwd = 2 * logits_mm + memory_time_s(system, ce_bytes / 2, 2) + tp_head_bwd
    embed = memory_time_s(system, 2 * T * h * BF16_BYTES, 1) + tp_embed
    if model.mtp_layers:  # multi-token prediction on the head's stage (mtp_extra_s)
        mtp_fwd, mtp_bwd = mtp_extra_s(model, system, opts, T, tp, layer_fwd, layer_bwd, head_fwd, head_bwd, embed)
        head_fwd, head_bwd = head_fwd + mtp_fwd, head_bwd + mtp_bwd

    # -- pipeline: p2p activations between stages (Megatron scatter/gather: 1/t of them per rank) --
    # what a stage sends per rank: the SP shard, or with Megatron's scatter/gather 1/t of the replicated
    # activation; paratrain's runtime without SP sends it whole
    p2p_bytes = act_bytes / np.where(sp | opts.p2p_scatter_gather, tp, 1.0)
    # NxD's pipeline sends are 2-rank all-gathers in which the receiver transmits a buffer of the same size too
    # (Options.p2p_pair_allgather): every rank's links carry twice the bytes it sends
    p2p = np.where(pp > 1, p2p_time_s(system, p2p_bytes * (2.0 if opts.p2p_pair_allgather else 1.0), stride_pp, pp),
                   0.0)
    chunks = np.where(sched >= 2, v, 1.0)
    p2p_per_mb = 2 * chunks * p2p  # forward send + backward send per chunk

    # -- pipeline stages: layers per rank, and the slowest rank, which sets the pipeline's pace --
    v_shape = sched >= 3  # zbv, dualpipev
    # Gradients reduce (and FSDP shards) over dp x cp ranks: cp ranks hold gradients of different tokens of
    # the same sequences. In the default order (tp fastest, then cp) that group is one run at stride tp.
    dp_group = dp * cp
    per_node = np.maximum(1.0, np.minimum(dp_group, system.devices_per_node / grad_stride))
    hsdp_shard = per_node if dp_replicate is None else dp_group / np.asarray(dp_replicate, float)
    dp_shard = np.where(kind == 2, hsdp_shard, dp_group)

    moe_mem = moe_plan.memory_terms(flops_model, opts, T=T, tp=tp, cp=cp, dp=dp, ep=ep, etp=etp, zero=zero, rc=rc,
                                    routed=moe[5], sp=sp) if moe is not None else None

    def memory_of(loads):
        return memory_per_device(model, system, seq, opts, T=T, tp=tp, pp=pp, dp=dp, cp=cp, sp=sp, rc=rc,
                                 sched=sched, v=v, m=m, zero=zero, dp_shard=dp_shard, loads=loads, moe=moe_mem,
                                 ep=ep, etp=etp, offload=offload)

    balanced = balanced_loads(L, pp, v, v_shape)
    memory = None
    if stage_loads is None and split == "auto":
        chosen = best_loads(L, pp, v, v_shape, layer_fwd + layer_bwd, embed, head_fwd + head_bwd, balanced)
        # a faster split whose fuller ranks no longer fit in memory is no use where the balanced one fits
        mem_chosen, mem_balanced = memory_of(chosen), memory_of(balanced)
        keep = ~mem_chosen["fits"] & mem_balanced["fits"]
        stage_loads = Loads(*(np.where(keep, b, c) for b, c in
                              ((balanced.first, chosen.first), (balanced.last, chosen.last),
                               (balanced.inner, chosen.inner), (balanced.balanced, chosen.balanced))))
        memory = {k: np.where(keep, mem_balanced[k], mem_chosen[k]) for k in mem_chosen}
    loads = stage_loads or balanced
    layers_per_stage, embed_on, head_on = _slowest_rank(loads, pp, v_shape, layer_fwd + layer_bwd, embed,
                                                        head_fwd + head_bwd)
    stage_fwd = layers_per_stage * layer_fwd + embed_on * embed + head_on * head_fwd
    stage_bwd = layers_per_stage * layer_bwd + head_on * head_bwd
    offload_fwd, offload_bwd = offload_exposed_s(model, system, seq, opts, offloaded_layers(offload, layers_per_stage,
                                                 chunks), layer_fwd, layer_bwd, moe_mem, T=T, tp=tp, cp=cp, sp=sp, rc=rc)
    stage_fwd, stage_bwd = stage_fwd + offload_fwd, stage_bwd + offload_bwd
    # gradient accumulation as a pass of its own over the rank's gradients each microbatch (Options.grad_accum_in_hbm)
    accum_bytes = BF16_BYTES + 2 * opts.grad_bytes if opts.grad_accum_bytes is None else opts.grad_accum_bytes
    grad_accum = memory_time_s(system, _largest_rank(model, loads, pp, v_shape)[0] / tp * accum_bytes, 1) \
        if opts.grad_accum_in_hbm else 0.0
    stage_bwd = stage_bwd + grad_accum
    # FP8 delayed scaling (Options.fp8_amax_reduce): one blocking amax all-reduce over the stage's tp x cp x dp ranks
    # at the end of each chunk's forward and one at the end of its backward, on the compute stream's path
    delayed = opts.fp8 and opts.fp8_amax_reduce and not block_scaled(system, opts)
    amax = tiny_allreduce_s(system, tp * cp * dp) * chunks if delayed else 0.0
    stage_fwd, stage_bwd = stage_fwd + amax, stage_bwd + amax
    stage_mb = stage_fwd + stage_bwd + p2p_per_mb  # the slowest stage per microbatch

    # zero-bubble split of backward: W (weight gradients) = half of the backward matmuls
    stage_w = layers_per_stage * mm
    bubble = pipeline_bubble_s(sched, pp, v, m, stage_fwd, stage_bwd - stage_w, stage_w)
    pipeline = m * stage_mb + bubble
    p2p_path = m * p2p_per_mb  # the sends on the slowest rank's path: one exchange each way per microbatch
    if opts.p2p_serial:  # DeepSpeed's engine: 2(m - 1) + p - 2 exchanges each way, p - 1 for one microbatch
        p2p_path = np.where(pp > 1, np.where(m > 1, 2 * (m - 1) + pp - 2, pp - 1) * p2p_per_mb, 0.0)
        pipeline = pipeline + p2p_path - m * p2p_per_mb
    if opts.p2p_overlap:  # Megatron-Core's overlap_p2p_comm, interleaved 1F1B only (plan.pipeline.overlapped_p2p_path_s)
        pipeline, p2p_path = _overlapped_p2p(opts, sched, pp, v, m, p2p, stage_fwd / v, mm - mlp_fwd, pipeline,
                                             p2p_path)

    # -- data parallel: gradient reduce (and parameter gather for ZeRO-1/2/3) --
    params_rank, layers_rank = _largest_rank(model, loads, pp, v_shape)
    params_dev = params_rank / tp
    # Link sharing: data-parallel traffic hidden behind compute still needs its links free. Across nodes the
    # node's NICs also carry the pipeline's sends when the stages are on different nodes; inside a node (the
    # whole DP group within one NVLink/NeuronLink domain) the links also carry the TP collectives. That
    # busy time is taken out of the window the DP traffic can hide in.
    node = system.devices_per_node
    dp_out = group_span(grad_stride, grad_inner, grad_outer, dp_group) > node  # the DP group spans nodes
    pp_out = (pp > 1) & (stride_pp >= node)
    tp_busy = m * (layers_per_stage * (tp_fwd + tp_bwd) + head_on * (tp_head_fwd + tp_head_bwd) + embed_on * tp_embed)
    link_busy = np.where(dp_out, np.where(pp_out, m * p2p_per_mb, 0.0), np.where(tp > 1, tp_busy, 0.0))
    block_share = layers_rank * model.params_per_layer() / tp / params_dev  # the blocks' part (re-gathered)
    dp_time, dp_exposed = _data_parallel_s(system, opts, params_dev, dp_group, dp_shard, grad_stride, zero, kind, m,
                                           stage_fwd, stage_bwd, layers_rank, block_share, link_busy,
                                           pp=pp, chunks=np.where(sched == 2, v, 1.0), dp_split=dp_split)
    # Tied word embeddings under a pipeline: the first stage's embedding and the last stage's output layer are one
    # weight whose two gradients are summed between those two ranks after the last backward, before the optimizer
    # step (Megatron-LM finalize_model_grads -> _allreduce_word_embedding_grads; DeepSpeed PipelineEngine's
    # ReduceTiedGrads, an instruction of its TrainSchedule after the last backward): V x h / tp gradients, exposed
    # Multi-token prediction on the last stage reads the embedding too: Megatron-Core keeps a copy of it there whose
    # gradient is summed with the first stage's the same way (_allreduce_word_embedding_grads: the embedding group
    # holds the first stage and the MTP stage)
    if model.tie_embeddings or model.mtp_layers:
        tied = collective_time_s(system, "allreduce", V * h / tp * opts.grad_bytes, 2.0, stride_pp * np.maximum(pp - 1, 1))
        tied = np.where(pp > 1, tied, 0.0)
        dp_time, dp_exposed = dp_time + tied, dp_exposed + tied
    expert_opt = 0.0
    if moe is not None:  # routed experts reduce over their own expert-data-parallel group, in what the dense
        # part's hidden traffic leaves of the window (its exposed part runs after the compute, outside it)
        ex_time, ex_exposed, ex_params, ex_shard = moe_plan.expert_data_parallel_s(
            flops_model, system, opts, tp=tp, cp=cp, dp=dp, ep=ep, etp=etp, zero=zero, kind=kind, m=m,
            stage_fwd=stage_fwd, stage_bwd=stage_bwd, layers=layers_rank, link_busy=link_busy + dp_time - dp_exposed,
            pp=pp, chunks=np.where(sched == 2, v, 1.0))
        dp_time, dp_exposed = dp_time + ex_time, dp_exposed + ex_exposed
        expert_opt = memory_time_s(system, np.where(zero >= 1, ex_params / ex_shard, ex_params) * ADAM_STEP_BYTES, 0)

    # -- optimizer step: memory-bound Adam over this device's share of the parameters --
    opt_share = np.where(zero >= 1, params_dev / dp_shard, params_dev)
    step_bytes = ADAM_STEP_BYTES if opts.master_weights else BF16_ADAM_STEP_BYTES
    optimizer = memory_time_s(system, opt_share * step_bytes, 4) + expert_opt

    # FP8 with a weight cache: each step casts the device's layer weights once (amax, cast) and keeps the copies
    # backward needs (plan.kernels.fp8_copies)
    weight_cast = memory_time_s(system, layers_rank * model.params_per_layer() / tp * weight_cast_bytes(system, opts),
                                2 * cast_cost(system, opts)[1])
    fp8_cast = np.where(opts.fp8 & opts.fp8_weight_cache & (zero < 3), weight_cast, 0.0)
    step = pipeline + dp_exposed + optimizer + fp8_cast

    # -- FLOPs: one attention convention, causal, for counting and for timing (flash attention skips the masked
    # half; the other convention, the full s x s square of Narayanan et al. 2021 / PaLM, is reported beside it) --
    tokens = global_batch * seq
    flops = {}
    for name, attn_per_token in (("causal", CAUSAL_ATTENTION_FLOPS), ("full", 4.0)):
        attn_fwd = attn_per_token * L * seq * model.attention_width()  # forward attention FLOPs per token
        fwd = 2.0 * flops_model.num_matmul_params() + attn_fwd
        mlp_flops = 2.0 * L * _mlp_params_per_layer(model) if opts.recompute_mlp else 0.0
        if opts.recompute_mlp and flops_model.num_experts:  # the active routed experts are recomputed too
            mlp_flops += 2.0 * flops_model.moe_layers * flops_model.experts_per_token * 3 * h * flops_model.moe_ffn
        selective_flops = (attn_fwd if opts.recompute_core_attention else 0.0) + mlp_flops
        if opts.selective_ops:  # the recomputed matmuls (N x K per device times tp: the whole layer's)
            selective_flops = 2.0 * L * sum(n * k for n, k in _op_sac_recomputed(model, 1))
        recompute = np.where(rc == 2, rf * (fwd - 2.0 * V * h), np.where(rc == 1, selective_flops, 0.0))
        dead = np.where(tail_dead, np.where(rc == 2, rf, 1.0) * 2.0 * L * h * model.ffn, 0.0)  # the dead down-projection
        if opts.recompute_mla_up_proj and model.mla is not None:  # the up-projections' replay (not under full)
            up = sum(n * k for name, n, k, _ in mla_matmuls(model) if name in ("q_up", "kv_up"))
            recompute = recompute + np.where(rc == 2, 1.0 - rf, 1.0) * 2.0 * L * up
        recompute = (recompute - dead) * tokens
        flops[name] = (3.0 * fwd * tokens, 3.0 * fwd * tokens + recompute)
    model_flops, hardware_flops = flops[ATTENTION_CONVENTION]
    # with FP8 (FP4) matmuls MFU is taken against that format's peak (the rate they run at), so it stays below 1
    peak = devices * (low_precision_flops(system, opts) if opts.fp8 else system.device_peak_flops)
    mfu = model_flops / (step * peak)
    hfu = hardware_flops / (step * peak)

    # -- memory per device (the worst stage) --
    memory = memory or memory_of(loads)
    ones = np.ones_like(step)
    price = system.prices.on_demand_usd_per_hour
    cost_per_hour = nodes * price if price is not None else np.full_like(step, np.nan)
    return {
        "step_time_s": step, "tokens_per_s": tokens / step, "mfu": mfu, "hfu": hfu,
        "model_flops_per_step": model_flops * np.ones_like(step), "hardware_flops_per_step": hardware_flops,
        "model_flops_full_attention_per_step": flops["full"][0] * np.ones_like(step),
        "mfu_full_attention": flops["full"][0] / (step * peak), "hfu_full_attention": flops["full"][1] / (step * peak),
        "microbatches": m, "devices": devices,
        "time_compute_s": m * (layers_per_stage * (fwd_compute + bwd_compute)),
        "time_tp_comm_s": m * (layers_per_stage * (tp_fwd + tp_bwd) + head_on * (tp_head_fwd + tp_head_bwd)
                               + embed_on * tp_embed),
        "time_cp_comm_s": m * layers_per_stage * (cp_fwd + cp_bwd),
        "time_host_wait_s": m * layers_per_stage * host_wait * ones,
        "time_ep_comm_s": m * layers_per_stage * (a2a_fwd + a2a_bwd) * ones,
        "time_pp_comm_s": p2p_path * ones,
        "time_head_s": m * head_on * (head_fwd + head_bwd - tp_head_fwd - tp_head_bwd),
        "time_bubble_s": bubble, "time_dp_comm_s": dp_time, "time_dp_exposed_s": dp_exposed,
        "time_optimizer_s": optimizer, "time_fp8_cast_s": fp8_cast * np.ones_like(step), "bubble_fraction": bubble / step,
        "time_grad_accum_s": m * grad_accum * ones,
        "time_offload_exposed_s": m * (offload_fwd + offload_bwd) * ones,  # in the pipeline's stage time
        "time_fp8_amax_s": m * 2 * amax * ones,  # in the pipeline's stage time (Options.fp8_amax_reduce)
        # buffer bytes handed to collectives per device per step, by kind (for the simulator/cost model)
        "comm_tp_bytes": np.where(tp > 1, m * layers_per_stage * act_bytes * np.where(rc == 2, 4.0 + 2.0 * rf, 4.0)
                                  * ((1.0 + FP8_BYTES / BF16_BYTES) / 2 if opts.fp8 and opts.fp8_tp_allgather else 1.0), 0.0),
        "comm_pp_bytes": np.where(pp > 1, m * 2 * chunks * p2p_bytes, 0.0),
        "comm_ep_bytes": m * layers_per_stage * (moe[4] if moe is not None else 0.0) * ones,
        "comm_dp_bytes": np.where(dp * cp > 1, dp_bytes_per_step(opts, params_dev, zero, kind, m, pp, block_share),
                                  0.0),
        "cost_usd_per_hour": cost_per_hour,
        "stage_layers_first": loads.first * ones, "stage_layers_last": loads.last * ones,
        "stage_layers_inner": loads.inner * ones, "stage_balanced": loads.balanced & (ones > 0),
        **memory,
    }


def mtp_extra_s(model, system, opts, T, tp, layer_fwd, layer_bwd, head_fwd, head_bwd, embed):
    """(forward s, backward s) per microbatch that ModelConfig.mtp_layers multi-token-prediction depths add to the
    head's stage (Megatron-Core puts the MTP block after the decoder on the last stage: MultiTokenPredictionBlock;
    DeepSeek-V3 report sec. 2.2): per depth the embedding lookup of the shifted tokens, the two RMSNorms and the
    2h -> h projection of their concatenation (eh_proj, column-parallel), one transformer layer (timed as the
    model's average layer: its recompute, TP and all-to-all included; DeepSeek-V3's MTP layer is a MoE layer, the
    average carries 58/61 of one) and a second output head with its loss (the head's time again)."""
    h = model.hidden
    eh = matmul_time_s(system, T, h / tp, 2 * h, opts.fp8, opts)
    norms = memory_time_s(system, T * 2 * (2 * h) * BF16_BYTES, 2)
    depth_fwd = embed + norms + eh + layer_fwd + head_fwd
    depth_bwd = 2 * norms + 2 * eh + layer_bwd + head_bwd
    return model.mtp_layers * depth_fwd, model.mtp_layers * depth_bwd


def check_host_link(system: System, offload_layers: int) -> None:
    """Offloading needs the system's host link bandwidth to time its copies: one clear error where the catalog has
    none (no published source, e.g. Trainium)."""
    if offload_layers and system.host_link_gbytes_per_s is None:
        raise ValueError(f"parallel.offload_layers={offload_layers} on {system.name}: the catalog has no host link "
                         f"bandwidth for it (systems.{system.name}.host_link_gbytes_per_s, no published source), so "
                         f"the copies cannot be timed; allowed: offload_layers=0")


def host_copy_gbytes_per_s(system: System, copying: int | None = None) -> float:
    """One direction of the host rate per device (GB/s) when `copying` devices of a node copy to or from host memory
    at once (None: all of them, as every offloaded rank of a layout does in the same block): the least of the
    device's own link (host_link_gbytes_per_s), its share of the PCIe switch uplink it sits behind
    (host_uplink_gbytes_per_s over the copying devices behind it, at most host_uplink_devices) and its share of the
    node's host memory (host_memory_gbytes_per_s x host_memory_efficiency over the copying devices). An uplink or
    memory figure the catalog marks unpublished (host_*_unpublished) is not applied; NVLink-C2C (GB200) is its own
    path, its link already the device's share of the superchip's."""
    check_host_link(system, 1)
    n = system.devices_per_node if copying is None else int(copying)
    if not 1 <= n <= system.devices_per_node:
        raise ValueError(f"copying devices = {copying} on {system.name}: allowed: 1 to {system.devices_per_node}")
    rate = system.host_link_gbytes_per_s
    if system.host_link_kind != "pcie":
        return rate
    if system.host_uplink_gbytes_per_s is not None:
        rate = min(rate, system.host_uplink_gbytes_per_s / min(n, system.host_uplink_devices))
    if system.host_memory_gbytes_per_s is not None:
        rate = min(rate, system.host_memory_gbytes_per_s * system.host_memory_efficiency / n)
    return rate


def offload_exposed_s(model, system, seq, opts, n, layer_fwd, layer_bwd, moe_mem, *, T, tp, cp, sp, rc):
    """(forward, backward) exposed time per microbatch of a stage's activation offloading (parallel.offload_layers):
    each offloaded block's activations (the bytes plan.memory keeps for it, less what stays on the device) go to
    the host at host_copy_gbytes_per_s (every device of the node copying at once) while the block computes, and
    come back while the block after it runs its backward (one block prefetched, on a copy stream of their own: Megatron-Core / Transformer Engine's
    offload scheduler, torch's save_on_cpu with pinned memory). Exposed only where a copy outlasts the compute it
    hides behind; the HBM traffic of the copies is not taken from the compute (their bytes are a few per cent of
    the layer's). n: the offloaded blocks of the stage's rank (plan.memory.offloaded_layers)."""
    if not np.any(n > 0):
        return 0.0, 0.0
    check_host_link(system, int(np.max(n)))
    per_layer, _ = layer_activation_bytes(model, seq, opts, T=T, tp=tp, cp=cp, sp=sp, rc=rc)
    moved = per_layer + (moe_mem["activations"] if moe_mem is not None else 0.0) - offload_kept_bytes(model, T, tp, rc)
    copy = moved / (host_copy_gbytes_per_s(system) * 1e9)  # every offloaded device of the node copies at once
    return n * np.maximum(copy - layer_fwd, 0.0), n * np.maximum(copy - layer_bwd, 0.0)


def _context_parallel_s(system, model, opts, T, tp, cp, core_fwd, core_bwd, stride_cp=None):
    """(forward, backward) exposed time of one layer's context-parallel K/V exchange (Options.cp_comm) over the
    cp group, its ranks stride_cp apart (the rank order's; None: tp, the default order's).

    ring (Megatron-Core cp_comm_type p2p, ring attention): the K/V of the local tokens pass (cp - 1) times
    between neighbours while the attention blocks compute; backward passes K/V and dK/dV. allgather (Dubey et al.
    2024, Llama 3 sec. 3.3.2: "we first all-gather the key (K) and value (V) tensors, and then compute attention
    output for the local query (Q) tensor chunk"; "the all-gather communication latency is exposed in the critical
    path"): one all-gather of K/V before the attention forward, the reduce-scatter of dK/dV after its backward,
    both exposed. allgather_rotate (torch.distributed.tensor context_parallel with rotate method "allgather",
    torchtitan's default context_parallel_rotate_method: "all-gather all kv shards on ranks after the first
    sub-SDPA computation"): the gather hides only behind the local block's attention (1/cp of it); backward
    gathers K/V again the same way and rotates dK/dV around a ring in fp32 (its dkv_rotater is always
    ALL_TO_ALL, convert_to_f32), each rotation hidden behind the next block's backward but the last, which the op
    waits for after its loop (_templated_ring_attention_backward at the torch of Dec 2024 and since). That overlap is
    eager's: ft_c returns an AsyncCollectiveTensor waited at first use. Compiled (Options.eager False: torchtitan's
    per-block torch.compile(fullgraph=True), which Dynamo traces into the ring, torch.distributed being in its
    MOD_INLINELIST), `_maybe_wrap_tensor` emits `wait_tensor` right after each collective ("When tracing ... the result
    tensor is not an AsyncCollectiveTensor", _attention.py `_maybe_wait`), and Inductor moves no wait without
    `reorder_for_compute_comm_overlap`, False by default (torch/_inductor/config.py): the gather is exposed forward
    and backward, and so are all cp dK/dV rotations."""
    kv_width = query_dim(model) / tp if opts.cp_kv_repeated else model.kv_dim / np.minimum(tp, model.n_kv_heads)
    if model.mla is not None:  # every head's key and value after the up-projection (Megatron-Core's CP runs on them)
        kv_width = sum(key_value_dims(model)) / 2 / tp
    kv_local = 2 * T * kv_width * BF16_BYTES  # K and V of the local tokens, as they reach the attention op
    stride = tp if stride_cp is None else stride_cp
    if opts.cp_comm == "ring":
        ring = (cp - 1) * p2p_time_s(system, kv_local, stride, cp)
        fwd, bwd = np.maximum(0.0, ring - core_fwd), np.maximum(0.0, 2 * ring - 2 * core_fwd)
    else:
        gather = collective_time_s(system, "allgather", cp * kv_local, cp, stride)
        if opts.cp_comm == "allgather":
            fwd = gather
            bwd = collective_time_s(system, "reducescatter", cp * kv_local, cp, stride)
        else:
            dkv_one = p2p_time_s(system, 2 * kv_local, stride, cp)  # fp32: twice the bf16 K/V bytes
            if not opts.eager:  # compiled (see the docstring): every collective of the ring waited for where issued
                return np.where(cp > 1, gather, 0.0), np.where(cp > 1, gather + cp * dkv_one, 0.0)
            fwd = np.maximum(0.0, gather - core_fwd / cp)
            # cp rotations: the one sent after step i hides behind step i + 1's block; the last is waited for after
            # the loop (`dkv_rotater.next_buffer()` before the return), with no block left to hide behind
            bwd = (np.maximum(0.0, gather - core_bwd / cp) + np.maximum(0.0, (cp - 1) * dkv_one - core_bwd * (cp - 1) / cp)
                   + dkv_one)
    return np.where(cp > 1, fwd, 0.0), np.where(cp > 1, bwd, 0.0)


def kv_replica_grad_s(system, model, opts, T, tp):
    """Exposed backward time per layer of summing the K/V output gradients over the ranks that hold replicas of one
    K/V head (Options.kv_replica_grad_bytes; NxD's GQAQKVColumnParallelLinear where tp exceeds the KV heads, see
    plan.stacks): one all-reduce of the rank's K and V gradients (T tokens, its one KV head's width each, gathered
    under SP) over tp / kv-heads replicas, cast to the reduce dtype and back around it. The QKV backward's two GEMMs
    both need the summed gradient, so nothing hides it. The replicas are tp / replicas ranks apart (NxD's
    arrange_kv_groups on Trn1: "(K0,K1,K2,K3)(K0,K1,K2,K3)...", interleaved), or neighbours
    (Options.kv_replicas_adjacent: NxD on Trn2)."""
    tp = np.asarray(tp, dtype=float)
    replicas = tp / np.minimum(tp, model.n_kv_heads)
    if not opts.kv_replica_grad_bytes or not np.any(replicas > 1):
        return np.zeros_like(tp)
    elements = 2 * T * model.kv_dim / np.minimum(tp, model.n_kv_heads)  # K and V, one head's width each
    reduce = collective_time_s(system, "allreduce", elements * opts.kv_replica_grad_bytes, replicas,
                               1.0 if opts.kv_replicas_adjacent else tp / replicas)
    cast = memory_time_s(system, elements * 2 * (BF16_BYTES + opts.kv_replica_grad_bytes), 2) \
        if opts.kv_replica_grad_bytes != BF16_BYTES else 0.0
    return np.where(replicas > 1, reduce + cast, 0.0)
