"""Data-parallel traffic per step and the part of it compute does not hide: DDP's gradient buckets, ZeRO-1/2's
reduce-scatter and post-step gather, FSDP / HSDP unit by unit, Megatron-Core's distributed-optimizer dispatch order.
"""

from __future__ import annotations

import numpy as np

from paratrain.plan.collectives import collective_time_s, comm_sm_fraction, overlapped_exposed_s
from paratrain.plan.numeric import select


def _calls_s(system, kind, total_bytes, calls, degree, stride, **split):
    """`calls` collectives of equal size sharing `total_bytes`: the volume is paid once, the latency and
    per-call overhead `calls` times (what makes many small collectives slower than one large one). split: the
    group's inner / outer_stride where the rank order keeps its dimensions apart (collective_time_s)."""
    return calls * collective_time_s(system, kind, total_bytes / np.maximum(calls, 1), degree, stride, **split)


def default_bucket_bytes(opts, dp):
    """Bytes of one gradient bucket (one collective call): opts.bucket_bytes, or where the run leaves it unset
    Megatron-Core's default, max(40M, 1M x dp) parameters of the data-parallel group dp
    (DistributedDataParallel.__init__: `max(40000000, 1000000 * dp_group.size())`)."""
    return (np.maximum(40e6, 1e6 * dp) * opts.grad_bytes) if opts.bucket_bytes is None else opts.bucket_bytes


def _dp_modes(opts, zero, kind, pp):
    """Which data-parallel scheme each layout runs, the one place these tests are written (timing and bytes):
    hybrid1: InternLM's hybrid ZeRO-1 (hsdp + zero 1); zero12: ZeRO-1/2; as_fsdp: FSDP without resharding after
    forward (fsdp/hsdp with zero_stage 2, FSDP1's SHARD_GRAD_OP) and paratrain's ZeRO-1/2 that run as that (each
    unit gathered once per microbatch, reduce-scattered once per step); sharded: FSDP / HSDP proper (parameters
    gathered unit by unit); pinned: FSDP under a pipeline with opts.fsdp_pp_unsharded (gathered once per step)."""
    hybrid1 = np.asarray((kind == 2) & (zero == 1))
    zero12 = (zero >= 1) & (zero <= 2)
    as_fsdp = ((kind >= 1) & (zero == 2)) | (zero12 & opts.zero12_as_fsdp & ~hybrid1)
    sharded = (kind >= 1) & (zero >= 2)
    pinned = sharded & (np.asarray(pp) > 1) & opts.fsdp_pp_unsharded
    return hybrid1, zero12, as_fsdp, sharded, pinned


def dp_bytes_per_step(opts, params_dev, zero, kind, m, pp, block_share):
    """Buffer bytes one device hands to data-parallel collectives per step (the simulator's and cost model's
    comm_dp_bytes): the gradient reduce once, and the parameter gathers as _data_parallel_s times them."""
    _, zero12, as_fsdp, sharded, pinned = _dp_modes(opts, zero, kind, pp)
    gathers = select([pinned, as_fsdp, sharded, zero12], [1.0, m, m * (1.0 + block_share), 1.0], 0.0)
    return params_dev * (opts.grad_bytes + opts.gather_bytes * gathers)


