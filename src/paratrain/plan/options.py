"""The software choices that are not part of the layout (`Options`), and how paratrain's own runtime runs.

`Options.for_system` gives the defaults of a system's usual training stack (plan/stacks.py); a training run
passes its own (train/predict.py). The physics that reads each field is named in its description below.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.schema import ParallelSection
from paratrain.hardware.catalog import System
from paratrain.plan.precision import FP8_BYTES, WEIGHT_BYTES

ATTENTION = ("flash", "unfused")
CP_COMM = ("ring", "allgather", "allgather_rotate")  # how context parallelism exchanges K/V (Options.cp_comm)
MOE_FLEX_BACKENDS = ("deepep", "hybridep")  # Megatron-Core's moe_flex_dispatcher_backend values

# paratrain's Llama block forward, eager: aten ops that are neither views nor matmuls nor the attention core
# (tests/test_plan_model.py counts them with a dispatch mode and checks this number)
EAGER_ELEMENTWISE_KERNELS = 32
EAGER_EXTRA_MATMULS = 3  # q, k, v and gate, up as separate matmuls (the model counts qkv and gate+up fused)
# HBM bytes per token of that block's elementwise ops in eager bf16 (every non-view, non-matmul, non-attention aten
# op's inputs and outputs, counted with a dispatch mode; docs/planner.md "Eager PyTorch's elementwise traffic"):
# two fp32 RMSNorms at 36 bytes per element (cast 6, pow 8, mean 4, x * rsqrt 8, cast back 6, * weight 4) and two
# residual adds at 6: 84 per element of h; SiLU 4 + product 6 per element of f; K/V repeated to the query width
# where GQA (4 per element of q + kv); the rotary per element of q and k: Options.eager_rope_bytes
EAGER_NORM_RESIDUAL_BYTES = 84
EAGER_SWIGLU_BYTES = 10
EAGER_REPEAT_KV_BYTES = 4
EAGER_ROPE_BYTES = 54  # paratrain's fp32 rotary on even/odd halves; torchtitan's complex multiply: plan.stacks
# the runtime's DDP bucket (parallel.ddp_bucket_mb's default, torch DDP's bucket_cap_mb), by the config's one conversion
RUNTIME_BUCKET_BYTES = ParallelSection().ddp_bucket_bytes
# How paratrain's own runtime runs (Options fields): the defaults on `paratrain probe` hosts, and what a
# training run records for the planner (train.loop.planner_options overrides bucket and eager from its config).
PARATRAIN_RUNTIME = {"bucket_bytes": RUNTIME_BUCKET_BYTES, "eager": True, "p2p_scatter_gather": False,
                     "zero12_as_fsdp": True}


@dataclass(frozen=True)
class Options:
    """Software choices that are not part of the layout.

    attention: "flash" (fused, causal blocks skipped, no s^2 activations) or "unfused" (Megatron 2021-22:
    explicit scores, softmax and dropout kernels; what the published A100 measurements ran).
    grad_bytes: bytes per gradient element kept and reduced (4: fp32 main grads, Megatron's default).
    param_bytes: bytes per parameter element FSDP/ZeRO all-gathers (2: bf16 copies; 4 for an fp32 run).
    A training run passes both from its config (paratrain.config.precision_bytes: train.dtype, reduce_dtype).
    bucket_bytes: gradient bucket size of replicated data parallelism, one collective call per bucket. None:
    Megatron-core's default, max(40M, 1M x dp) parameters ("larger DP sizes need larger buckets to ensure
    collectives do not become latency-bound", DistributedDataParallelConfig.bucket_size). paratrain's own
    reducer uses torch DDP's 25 MiB (RUNTIME_BUCKET_BYTES): the default on this machine ("local" systems).

    eager: PyTorch eager execution, one kernel per op, as paratrain's runtime runs without train.compile: its
    Llama block launches EAGER_ELEMENTWISE_KERNELS elementwise kernels per forward (norms in fp32, rotary,
    SwiGLU, residuals; counted from the model by a test) where a fused stack launches a handful, and separate
    q/k/v and gate/up matmuls (7 instead of 4). Each launch pays the chip's kernel_overhead_s. Its elementwise ops
    move the bytes counted from that block (EAGER_* per token: fp32 norms, residuals, SwiGLU, rotary, GQA repeat),
    4.2x a fused stack's on the hidden-size part. eager_rope_bytes: the rotary's bytes per element of q and k
    (paratrain's even/odd fp32 rotary 54; torchtitan's complex multiply about 20, plan.stacks).
    p2p_scatter_gather: without SP, pipeline stages send 1/t of the activation per TP rank and all-gather it
    on arrival (Megatron, Narayanan et al. 2021); paratrain's runtime sends the whole replicated activation.
    fp8: the layer matmuls (QKV, output projection, MLP) run in FP8 at the chip's FP8 peak with per-tensor
    scaling (Transformer Engine, torchao float8); attention core, norms, head and loss stay BF16.
    fp4: those matmuls run in a 4-bit block-scaled format (MXFP4, NVFP4) at the chip's FP4 peak (its FP8 peak
    where it lists none), 1/2-byte operands; otherwise as fp8 (the same casts and the same activations kept
    for backward, at 1 byte: what is kept in 4 bits is recipe-specific). Implies the fp8 path.
    block_scaling: the low-precision formats are block-scaled (MX: one scale per 32 elements, found while
    casting, no separate amax pass over the tensor) rather than per-tensor scaled; None: the chip's own rates
    decide (chip.fp8_block_scaled, Trainium3/4), FP4 is always block-scaled.
    dp_overlap: fraction of compute that data-parallel traffic can hide behind, when the software does not use
    what the system allows (None: the system's efficiency.dp_overlap). Megatron-LM 2021-22 ran its gradient
    all-reduce after the backward: 0.
    fp8_weight_cache: the FP8 copy of each weight (and its transpose) is made on the first microbatch of a step
    and kept (Transformer Engine's is_first_microbatch, as Megatron-Core passes it): one cast per step, 2 bytes
    per parameter more memory; otherwise (torchao float8) every forward and backward call casts the weight.
    fp8_param_gather: Megatron-Core's FP8 primary weights (--fp8-param-gather; Megatron-Bridge's and NeMo 2's FP8
    mixed-precision configs set it): with fp8 the model's weights exist only as FP8 (and Transformer Engine's FP8
    transpose for the backward) beside the distributed optimizer's fp32 master, so no bf16 copy is kept, and the
    data-parallel parameter gathers carry 1 byte per parameter (`gather_bytes`).
    fp8_amax_reduce: FP8 delayed scaling as Transformer Engine 1.6+ runs it (DelayedScaling, what NeMo 1.0's
    fp8_hybrid / amax_history configs and Megatron's --fp8-recipe delayed run): at each fp8_autocast exit
    (FP8GlobalStateManager.fp8_autocast_exit) and at the end of that region's backward (the first FP8 module's
    backward, reduce_and_update_bwd_fp8_tensors) a MAX all-reduce of the region's amaxes with async_op=False, so
    the compute stream waits for it, over Megatron-Core's amax reduction group: every tensor- and data- (and
    context-) parallel rank of the pipeline stage (parallel_state._AMAX_REDUCTION_GROUP, tp x dp consecutive
    ranks). Megatron-Core's TransformerBlock wraps each model chunk's layers in one fp8_autocast: two such
    all-reduces per chunk per microbatch. Current scaling and MX formats find each tensor's scale locally: none.
    tp_comm_overlap: tensor-parallel collectives (with SP) pipelined with the GEMMs next to them, as
    Transformer Engine's userbuffer overlap (Megatron-Core/NeMo tp_comm_overlap) and torch's async TP do; the GEMMs
    run split into the chunks the collectives deliver (tp_overlap_split_s). tp_overlap_sms: ((matmul name, SMs), ...)
    the overlapped reduce-scatter kernels take from the GEMM (Transformer Engine's PipelineOverlapCfg num_sm with
    set_sm_margin; plan.stacks megatron: TE_OVERLAP_SMS); empty: none (copy-engine collectives).
    recompute_mlp: selective recompute also replays the MLP block (its two matmuls, activation function and, with
    TP, its all-gather/reduce-scatter or all-reduce), and keeps only the block's input instead of the gate/up
    outputs: NeuronX Distributed's activations_checkpoint_recompute_mlp (NxDT hf_llama3_70B_config.yaml) and
    its tp_pp examples at seq 8192 (run_llama_nxd.py: "For 8K seq-length, we have to checkpoint the MLP block").
    selective_ops: "selective" recompute is torchtitan's per-op selective activation checkpointing (its
    activation_checkpoint mode "selective" with selective_ac_option "op", torchtitan/distributed/activation_checkpoint.py
    _get_custom_policy): inside each block the outputs of the save list (matmuls, SDPA, TP reduce-scatters) are kept,
    except that every second matmul is recomputed (the count restarts per block: of wq, wk, wv, wo, w1, w3, w2 the
    2nd, 4th and 6th: wk, wo, w3), and every other op (norms, rotary, SwiGLU, residuals, TP all-gathers) is
    recomputed. Backward replays those three matmuls, the forward's elementwise ops and its all-gathers; the layer
    keeps its input, the outputs of wq, wv, SDPA (with its log-sum-exp), w1 and w2 (w2's before its reduction, full
    width), and the reduce-scatters' outputs (selective_ops_terms). Otherwise "selective" is Korthikanti et al.'s
    (the attention core replayed).
    zero1_grad_allreduce: ZeRO-1 that all-reduces the whole gradient buffer and then all-gathers the updated weights
    (instead of reduce-scattering it): DeepSpeed's BF16_Optimizer, what a bf16 run with ZeRO stage 0 in its DeepSpeed
    config gets (its own ZeRO-1: optimizer states partitioned, the fp32 gradient buffer not): get_grads_for_reduction
    returns the whole fp32_groups_gradients_flat, which the engine all-reduces over the data-parallel group, and
    update_lp_params all-gathers each rank's updated partition (microsoft/DeepSpeed deepspeed/runtime/bf16_optimizer.py).
    last_bucket_after_backward: a bucketed data-parallel gradient reduce (DDP's all-reduce, zero1_grad_allreduce, or
    ZeRO-1/2's reduce-scatter; not FSDP, whose last unit is timed on its own) whose calls follow the backward
    bucket by bucket: the first starts once its bucket has filled, the last (the remainder,
    holding the embedding's gradient, the last one produced) only after the backward, so at least one bucket's
    reduce is exposed even where the backward is long enough to hide the rest (plan.data_parallel). InternLM's
    HybridZeroOptimizer (InternLM/InternLM internlm/solver/optimizer/hybrid_zero_optim.py @c18bec9): the gradient
    hook calls _reduce_grads_stored_in_bucket when the next gradient would overflow reduce_bucket_size, and
    _reduce_and_copy synchronizes the device before each all-reduce on its communication stream; step()
    reduces what is left in the bucket (_reduce_grads_stored_in_bucket) and synchronizes again before the
    optimizer runs. The megatron, fsdp2 and deepspeed stacks' default (PyTorch DDP's Reducer, Megatron-Core's
    buckets, DeepSpeed's ZeRO-1/2 buckets: plan.stacks).
    recompute_every: full recompute checkpoints one layer in N and the others keep all their activations (replay
    nothing): torchtitan's "selective layer" activation checkpointing, mode "selective" with selective_ac_option N
    (config_manager.py's default "2", "checkpoint every other layer", at 0413364; parallelize_llama.checkpoint_wrapper
    wraps every N-th block in ptd_checkpoint_wrapper and returns the others as they are). 1: every layer (full).
    matmul_eff: fraction of peak the GEMMs reach where the software does not reach the chip's matmul_eff_max
    (PyTorch-native stacks on Hopper, see plan.stacks); None: the chip's.
    attention_eff: fraction of peak the attention kernel reaches where it is not the chip's matmul_eff_max
    (on Hopper: FlashAttention-2, PyTorch SDPA's flash backend, for the PyTorch-native stacks; Transformer Engine's
    cuDNN fused attention for megatron: see plan.stacks).
    overlap_param_gather: Megatron-Core's distributed optimizer with overlap_grad_reduce and overlap_param_gather
    (NeMo / Megatron-Bridge's settings): the post-step parameter all-gather and the gradient reduce-scatter are
    dispatched as Megatron-Core does (_megatron_dp_exposed_s: bucket by bucket behind the first microbatch's
    forward, chunk by chunk under interleaving); otherwise (NxD ZeRO-1) the post-step gather is exposed.
    param_gather_in_step: with overlap_param_gather, the run turns Megatron-Core's overlap_param_gather off and keeps
    overlap_grad_reduce (Megatron-Bridge 0.2.0's 70B / 405B MXFP8 performance configs, "keeping this enabled causes
    NaN grad norm"): DistributedOptimizer.step_with_ready_grads all-gathers every chunk's updated parameters
    synchronously inside the optimizer step (start_param_sync, not dispatched async; megatron-core core_v0.15.0
    optimizer/distrib_optimizer.py), so the gather is exposed whole; the reduce-scatter as before.
    zero12_as_fsdp: ZeRO-1/2 run as FSDP without resharding after forward (paratrain has no separate ZeRO-1:
    plan/config_writer.runtime_dp): per microbatch one all-gather per unit, one reduce-scatter per unit per
    step, no post-step gather; otherwise Megatron's distributed optimizer (bucketed reduce-scatter, all-gather
    after the step).
    MoE (plan/moe.py): ep_overlap, the fraction of the expert all-to-all hidden behind compute (DeepSeek-V3's
    DualPipe overlaps it fully; 0: it is exposed); moe_imbalance, the busiest expert rank's load over the mean
    (1: force-balanced routing as benchmark runs use; None: plan.moe.routing_imbalance from the router and the
    capacity factor); moe_fp8_dispatch: tokens dispatched in FP8 (DeepSeek-V3, DeepEP), combined in BF16;
    moe_hierarchical_dispatch: a token crosses the network once per destination node, NVLink fans it out
    (DeepEP / HybridEP, Megatron-Core's flex dispatcher); otherwise a flat all-to-all sends all k copies;
    moe_gemm_per_expert: the grouped expert GEMM is one GEMM launch per local expert (Transformer Engine's
    GroupedLinear on Hopper: multi-stream cuBLASLt), otherwise one launch for all (torch._grouped_mm, DeepGEMM);
    moe_fused_padding: the dispatcher delivers each local expert's rows already padded to the low-precision
    alignment (HybridEP's pad_multiple), so Transformer Engine's Fp8Padding / Fp8Unpadding around the per-expert
    GEMMs copy nothing (plan.moe.fp8_padding_s; the alltoall dispatcher and DeepEP leave that to them);
    recompute_norm_act: the backward also reruns the MoE layers' pre-MLP norm and the routed experts'
    activation, whose outputs the forward dropped and which are not kept (Megatron-Core's recompute_modules
    "layernorm" and "moe_act"; plan.moe.norm_act_replay_s, plan.moe.activation_bytes_per_layer); the attention
    core is replayed only under selective recompute, as before.
    recompute_mla_up_proj: the backward reruns multi-head latent attention's up-projections and RoPE (ModelConfig.mla),
    whose outputs, the attention core's Q, K and V, the forward dropped after the core ran (Megatron-Core's
    recompute_modules "mla_up_proj": multi_latent_attention.py wraps qkv_up_proj_and_rope_apply in a
    CheckpointWithoutOutput, discard_output_and_register_recompute after core attention; plan.layer.
    mla_up_proj_replay_s, plan.memory.layer_activation_bytes); nothing for a model without MLA.
    recompute_core_attention: selective recompute replays the attention core (Korthikanti et al. 2022; Megatron-
    Core's recompute_modules "core_attn", its default); False where the run's recompute_modules leave it out (the
    DeepSeek-V3 recipes' ["mla_up_proj", "mlp"]: selective recompute of the MLP block alone, with recompute_mlp).
    moe_probs_in_experts: the routing probabilities scale the expert activation's output inside the expert
    block (Megatron-Core since core 0.13, "Memory efficient token permutation"), so the combine keeps no expert
    output for the probabilities' gradient (plan.moe.activation_bytes_per_layer); otherwise it is kept.
    wgrad_accumulation_fusion: weight-gradient GEMMs accumulate into the main_grad buffer in place (cuBLAS
    beta = 1: Megatron-Core's gradient_accumulation_fusion), reading it back; timed for the expert GEMMs, where
    few rows per expert make it count (plan.moe.wgrad_accumulate_s).
    ce_bytes_per_logit: HBM bytes the cross-entropy moves per logit, forward + backward. 12 (the default): fp32
    softmax read and write and the gradient write; Megatron-Bridge's performance runs use Transformer Engine's
    Triton cross-entropy on the bf16 logits (plan.stacks, megatron: 10).
    loss_peak_bytes_per_logit: device memory per logit of the last stage live at the loss backward's peak, on top
    of the activations. 6 (the default): the bf16 logits and the fp32 softmax that Megatron's vocab-parallel
    cross-entropy keeps and turns into the gradient in place; PyTorch's F.cross_entropy on fp32 logits (torchtitan,
    Composer under autocast, Hugging Face models) keeps the log-softmax output and, in its backward, holds it beside
    nll_loss's dense fp32 gradient and log_softmax_backward's fp32 result: 12 (plan.stacks).
    tp_loss_peak_bytes_per_logit: the same where tp > 1, if the stack's loss differs there (None: the same as
    loss_peak_bytes_per_logit); torch's DTensor loss_parallel, which torchtitan runs under TP: 16 (plan.stacks).
    moe_flex_backend: the flex dispatcher's backend where it is named ("deepep", "hybridep"; None: unnamed or
    not the flex dispatcher): its SM share and HybridEP's node-copy stage (plan.moe.hybridep_node_copy_s).
    cp_comm: how context parallelism exchanges K/V (CP_COMM; _context_parallel_s): "ring" (Megatron-Core's p2p,
    hidden behind the attention blocks), "allgather" (one exposed all-gather, Llama 3's), "allgather_rotate"
    (torch's context_parallel as torchtitan runs it: gathered behind the first block, dK/dV on a ring).
    tp_bwd_overlap: with SP, the backward's TP collectives run beside the GEMMs that do not need them (NxD's
    LinearWithAsyncCommunication under the Neuron compiler, which schedules collectives on their own queue):
    a column-parallel linear's input re-gather beside its input-gradient GEMM, its reduce-scatter beside its
    weight-gradient GEMM; the row-parallel linears' output-gradient gathers stay exposed.
    p2p_pair_allgather: each pipeline send is an all-gather over the [sender, receiver] pair in which the
    receiver contributes a zero buffer of the same size (neuronx_distributed/pipeline/comm.py send/recv_from:
    "Use all_gather instead of all_reduce for send/recv", the default; XLA has no point-to-point), so a rank
    transmits twice the activation bytes a point-to-point send would.
    fsdp_pp_unsharded: FSDP under a pipeline keeps each stage's parameters gathered and its gradients unsharded
    for the whole step, as torchtitan runs it: its apply_fsdp sets reshard_after_forward=False when PP is on
    ("to avoid per-microbatch all-gathers"), and torch.distributed.pipelining's backward_maybe_with_nosync sets
    reshard_after_backward(False) and requires_gradient_sync(False) until the last backward, then runs every
    unit's post_backward (its reduce-scatter) at once. One gather per unit per step, one reduce-scatter per unit
    after the stage's last backward, exposed; memory: the gathered copy and fp32 unsharded gradients.
    master_weights: Adam keeps fp32 master weights, m and v (OPTIMIZER_BYTES, ADAM_STEP_BYTES: mixed precision, what
    NxD's "BF16+FP32Optimizer" and Megatron/torchtitan run); False: pure BF16 with stochastic rounding, the bf16
    weights updated in place and m, v in bf16 (BF16_OPTIMIZER_BYTES, BF16_ADAM_STEP_BYTES: Neuron's "Autocast:BF16+SR",
    XLA_USE_BF16=1, as neuronx-nemo-megatron's bf16SR and the Neuron Megatron-LM reference run). Gradients are bf16 then
    too: pass grad_bytes=2.
    optimizer_state_bytes: the optimizer's state per parameter where the run's optimizer says it (precision.
    OPTIMIZER_STATE_BYTES: Apex DistributedFusedAdam's 16-bit param remainders, 10; a bf16 master with bf16 m, v,
    6); None: by master_weights (12 or 4). Memory only: the Adam step's traffic stays master_weights'.
    distribute_saved_activations: under full recompute without SP, each block's checkpointed input is split over the
    TP group (1/tp per rank) and all-gathered before its replay: Megatron-LM's --distribute-saved-activations
    (CheckpointFunction: split_tensor_into_1d_equal_chunks forward, gather_split_1d_tensor backward), metaseq's
    --distribute-checkpointed-activations (metaseq/modules/checkpoint_activation_wrapper/checkpoint_activations.py
    @f7ffa5f, the same mpu calls on the first tensor input). Memory: the kept input at 1/tp; time: one TP all-gather
    of it per replayed layer and microbatch, exposed (the replay needs it).
    dropout: the model's dropout layers are on (attention and hidden dropout > 0), so the GPT count keeps their
    masks (Korthikanti et al.: two 1-byte hidden masks per token, and under unfused attention the scores' mask and
    the dropped-out probabilities); False: a run configured with dropout 0 keeps neither (nn.Dropout with p 0
    returns its input: ATen's dropout skips p == 0). Llama-style models have no dropout either way.
    fused_softmax: unfused attention's scale-mask-softmax runs as one kernel that reads and writes the scores once
    (Megatron's fused softmax, Neuron's NEURON_FUSE_SOFTMAX=1 "custom lowering for Softmax"); False: the softmax as
    XLA's standard lowering fuses it (reduce-max, reduce-sum of exp, normalise: three reads and one write of the
    scores, the mask fused into the reads; backward a reduce of dy * y, then dx: four reads and a write against the
    fused kernel's two and one), i.e. two more passes over the scores each way, as neuronx-nemo-megatron ran before its
    2.18 release set NEURON_FUSE_SOFTMAX (its configs: masked_softmax_fusion False). No effect with flash attention.
    cp_kv_repeated: the attention op receives K and V already repeated to the query heads (torchtitan's Llama runs
    repeat_kv before SDPA, and torch's context_parallel wraps SDPA), so context parallelism exchanges K/V at the
    query width, not GQA's.
    tp_saves_gathered_input: with SP, the column-parallel matmuls save the all-gathered full-sequence block inputs
    (the attention's and the MLP's normalised inputs) for their weight gradients, not the sequence shard (torch's
    DTensor TP: SequenceParallel then ColwiseParallel, torchtitan); Megatron-Core saves the shard and gathers again.
    The output projection's input likewise (torchtitan's "output" ColwiseParallel(input_layouts=Shard(1))): the
    gathered final-norm output, live at the loss on the head's rank.
    fsdp_root_unsharded: FSDP's root unit (the parameters outside the per-layer units: embedding, final norm,
    output head) stays gathered from its forward to the end of the backward: torch's FSDP2 never reshards the root
    after forward (FSDPState._lazy_init: post_forward_mesh_info = None, "the parameters would be freed and
    all-gathered immediately") and torchtitan wraps the root in its own fully_shard (apply_fsdp at 9dec370).
    fsdp_stream_pools: FSDP's collectives allocate their buffers in their own CUDA streams, whose cached blocks the
    caching allocator hands only to allocations of the same stream (c10/cuda/CUDACachingAllocator.cpp: "Once freed,
    blocks can be re-allocated on the same stream, but not on any other stream"; with expandable_segments one
    segment per stream), so those pools' high-water marks add to the default stream's in torch's reserved bytes:
    FSDP2's reduce-scatter stream keeps the reduce dtype inputs of the largest units beside the sharded gradients it
    writes (foreach_reduce: reduce_scatter_input and reduce_output allocated under reduce_scatter_stream), the
    all-gather copy-in stream the gathered buffers of the root and a layer (foreach_all_gather's
    all_gather_output, freed at the next unit's copy-out).
    fsdp_low_precision_shard: the sharded parameters keep a copy in param dtype beside the fp32 master (Megatron's
    distributed optimizer: its bf16 model weights); False: FSDP's shard is the fp32 parameter itself and the bf16
    copy exists only while gathered (FSDP2's FSDPParam.all_gather_inputs casts the shard at each all-gather;
    FSDP1's _mp_shard likewise), so it is not counted.
    pp_last_stage_keeps_outputs: the pipeline's last stage keeps every microbatch's output (its logits) until the
    step ends (torch.distributed.pipelining's output_chunks, returned by step(); detached since pytorch PR #138504,
    Oct 2024), so at the last microbatch's loss all m are live (2 bytes per logit each).
    pp_stage_buffers: torch.distributed.pipelining's per-microbatch communication buffers and kept stage outputs
    (plan.memory.pp_stage_buffer_bytes): one preallocated activation receive buffer per microbatch on every stage
    that receives (the done microbatches' keep their input gradient), one gradient receive buffer per microbatch on
    every stage that is not the last, and every microbatch's stage output (torch before May / Oct 2025).
    kv_replica_grad_bytes: where tp exceeds the KV heads and the stack replicates each K/V head on tp / kv-heads
    ranks (NxD's GQAQKVColumnParallelLinear, kv_size_multiplier), the backward all-reduces the K and V output
    gradients over those replicas before the QKV GEMMs' backward (neuronx_distributed/modules/qkv_linear_utils.py:
    xm.all_reduce of grad_output_k, grad_output_v over get_kv_shared_replica_groups, cast to reduce_dtype, whose
    default is float32): bytes per element of that all-reduce (4; 0: no such all-reduce, the stack replicates no
    K/V head or the model has enough of them). kv_replicas_adjacent: those replicas are neighbouring ranks (NxD on
    Trn2); otherwise tp / replicas ranks apart (NxD on Trn1).
    host_launch_s: host (CPU) time the stack's eager training loop spends issuing one of a layer's kernels or
    collective calls (Python, the dispatcher, autograd, the launch). CUDA launches are asynchronous, so the GPU only
    runs ahead of the host while its kernels take longer than the host needs to issue them; a layer pass whose
    kernels are shorter waits for the host (plan.layer.host_issue_s: the pass takes the longer of the two). 0: not
    modelled (the host assumed always ahead). Megatron-LM 2021-22 on A100 (the benchmark's MEGATRON options) sets it.
    grad_accum_in_hbm: every microbatch's weight gradients are added into the step's gradient buffer by a pass of
    their own over HBM, not inside the weight-gradient GEMM: read the new bf16 gradient, read and write the buffer
    (2 + 2 x grad_bytes bytes per parameter of the rank, on its backward). NxD with ZeRO-1 and fp32 accumulation
    (torch_xla's ZeroRedundancyOptimizer use_grad_acc_hook: a post-accumulate hook runs
    `main_grad.add_(param.grad.to(optimizer_dtype))` on a full-size fp32 main_grad, then frees param.grad), and the
    XLA_USE_BF16 stacks (neuronx-nemo-megatron, the Neuron Megatron-LM reference: autograd or Megatron's local DDP add
    into a bf16 .grad / main_grad). False: not timed (a GPU stack accumulating in the GEMM, Megatron-Core's
    gradient_accumulation_fusion, is timed only for expert GEMMs: plan.moe.wgrad_accumulate_s).
    p2p_serial: pipeline sends and receives are separate blocking calls, one after the other, as DeepSpeed's
    PipelineEngine runs its TrainSchedule (microsoft/DeepSpeed deepspeed/runtime/pipe/schedule.py, engine.py,
    p2p.py: dist.send / dist.recv, synchronous, since e2fdd25 (29 Sep 2021, torch >= 1.8); before it, through
    v0.5.3, a dist.broadcast on a 2-rank group per pair of stages, as blocking and as ordered): a forward step
    receives the activation, then sends the previous backward's gradient; a backward step sends the previous
    forward's activation, then receives the gradient. In the steady state each send waits for its neighbour to
    finish the pass it is in, and both directions' transfers lie on the path one after the other, where Megatron's
    send_forward_recv_backward exchanges them at once. Replaying that schedule with rendezvous sends (a send and its
    receive start together and end after one transfer time c) gives 2(m - 1) + p - 2 exchanges of 2c each on the
    path (p - 1 with one microbatch): 4c per microbatch plus the fill and drain's 2c per stage, against m of 2c (m x
    p2p_per_mb) where False (tests/test_plan_model.py replays the schedule). 1F1B and GPipe (pp > 1) only.
    p2p_overlap: Megatron-Core's overlap_p2p_comm under the interleaved schedule: the steady state's sends and receives
    run async beside the next pass, the warm-up's and cool-down's stay blocking (plan.pipeline.overlapped_p2p_path_s);
    other schedules as False. False: every send on the path (m x p2p_per_mb).
    p2p_fwd_send_wait: with p2p_overlap, each steady-state forward send is waited for right after it is posted
    (Megatron-LM PR #4047, core >= 0.18, where deallocate_pipeline_outputs is set: plan.software.megatron_core_options).
    grad_accum_bytes: HBM bytes per parameter that grad_accum_in_hbm's pass moves; None: one fused read-add-write,
    2 + 2 x grad_bytes. DeepSpeed's BF16_Optimizer runs it eagerly in two kernels (plan.stacks.DEEPSPEED_BF16_ACCUM_BYTES).
    replay_drops_dead_tail: the backward's replay of a checkpointed block (full recompute: the layer; selective
    recompute with recompute_mlp: the MLP block) leaves out its last down-projection GEMM and that GEMM's TP
    reduce-scatter (all-reduce without SP), whose outputs no backward op reads: torch_xla's reentrant checkpoint
    (torch_xla/utils/checkpoint.py, what NxD's checkpoint_wrapper and apex's CheckpointFunction rerun) hands the
    replayed outputs to torch.autograd.backward, which reads their grad_fn, not their values; under torch-neuronx
    (DISABLE_NUMERIC_CC_TOKEN=1, pytorch/xla PR #6077) no later collective depends on the dead one's result, and an
    unpinned collective without a channel id has no side effect in XLA (HloInstruction::HasSideEffectNoRecurse), so
    the compiler's dead-code pass drops it with the GEMM that feeds it. NxD and neuronx-nemo-megatron call
    reduce-scatter with pin_layout=False. torch.utils.checkpoint's non-reentrant replay (torch >= 2.1, the fsdp2 stack:
    plan.stacks.TORCH_EARLY_STOP) stops before that GEMM, torch.compile's partitioner leaves it out. False: the
    replay reruns the whole block (Megatron's and DeepSpeed's reentrant checkpoints; torch < 2.1).
    norm_saved_bytes: bytes per element of a Llama block's RMSNorm input that autograd keeps for the backward, per
    norm (2: the bf16 input, Korthikanti's count). NxDT's LlamaRMSNorm (neuronx_distributed_training/models/hf_models/
    modeling_llama.py) casts the input to fp32 (utils.get_cast_dtype) and normalises it there: pow keeps the fp32
    input (4) and the weight product the bf16 normalised output (2): 6 (plan.memory.memory_per_device: two norms a
    layer, sharded with SP; NxDT's trn2 Llama 3 70B config recomputes LlamaRMSNorm to save them).
    fp8_tp_allgather: with fp8 and SP, the layers' TP all-gathers carry FP8 (1 byte per element), the
    reduce-scatters BF16: torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput cast the input before its
    all-gather, and Float8RowwiseParallel casts the output gradient (NoopFwToFloat8BwDynamic) before the
    backward's all-gather (torchao/float8/float8_tensor_parallel.py, as torchtitan applies it with Float8 + TP).
    """

    attention: str = "flash"
    grad_bytes: int = 4
    param_bytes: int = WEIGHT_BYTES
    fp8: bool = False
    fp4: bool = False
    block_scaling: bool | None = None
    tp_comm_overlap: bool = False
    tp_overlap_sms: tuple = ()
    overlap_param_gather: bool = False
    param_gather_in_step: bool = False
    attention_eff: float | None = None
    matmul_eff: float | None = None
    fp8_weight_cache: bool = False
    fp8_param_gather: bool = False
    recompute_mlp: bool = False
    selective_ops: bool = False
    recompute_every: int = 1
    zero1_grad_allreduce: bool = False
    last_bucket_after_backward: bool = False
    dp_overlap: float | None = None
    bucket_bytes: float | None = None
    eager: bool = False
    eager_rope_bytes: float = EAGER_ROPE_BYTES
    p2p_scatter_gather: bool = True
    zero12_as_fsdp: bool = False
    ep_overlap: float = 0.0
    moe_imbalance: float | None = None
    moe_fp8_dispatch: bool = False
    moe_hierarchical_dispatch: bool = False
    moe_gemm_per_expert: bool = False
    moe_fused_padding: bool = False
    moe_flex_backend: str | None = None
    recompute_norm_act: bool = False
    recompute_mla_up_proj: bool = False
    recompute_core_attention: bool = True
    moe_probs_in_experts: bool = False
    ce_bytes_per_logit: float = 12.0
    loss_peak_bytes_per_logit: float = 6.0
    tp_loss_peak_bytes_per_logit: float | None = None
    wgrad_accumulation_fusion: bool = False
    cp_comm: str = "ring"
    p2p_pair_allgather: bool = False
    tp_bwd_overlap: bool = False
    fsdp_pp_unsharded: bool = False
    fp8_tp_allgather: bool = False
    cp_kv_repeated: bool = False
    tp_saves_gathered_input: bool = False
    fsdp_root_unsharded: bool = False
    fsdp_stream_pools: bool = False
    fsdp_low_precision_shard: bool = True
    pp_last_stage_keeps_outputs: bool = False
    pp_stage_buffers: bool = False
    master_weights: bool = True
    optimizer_state_bytes: float | None = None
    dropout: bool = True
    distribute_saved_activations: bool = False
    fused_softmax: bool = True
    kv_replica_grad_bytes: float = 0.0
    kv_replicas_adjacent: bool = False
    host_launch_s: float = 0.0
    grad_accum_in_hbm: bool = False
    grad_accum_bytes: float | None = None
    p2p_serial: bool = False
    p2p_overlap: bool = False
    p2p_fwd_send_wait: bool = False
    replay_drops_dead_tail: bool = False
    norm_saved_bytes: float = 2.0
    fp8_amax_reduce: bool = False

    @classmethod
    def for_system(cls, system: System, attention: str | None = None, stack: str | None = None,
                   system_stack: bool = True, **kw) -> Options:
        """Defaults of the system's usual training stack (e.g. NxD on Trn1 runs unfused attention and is timed as
        the nxd stack: the catalog's stack.runs_as), or of the named stack (plan.stacks: nxd, megatron, fsdp2,
        deepspeed); explicit keywords win. system_stack False (plan --any-stack): generic timing."""
        from paratrain.plan.stacks import STACKS, stack_options

        default = system.stack.attention if system.stack is not None else "flash"
        if stack is None and system_stack and system.stack is not None and system.stack.runs_as:
            kw = {**stack_options(system.stack.runs_as, system.chip), **kw}
        if stack is not None:
            kw = {**stack_options(stack, system.chip), **kw}
            default = STACKS[stack].attention
        if system.chip.vendor == "local":  # measured by `paratrain probe`: paratrain's runtime runs here
            kw = {**PARATRAIN_RUNTIME, **kw}
        return cls(attention=attention or default, **kw)

    @property
    def gather_bytes(self) -> float:
        """Bytes per parameter the data-parallel parameter gathers carry: FP8 primary weights (fp8_param_gather)
        gather 1 byte, else param_bytes."""
        return FP8_BYTES if self.fp8_primary_weights else self.param_bytes

    @property
    def fp8_primary_weights(self) -> bool:
        """fp8_param_gather in effect: per-tensor FP8 only. Megatron-Bridge's FP8 current-scaling and delayed-scaling
        configs set it in every release read; its MXFP8 config had it off (bf16_with_mxfp8_mixed: False) before
        turning it on with reuse_grad_buf_for_mxfp8_param_ag, and which release the MXFP8 rows ran is not known."""
        return bool(self.fp8 and self.fp8_param_gather and not self.block_scaling)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"attention = {self.attention!r}: allowed: {', '.join(ATTENTION)}")
        if self.cp_comm not in CP_COMM:
            raise ValueError(f"cp_comm = {self.cp_comm!r}: allowed: {', '.join(CP_COMM)}")
        if self.moe_flex_backend not in (None, *MOE_FLEX_BACKENDS):
            raise ValueError(f"moe_flex_backend = {self.moe_flex_backend!r}: allowed: None, "
                             f"{', '.join(MOE_FLEX_BACKENDS)}")
        if not self.ce_bytes_per_logit > 0:
            raise ValueError(f"ce_bytes_per_logit = {self.ce_bytes_per_logit}: allowed: a number > 0")
        if not self.loss_peak_bytes_per_logit > 0:
            raise ValueError(f"loss_peak_bytes_per_logit = {self.loss_peak_bytes_per_logit}: allowed: a number > 0")
        if self.tp_loss_peak_bytes_per_logit is not None and not self.tp_loss_peak_bytes_per_logit > 0:
            raise ValueError(f"tp_loss_peak_bytes_per_logit = {self.tp_loss_peak_bytes_per_logit}: allowed: None or "
                             "a number > 0")
        if self.kv_replica_grad_bytes not in (0, 2, 4):
            raise ValueError(f"kv_replica_grad_bytes = {self.kv_replica_grad_bytes}: allowed: 0, 2, 4")
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"grad_bytes = {self.grad_bytes}: allowed: 2, 4")
        if not (isinstance(self.recompute_every, int) and self.recompute_every >= 1):
            raise ValueError(f"recompute_every = {self.recompute_every!r}: allowed: an integer >= 1")
        if not self.host_launch_s >= 0:
            raise ValueError(f"host_launch_s = {self.host_launch_s}: allowed: a number >= 0 (seconds)")
        if self.dp_overlap is not None and not 0 <= self.dp_overlap <= 1:
            raise ValueError(f"dp_overlap = {self.dp_overlap}: allowed: a number in [0, 1]")
        if self.matmul_eff is not None and not 0 < self.matmul_eff <= 1:
            raise ValueError(f"matmul_eff = {self.matmul_eff}: allowed: a number in (0, 1]")
        if self.attention_eff is not None and not 0 < self.attention_eff <= 1:
            raise ValueError(f"attention_eff = {self.attention_eff}: allowed: a number in (0, 1]")
        if self.param_bytes not in (2, 4):
            raise ValueError(f"param_bytes = {self.param_bytes}: allowed: 2, 4")
        if not 0 <= self.ep_overlap <= 1:
            raise ValueError(f"ep_overlap = {self.ep_overlap}: allowed: a number in [0, 1]")
        if self.moe_imbalance is not None and self.moe_imbalance < 1:
            raise ValueError(f"moe_imbalance = {self.moe_imbalance}: allowed: a number >= 1, or None")
        if self.fp4 and not self.fp8:  # the FP8 code path (casts, kept activations) carries FP4 too
            object.__setattr__(self, "fp8", True)