def _data_parallel_s(system, opts, params_dev, dp, dp_shard, stride_dp, zero, kind, m, stage_fwd, stage_bwd,
                     stage_layers_dev, block_share, link_busy=0.0, pp=1.0, chunks=1.0, bucket_dp=None, dp_split=None):
    """(all DP communication time, the part not hidden behind compute) per step.

    dp_split: (inner, outer_stride) of the dp group where the rank order splits it (paratrain.config.ranks
    group_geometry: Llama 3's tp-cp-pp-dp puts the cp ranks of a dp x cp group 2,048 apart from the next dp's);
    None: one run of ranks stride_dp apart. Sub-groups of it (HSDP's shards) are runs (rule rank_order_hsdp).

    DDP all-reduces gradients in buckets (default_bucket_bytes; bucket_dp: the group whose size sets the default
    bucket where it is not dp, Megatron-Core's dense group for the expert buffers) once per step;
    ZeRO-1/2 reduce-scatter the same buckets and all-gather the updated parameters after the optimizer
    step; FSDP (one unit per block plus the root, as torchtitan and paratrain wrap it) gathers every
    unit for the forward of every microbatch and every block again for its backward, and reduce-scatters each
    unit once per step (gradient sync only on the last microbatch); HSDP does that inside a node (dp_shard
    ranks) and all-reduces each unit's shard across nodes. The gradient reduce can only hide behind the last
    microbatch's backward (earlier microbatches only accumulate); with opts.last_bucket_after_backward
    (InternLM's HybridZeroOptimizer) the bucketed all-reduce cannot start before its first bucket fills and its
    last bucket waits for the backward's end (_bucket_chain_exposed_s); FSDP/HSDP prefetch their gathers behind
    every microbatch, but all DP traffic together cannot hide behind more than the step's compute; the
    post-step gather of ZeRO-1/2 has nothing to hide behind. HSDP with ZeRO-1 (InternLM's HybridZeroOptimizer,
    zero1 = dp_shard): the bucketed all-reduce of DDP over the whole group, the optimizer state sharded inside each
    shard group, whose ranks then send one another their updated parameters (broadcast_params: a gather over
    dp_shard ranks after the step). FSDP under a pipeline with
    opts.fsdp_pp_unsharded (torchtitan): one gather per unit per step, prefetched behind the first microbatch's
    forward, and the reduce-scatters after the last backward, exposed.
    """
    sp = {} if dp_split is None else {"inner": dp_split[0], "outer_stride": dp_split[1]}
    grad_bytes = params_dev * opts.grad_bytes
    param_bytes = params_dev * opts.gather_bytes  # FP8 with Megatron's fp8_param_gather (Options.gather_bytes)
    bucket = default_bucket_bytes(opts, dp if bucket_dp is None else bucket_dp)
    buckets = np.maximum(1.0, np.ceil(grad_bytes / bucket))
    units = stage_layers_dev + 1.0  # block_share: the blocks' part of the parameters (backward re-gathers them)
    reduce_ar = _calls_s(system, "allreduce", grad_bytes, buckets, dp, stride_dp, **sp)
    reduce_rs = _calls_s(system, "reducescatter", grad_bytes, buckets, dp, stride_dp, **sp)
    hybrid1, zero12, as_fsdp, sharded, pinned = _dp_modes(opts, zero, kind, pp)
    # hybrid ZeRO-1 (hsdp, zero 1): the updated shards gathered inside the shard group only
    post_gather = _calls_s(system, "allgather", param_bytes, buckets, np.where(hybrid1, dp_shard, dp), stride_dp, **sp)
    unit_rs = _calls_s(system, "reducescatter", grad_bytes, units, dp, stride_dp, **sp)
    shard_rs = _calls_s(system, "reducescatter", grad_bytes, units, dp_shard, stride_dp, **sp)
    # per microbatch: every unit gathered for forward, the blocks again for backward
    unit_ag = (_calls_s(system, "allgather", param_bytes, units, dp, stride_dp, **sp)
               + _calls_s(system, "allgather", param_bytes * block_share, stage_layers_dev, dp, stride_dp, **sp))
    shard_ag = (_calls_s(system, "allgather", param_bytes, units, dp_shard, stride_dp, **sp)
                + _calls_s(system, "allgather", param_bytes * block_share, stage_layers_dev, dp_shard, stride_dp, **sp))
    repl_ar = _calls_s(system, "allreduce", grad_bytes / dp_shard, units, dp / dp_shard, stride_dp * dp_shard)
    fwd_ag = _calls_s(system, "allgather", param_bytes, units, dp, stride_dp, **sp)
    gathers = select([as_fsdp, sharded & (kind == 1), sharded & (kind == 2)], [m * fwd_ag, m * unit_ag, m * shard_ag],
                     0.0)
    # Options.zero1_grad_allreduce (DeepSpeed's BF16_Optimizer): ZeRO-1 all-reduces the whole gradient buffer
    zero1_ar = (zero == 1) & (opts.zero1_grad_allreduce | hybrid1)
    reduces = select([(zero == 0) | zero1_ar, as_fsdp, zero <= 2, kind == 1, kind == 2],
                        [reduce_ar, unit_rs, reduce_rs, unit_rs, shard_rs + repl_ar])
    post_step = np.where(zero12 & ~as_fsdp, post_gather, 0.0)  # DeepSpeed/Megatron: gather after the step
    overlap = system.efficiency.dp_overlap if opts.dp_overlap is None else opts.dp_overlap
    # the SMs NCCL's kernels hold while they hide behind compute (collectives.comm_sm_fraction): the compute they
    # overlap runs on the rest, so hidden traffic still costs sm x its time (collectives.overlapped_exposed_s)
    sm = comm_sm_fraction(system, dp, stride_dp)
    window_all = np.maximum(0.0, overlap * m * (stage_fwd + stage_bwd) - link_busy)
    window_last = np.maximum(0.0, overlap * stage_bwd - link_busy / np.maximum(m, 1.0))
    behind_last = overlapped_exposed_s(reduces, window_last, sm)
    if opts.last_bucket_after_backward:  # buckets issued from the backward's hooks, the last after it (Options)
        # DDP's bucketed all-reduce or ZeRO-1/2's bucketed reduce-scatter; FSDP/HSDP time their units below
        bucketed = ((kind == 0) | hybrid1) & ~as_fsdp
        behind_last = np.where(bucketed, _bucket_chain_exposed_s(reduces, buckets, window_last, sm), behind_last)
    exposed = np.maximum(overlapped_exposed_s(gathers + reduces, window_all, sm), behind_last) + post_step
    if opts.overlap_param_gather:  # Megatron-Core's distributed optimizer: its own dispatch order, below
        usable = np.maximum(0.0, overlap - link_busy / np.maximum(m * (stage_fwd + stage_bwd), 1e-30))
        megatron = _megatron_dp_exposed_s(post_step, reduces, buckets, pp, chunks, stage_fwd, stage_bwd, usable,
                                          opts.last_bucket_after_backward, sm, opts.param_gather_in_step)
        exposed = np.where(zero12 & ~as_fsdp,
                           np.maximum(megatron, overlapped_exposed_s(gathers + reduces + post_step, window_all, sm)),
                           exposed)
    # FSDP/HSDP layer by layer: with prefetch (FSDP2 and DeepSpeed ZeRO-3 gather layer i+1 while layer i
    # computes) a gather hides only behind one layer's compute, so when a layer's compute is short (small
    # microbatch per device, many ranks) the rest is exposed, layer after layer; the first gather of every
    # microbatch's forward has nothing before it. Backward: each layer's re-gather and (on the last
    # microbatch) its gradient reduce-scatter behind that layer's backward; the last reduce-scatter after it.
    layers = np.maximum(stage_layers_dev, 1.0)
    c_f, c_b = overlap * stage_fwd / layers, overlap * stage_bwd / layers
    group = np.where(kind == 2, dp_shard, dp)
    ag1 = collective_time_s(system, "allgather", param_bytes * block_share / layers, group, stride_dp, **sp)
    rs1 = collective_time_s(system, "reducescatter", grad_bytes * block_share / layers, group, stride_dp, **sp)
    sm_group = comm_sm_fraction(system, group, stride_dp)
    fwd = ag1 + (layers - 1) * overlapped_exposed_s(ag1, c_f, sm_group)
    kept = as_fsdp & (kind >= 1)  # parameters still gathered from the forward: no backward re-gather
    bwd = np.where(kept, 0.0, layers * overlapped_exposed_s(ag1, c_b, sm_group))
    # HSDP: each unit's shard is all-reduced across the replicas right after its reduce-scatter, on the same
    # stream (FSDP1 _post_backward_hook -> _all_reduce_grads; FSDP2 foreach_reduce's all_reduce after the
    # reduce-scatter), so it hides behind the backward of the layers before it, as the reduce-scatter does; the
    # last unit's and the root's (embedding, head) are left after the backward
    replicas = dp / np.maximum(dp_shard, 1.0)
    ar1 = np.where(kind == 2, collective_time_s(system, "allreduce", grad_bytes * block_share / layers / dp_shard,
                                                replicas, stride_dp * dp_shard), 0.0)
    root_ar = np.where(kind == 2, collective_time_s(system, "allreduce", grad_bytes * (1 - block_share) / dp_shard,
                                                    replicas, stride_dp * dp_shard), 0.0)
    bwd_sync = layers * overlapped_exposed_s(np.where(kept, 0.0, ag1) + rs1 + ar1, c_b, sm_group) + rs1 + ar1 + root_ar
    per_layer = m * fwd + (m - 1) * bwd + bwd_sync
    exposed = np.where(sharded, np.maximum(exposed, per_layer), exposed)
    # torchtitan's FSDP under torch.distributed.pipelining (Options.fsdp_pp_unsharded): gathered once in the first
    # microbatch's forward (prefetched layer by layer), kept; every unit's reduce-scatter issued together by
    # backward_maybe_with_nosync's run_post_backward after the stage's last backward, with nothing left to hide behind
    gathers = np.where(pinned, fwd_ag, gathers)
    reduces = np.where(pinned, np.where(kind == 2, shard_rs + repl_ar, unit_rs), reduces)
    exposed = np.where(pinned, np.maximum(0.0, np.minimum(fwd, fwd_ag)) + reduces, exposed)
    total = gathers + reduces + post_step
    return np.where(dp > 1, total, 0.0), np.where(dp > 1, exposed, 0.0)


def _bucket_chain_exposed_s(reduces, buckets, window, sm=0.0):
    """Exposed time of `buckets` equal gradient all-reduces (`reduces` in all) issued one after another as the
    backward (`window`, the part of it communication can hide behind) fills each bucket: the first starts after
    1/buckets of the backward, the last after the backward's end. Compute-bound (each call shorter than its
    bucket's compute): the last call, exposed whole; communication-bound: the chain's length from the first
    bucket's fill on, past the backward's end. sm: the SM share the hidden calls take from the backward they
    overlap (collectives.overlapped_exposed_s)."""
    per_call = reduces / buckets
    return np.maximum(per_call + sm * (reduces - per_call), reduces - window * (buckets - 1.0) / buckets)


def _megatron_dp_exposed_s(gather, reduce, buckets, pp, chunks, fwd, bwd, usable, last_bucket=False, sm=0.0,
                           gather_in_step=False):
    """Exposed time of Megatron-Core's distributed optimizer with overlap_grad_reduce and overlap_param_gather,
    as NeMo 2.x / Megatron-Bridge configure it (MegatronCommOverlapCallback / CommOverlapConfig
    _get_optimizer_overlap_cfgs: both on when dp > 1, align_param_gather when pp > 1 and vp > 1). gather /
    reduce: the stage's post-step parameter all-gather / gradient reduce-scatter; fwd / bwd: the stage's
    compute per microbatch; usable: the fraction of compute communication can hide behind.

    Megatron-Core r0.11-r0.15 (distributed_data_parallel.py, param_and_grad_buffer.py, schedules.py): the
    optimizer step does not gather (DistributedOptimizer.step_with_ready_grads); finish_grad_sync marks every
    bucket undispatched, so the next step's first forward gathers. Without interleaving, the first stage's
    forward pre-hook (_make_forward_pre_hook -> finish_param_sync) dispatches the first bucket, waits for it
    and dispatches the next one, which hides behind the forward of the bucket before (one bucket in flight, the
    first microbatch only); later stages hold one bucket (bucket_size None when pp_rank > 0), gathered whole
    after the first activation arrives, so the fill of the pipeline pays it on every stage after the first.
    Interleaved with align_param_gather: chunks 0 and 1 are dispatched before the first forward (chunk 0
    exposed), chunk c >= 2 at chunk c-1's first forward (forward_step_helper_preprocess), so each hides behind
    pp chunk forwards of the warm-up; the gradients of chunk c reduce after its last backward
    (backward_step_helper_postprocess) behind pp chunk backwards, chunk 0's after the last one, exposed.
    Without interleaving the hooks dispatch each bucket once its gradients are in (register_grad_ready ->
    start_grad_sync on the last microbatch); the buckets run in reverse parameter order, so the last one (the
    embedding's) waits for the backward's end (last_bucket: _bucket_chain_exposed_s). The parameter gather of
    the next forward does not hide it: finish_grad_sync waits for every bucket before the optimizer step. sm: the
    SM share hidden traffic takes from the compute it overlaps (collectives.overlapped_exposed_s). gather_in_step
    (Options.param_gather_in_step): the gather runs synchronously in the optimizer step, exposed whole."""
    pp = np.asarray(pp, float)
    n = np.maximum(chunks, 1.0)
    k = np.maximum(buckets, 1.0)
    per_chunk = lambda c, window: c / n + (n - 1) * overlapped_exposed_s(c / n, usable * pp * window / n, sm)  # noqa: E731
    interleaved = per_chunk(gather, fwd) + per_chunk(reduce, bwd)
    chain = gather / k + (k - 1) * overlapped_exposed_s(gather / k, usable * fwd / k, sm)
    grads = _bucket_chain_exposed_s(reduce, k, usable * bwd, sm) if last_bucket \
        else overlapped_exposed_s(reduce, usable * bwd, sm)
    flat = chain + np.maximum(pp - 1.0, 0.0) * gather + grads
    if gather_in_step:  # no gather left for the forward to hide: the step's own, then the grads as dispatched
        return gather + np.where((pp > 1) & (n > 1), per_chunk(reduce, bwd), grads)
    return np.where((pp > 1) & (n > 1), interleaved, flat)
