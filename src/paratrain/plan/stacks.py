"""Training stacks the planner can restrict its search to (`plan --stack NAME`), and how each runs.

A stack is what the training software supports (data-parallel kinds, ZeRO stages, pipeline schedules: the
search only looks at those) and how it runs what it supports (the `Options` defaults below). The system's own
`[systems.X.stack]` (hardware catalog) is used when no stack is named. No torch here.
"""

from __future__ import annotations

import numpy as np

from paratrain.hardware.catalog import Stack
from paratrain.plan.layer import TE_OVERLAP_SMS

STACKS: dict[str, Stack] = {
    "nxd": Stack(
        "NeuronX Distributed (NxD / NxDT)", ("ddp",), (0, 1), ("1f1b", "interleaved_1f1b"),
        "aws-neuron neuronx-distributed docs: TP, SP, PP (1F1B, interleaved), ZeRO-1, CP; no FSDP "
        "(hardware-facts.md Neuron facts); NxDT examples/conf/hf_llama3_*: zero1 True, flash_attention True",
        "flash"),
    "megatron": Stack(
        "Megatron-Core / NeMo", ("ddp", "fsdp"), (0, 1, 3), ("1f1b", "interleaved_1f1b"),
        "Megatron-Core: distributed optimizer (ZeRO-1 with bucketed reduce-scatter and overlap_param_gather), "
        "Megatron FSDP (NeMo performance tables: FSDP column), 1F1B and interleaved pipelines; activation CPU "
        "offloading (cpu_offloading_num_layers) only without pipeline parallelism and without recompute: NVIDIA/"
        "Megatron-LM @d98e8a6 megatron/core/transformer/transformer_config.py __post_init__ ('Currently there is no "
        "support for Pipeline parallelism with CPU offloading', 'CPU offloading does not work when activation "
        "recomputation is enabled'; Megatron-Bridge's CPU-offloading page: PP must be 1, recompute_granularity None)",
        "flash", offload_with_pp=False, offload_with_recompute=False),
    "fsdp2": Stack(
        "torchtitan (FSDP2 + DTensor TP + torch.distributed.pipelining)", ("ddp", "fsdp", "hsdp"), (0, 3),
        ("gpipe", "1f1b", "interleaved_1f1b", "zbv"),
        "pytorch/torchtitan docs: FSDP/HSDP (fully_shard), TP/async TP, CP, PP schedules GPipe, 1F1B, "
        "Interleaved1F1B, ZBVZeroBubble; no activation offloading in its trainer (pytorch/torchtitan @b5bcd76 "
        "torchtitan/config/configs.py: activation_checkpoint modes none / selective / full; training.enable_cpu_offload "
        "is FSDP2's CPUOffloadPolicy of parameters, gradients and optimizer states, torchtitan/distributed/fsdp.py; "
        "activations are offloaded only by the experiments/graph_trainer memory_policy sac_and_offload)",
        "flash", activation_offload=False),
    "deepspeed": Stack(
        "DeepSpeed (ZeRO-1/2/3, pipeline engine)", ("ddp", "fsdp"), (0, 1, 2, 3), ("1f1b",),
        "deepspeed.ai docs: ZeRO stages 1-3 (stage 3 = parameter partitioning with prefetch), PipelineModule "
        "runs a 1F1B schedule; activations reach the CPU only as checkpointed inputs (activation_checkpointing."
        "cpu_checkpointing inside deepspeed.checkpointing.checkpoint, i.e. under full recompute, which the planner "
        "does not offload), so no offloading of kept activations", "flash", activation_offload=False),
}

# How each stack runs (plan.options.Options fields). grad_bytes: Megatron-Core keeps bf16 gradient buffers
# (DistributedDataParallelConfig.grad_reduce_in_fp32 defaults to False); FSDP2 in torchtitan reduces in fp32
# (training.mixed_precision_reduce = float32); NxD's mixed_precision and DeepSpeed's bf16 mode keep fp32
# gradients for the fp32 optimizer. tp_comm_overlap: Transformer Engine's userbuffer overlap (NeMo's
# performance recipes enable tp_comm_overlap on Hopper and later; NVIDIA GPUs only). overlap_param_gather:
# Megatron's distributed optimizer hides the post-step parameter all-gather behind the next forward; NxD's
# ZeRO-1 runs it after the optimizer step. fp8_weight_cache: Megatron-Core passes Transformer Engine's
# is_first_microbatch, so a step casts each weight to FP8 once and keeps it; torchao float8 casts at every call.
# fp8_param_gather: Megatron-Bridge's bf16_with_fp8_current_scaling_mixed / bf16_with_fp8_mixed (and NeMo 2's
# MegatronMixedPrecision recipes of the same names) set fp8_param_gather = True (megatron/bridge/training/
# mixed_precision.py): FP8 primary weights, FP8 parameter all-gathers (plan.options.Options.fp8_param_gather).
# moe_gemm_per_expert: Megatron-Core's TEGroupedMLP runs Transformer Engine's GroupedLinear, which on Hopper
# launches one cuBLASLt GEMM per local expert over several streams (TE PR #853 "Grouped GEMM via multi-stream
# cuBLAS"; TE issue #1386: cuBLAS grouped/CUTLASS were slower for the MoE shapes measured, so not used).
# cp_comm (plan.step._context_parallel_s): torchtitan runs torch's context_parallel with its default rotate method
# (job_config parallelism.context_parallel_rotate_method = "allgather"); Megatron-Core's default cp_comm_type is
# "p2p", the ring (the Options default). fsdp_pp_unsharded: torchtitan's apply_fsdp keeps blocks gathered under
# PP (reshard_after_forward=False) and torch.distributed.pipelining defers resharding and gradient sync to the last
# backward (stage.py backward_maybe_with_nosync). fp8_tp_allgather: torchtitan's Float8 TP plan
# (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput from torchao.float8.float8_tensor_parallel)
# all-gathers activations and output gradients in FP8. p2p_pair_allgather: NxD sends pipeline activations as 2-rank all-gathers
# (neuronx_distributed/pipeline/comm.py). ce_bytes_per_logit: Megatron-Bridge's performance scripts set
# cross_entropy_fusion_impl = "te" (scripts/performance/utils/overrides.py, v0.2.2-v0.4.2), Transformer Engine's
# Triton parallel cross-entropy (TE v2.9-v2.14 transformer_engine/common/triton/cross_entropy.py): on the bf16
# logits, online_softmax_kernel reads them (2 bytes), cross_entropy_kernel reads them again and writes the
# gradient in place (2 + 2), the backward's element_mul_kernel scales it by the per-token loss gradient (2 + 2).
# A run that names its cross-entropy (csv column cross_entropy = --cross-entropy; plan.software) gets these HBM bytes per
# logit, forward + backward (Options.ce_bytes_per_logit): "te", the Triton kernel above (the megatron stack's
# default); "mcore_fused", Megatron-Core's fused_vocab_parallel_cross_entropy (megatron/core/fusions/
# fused_cross_entropy.py, the same at core_r0.8.0-r0.10.0), what NeMo 1.0's cross_entropy_loss_fusion: true runs
# (TransformerConfig.cross_entropy_loss_fusion -> LanguageModule.compute_language_model_loss). Its four jit_fuser
# (torch.compile from torch 2.2) functions over the fp32 copy it makes (VocabParallelCrossEntropy, tensor_parallel/
# cross_entropy.py): calculate_logits_max's .float() and max (read 2, write 4); calculate_predicted_logits' in-place
# subtract, exp and sum (read 4, write 4); calculate_cross_entropy_loss's in-place div_ (read 4, write 4); backward,
# calculate_gradients' in-place mul_ of the saved softmax, written back as the mutated input, and .to(bfloat16)
# (read 4, write 4 + 2): 32 bytes. "mcore": the same loss unfused, what Megatron-Core runs without that flag
# (tensor_parallel.vocab_parallel_cross_entropy, eager; core_v0.7.0 casts with logits.float() before the call, core_r0.8.0
# on inside calculate_logits_max): the fp32 copy (2 + 4), max (4), subtract (4 + 4; in place from 0.8), exp in place
# (4 + 4), sum (4), div_ (4 + 4); backward the in-place mul_ (4 + 4) and the fp32 gradient's cast to the bf16
# logits' dtype (4 + 2): 52 bytes.
# "flash_xentropy": flash-attn's fused CrossEntropyLoss (Dao-AILab/flash-attention v1.0.9 flash_attn/losses/
# cross_entropy.py over csrc/xentropy), llm-foundry's default loss_fn 'fused_crossentropy' for MPT (llmfoundry/models/mpt/
# modeling_mpt.py @061f2c7, setup.py pins flash-attn 1.0.9 and its xentropy-cuda-lib): xentropy_cuda_lib.forward reads
# the bf16 logits once (2) and writes one fp32 log-sum-exp per token; the backward reads them again (2) and writes the
# gradient (2; inplace_backward False, CrossEntropyLoss's default): 6 bytes
# "torch_compiled": torchtitan's F.cross_entropy(pred.float(), labels) wrapped in torch.compile where training.compile
# is set, from pytorch/torchtitan bbb1b61 (Apr 2025; torchtitan/components/loss.py build_cross_entropy_loss at e7c0cae;
# at 9dec370 the line is commented out, "compiling loss function causes CUDA errors", e8977b0): Inductor fuses the
# .float() into the reductions, whose two passes over a 128k-wide row (amax, then the sum of exp) read the bf16 logits
# (2 + 2); the backward reads them again with the saved per-token log-sum-exp and writes the bf16 gradient (2 + 2): 8
CROSS_ENTROPY_BYTES = {"te": 10.0, "mcore_fused": 32.0, "mcore": 52.0, "flash_xentropy": 6.0, "torch_compiled": 8.0}
# loss_peak_bytes_per_logit (plan.options.Options) of a named cross-entropy where it differs from the stack's:
# flash-attn's SoftmaxCrossEntropyLossFn keeps the bf16 logits (ctx.save_for_backward(logits, lse, labels)) and its
# backward returns a new bf16 gradient beside them: 2 + 2 bytes per logit (PyTorch's F.cross_entropy: 12); torch_compiled
# likewise: the compiled graph's partition saves its bf16 input and the per-token log-sum-exp (no fp32 log-softmax)
# and its backward writes one bf16 gradient: 2 + 2
CROSS_ENTROPY_LOSS_PEAK_BYTES = {"flash_xentropy": 4.0, "torch_compiled": 4.0}
# wgrad_accumulation_fusion: Megatron-Bridge's gradient_accumulation_fusion defaults on where Transformer Engine is
# installed (models/gpt_provider.py can_enable_gradient_accumulation_fusion); TE accumulates into main_grad.
# moe_probs_in_experts: Megatron-Core applies the routing probabilities in the expert activation (TEGroupedMLP
# bias_act_func, weighted swiglu / quick-geglu; megatron-lm!2668 "Memory efficient token permutation", Apr 2025,
# in every core the Megatron-Bridge containers of the MoE rows pin), so unpermute keeps no expert output.
# bucket_bytes: NeMo 2.x and Megatron-Bridge set the distributed optimizer's bucket_size to 128 Mi parameters
# whenever dp > 1 (MegatronCommOverlapCallback / CommOverlapConfig._get_optimizer_overlap_cfgs, NeMo v2.2.0,
# Megatron-Bridge v0.2.0), bf16 gradients (grad_bytes 2); Megatron-LM alone defaults to max(40M, 1M x dp), the
# Options default. Overlap flags and their dispatch order: plan.data_parallel._megatron_dp_exposed_s.
MEGATRON_BUCKET_PARAMS = 128 * 2**20
# kv_replica_grad_bytes: NxD's GQAQKVColumnParallelLinear (neuronx_distributed/modules/qkv_linear.py) replicates each
# K/V head on kv_size_multiplier ranks where tp exceeds the KV heads (its Llama 3 scripts: --kv_replicator 4 at
# TP32) and in the backward sums their K/V output gradients over those ranks: since the 2.24 release (c9ee222,
# qkv_linear_utils.py) one xm.all_reduce of both cast to reduce_dtype, float32 by default; in 2.19-2.21 (0f2a90f,
# 3aa65c6) two all-reduces, one each, in the gradients' own dtype (bf16: about the same time, one more call floor).
# Timed as the current code. Megatron-Core and torchtitan split KV heads over TP ranks without replicas.
NXD_KV_REDUCE_BYTES = 4
# kv_replicas_adjacent: NxD's arrange_kv_groups (parallel_state.py) puts the replicas of one K/V head on adjacent ranks
# on Trn2 ("Replicate single kv head on adjacent ranks (specific to Trn2 currently)"), interleaved tp / replicas ranks
# apart on Trn1 and Trn3 ("(K0,K1,K2,K3)(K0,K1,K2,K3)...", the hardware enum's other values)
NXD_ADJACENT_KV_CHIPS = {"trainium2"}
# ce_bytes_per_logit: NxD's Llama examples (examples/training/llama/modeling_llama_nxd.py, 2.20 4f95471 to 2.29) cast the
# vocab-parallel logits to fp32 (logits.to(torch.float32), after the SP transpose) and run parallel_cross_entropy
# (neuronx_distributed/parallel_layers/loss_functions.py): max over the vocabulary, sub_, exp, sum, div_ kept for the
# backward, whose in-place target scatter and mul_ by the loss gradient feed the cast back to bf16. As XLA fuses it
# (an elementwise chain fuses into its consumer; each reduction reads its input once), per logit: the cast read 2,
# write 4; the max read 4; the exp-sum read 4; the normalised softmax read 4, write 4; backward the softmax read 4 and
# the bf16 gradient written 2: 28 bytes (the default's 12 counts one fp32 softmax read and write and a gradient write)
NXD_CE_BYTES = 28.0
# grad_accum_in_hbm (plan.options.Options): NxD's ZeRO-1 with fp32 gradient accumulation (mixed_precision_config
# use_fp32_grad_acc, set with zero_one_enabled: neuronx_distributed/trainer/trainer.py -> use_grad_acc_hook) adds each
# microbatch's bf16 gradients into a full-size fp32 main_grad in a hook (torch_xla ZeroRedundancyOptimizer._make_param_hook)
# p2p_serial (plan.options.Options): DeepSpeed's PipelineEngine sends and receives one tensor at a time with blocking
# dist.send / dist.recv in its TrainSchedule's order (deepspeed/runtime/pipe/p2p.py, schedule.py TrainSchedule.steps;
# before e2fdd25, 29 Sep 2021, a dist.broadcast on a 2-rank group per stage pair: the same blocking rendezvous)
# grad_accum_bytes (plan.options.Options, with grad_accum_in_hbm; set by plan.software for zero1_grad_allreduce, which
# names DeepSpeed's BF16_Optimizer): every backward of every pipeline stage ends in BF16_Optimizer.update_hp_grads
# (PipelineEngine._exec_backward_pass calls it after torch.autograd.backward on all but the last stage, whose
# DeepSpeedEngine.backward -> BF16_Optimizer.backward calls it too; microsoft/DeepSpeed deepspeed/runtime/pipe/engine.py
# and bf16_optimizer.py at 56c5223 "bf16+pipeline parallelism" (#1801, Apr 2022) and at 1ed5aa9): for each of the rank's
# parameters `hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype)...)`, eager PyTorch: the cast reads the bf16 gradient (2)
# and writes an fp32 copy (4), add_ reads that copy and the fp32 buffer and writes the buffer (4 + 4 + 4): 18 bytes
DEEPSPEED_BF16_ACCUM_BYTES = 18.0
# zero1_fp16_allreduce (plan.software.Software, the csv column, --zero1-fp16-allreduce): DeepSpeed's fp16 ZeRO stage 1
# under the pipeline engine, as BLOOM's 02-25 layout search ran it (DeepSpeed master of Feb 2022, v0.5.10-v0.6.0;
# microsoft/DeepSpeed @2151c78, 18 Feb 2022). engine.py _configure_optimizer: fp16 with ZeRO -> _configure_zero_optimizer
# -> DeepSpeedZeroOptimizer (zero/stage_1_and_2.py), which for stage 1 forces overlap_comm, contiguous_gradients and
# round_robin_gradients False ("meaningless in stage 1"); without partition_gradients or overlap_comm no gradient
# hooks are registered, so autograd adds each microbatch's fp16 gradient into param.grad (read 2 + 2, write 2 bytes:
# Options.grad_accum_in_hbm at grad_bytes 2; the first microbatch's is a plain assignment, the optimizer's zero_grad
# sets .grad to None). At the boundary PipelineEngine._exec_reduce_grads -> allreduce_gradients -> stage 1's
# reduce_gradients(pipeline_parallel=True): every gradient into buckets of reduce_bucket_size elements,
# reduce_ipg_grads -> buffered_reduce_fallback(None, ...) -> allreduce_and_copy -> allreduce_bucket: flatten, div_ by
# the dp size, dist.all_reduce in fp16 (communication_data_type fp16: no cast), copied back (Options.zero1_grad_allreduce
# at grad_bytes 2). step(): the overflow check (float(x.float().sum()) per tensor of the rank's own partition), the
# norm, Adam on the fp32 partition, the fp16 copy, then dist.all_gather of the updated partitions in
# max(1, partition x dp // allgather_bucket_size) shards. Both bucket sizes default to 500,000,000 elements
# (zero/constants.py ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT, ZERO_OPTIMIZATION_ALLGATHER_BUCKET_SIZE_DEFAULT;
# BLOOM's ds_config of that week names neither: bigscience-workshop/bigscience @e6a63d8
# train/tr11-200B-ml/tr11-200B-ml.slurm)
DEEPSPEED_ZERO_BUCKET_ELEMENTS = 500_000_000
# norm_saved_bytes (plan.options.Options): NxDT's LlamaRMSNorm.forward (models/hf_models/modeling_llama.py at 9169aa0,
# the 2.26 release) runs hidden_states.to(float32), pow(2).mean, * rsqrt, .to(bf16), weight *: autograd keeps the
# fp32 input (4 bytes per element) and the bf16 normalised output (2) where the count has the bf16 input (2)
NXD_NORM_SAVED_BYTES = 6.0
# eager_rope_bytes (plan.options.EAGER_ROPE_BYTES): torchtitan's apply_rotary_emb (torchtitan/models/llama3/model.py)
# casts q and k to fp32 (read 2, write 4 bytes per element), multiplies them as complex numbers by freqs_cis (read 4,
# write 4; view_as_complex / view_as_real are views) and casts back (read 4, write 2): 20 bytes per element
TORCHTITAN_ROPE_BYTES = 20
# cp_kv_repeated: torchtitan's Llama attention repeats K/V to the query heads (repeat_kv) before SDPA, the op torch's
# context_parallel replaces, so CP moves query-width K/V (torchtitan/models/llama3/model.py Attention.forward)
# tp_saves_gathered_input (plan.options.Options): torchtitan's TP plan (parallelize_llama at 9dec370) prepares the
# attention's and the feed-forward's inputs with PrepareModuleInput(input_layouts Shard(1), desired Replicate) (fp8:
# torchao's PrepareFloat8ModuleInput, the cast before the gather), so the all-gathered full-sequence tensor is the
# input of wq/wk/wv and of w1/w3 (ColwiseParallel), which autograd saves for their weight gradients (F.linear on the
# local tensors, torch/distributed/tensor/parallel/style.py); Megatron-Core's LinearWithGradAccumulationAndAsync-
# Communication saves the sequence shard under sequence_parallel and all-gathers it again in the backward
# loss_peak_bytes_per_logit (plan.options.Options): torchtitan's loss is F.cross_entropy(pred.flatten(0, 1).float(),
# labels), its train step deletes the bf16 logits before backward ("need to free to before bwd to avoid peaking
# memory", train.py at 9dec370); log_softmax keeps its fp32 output for the backward, where nll_loss_backward's dense
# fp32 gradient and log_softmax_backward's fp32 result are live beside it: 3 x 4 bytes per logit. Composer/llm-foundry
# (F.cross_entropy under bf16 autocast, which runs it in fp32) and Hugging Face models (logits.float()) alike.
PYTORCH_LOSS_PEAK_BYTES = 12.0
# tp_loss_peak_bytes_per_logit (plan.options.Options): under TP torchtitan runs that loss inside loss_parallel()
# (parallelize_llama at 9dec370: the output projection ColwiseParallel to Shard(-1), disable_loss_parallel False by
# default) on the vocab-sharded logits; torch's DTensor handlers (torch/distributed/tensor/parallel/loss.py) keep the
# fp32 log-softmax for the backward, where _nll_loss_and_log_softmax_backward holds it beside a zeros_like fp32
# grad_input, exp(log-softmax) and their sum (then its product with the loss gradient written over it): 4 x 4 bytes
TORCH_LOSS_PARALLEL_PEAK_BYTES = 16.0
# fsdp_root_unsharded, fsdp_stream_pools, fsdp_low_precision_shard, pp_last_stage_keeps_outputs (plan.options.Options;
# memfrag, 4 Dec 2026): torch FSDP2 keeps the root unit gathered from its forward to the end of the backward
# (FSDPState._lazy_init sets the root's post_forward_mesh_info None, torch up to PR #154704, Jun 2025; the Dec 2024
# and the May 2025 builds the memory rows ran keep it; torchtitan's apply_fsdp wraps the root, 9dec370, e7c0cae),
# its reduce-scatter and all-gather copy-in buffers live in their own streams' caching-allocator pools
# (torch/distributed/_composable/fsdp/_fsdp_collectives.py foreach_reduce / foreach_all_gather;
# c10/cuda/CUDACachingAllocator.cpp: freed blocks go back to their stream only), its shard is the fp32 parameter
# (FSDPParam.all_gather_inputs casts it at each gather), and torch.distributed.pipelining's last stage keeps every
# microbatch's output for step()'s merged return (stage.py forward_one_chunk output_chunks)
# pp_stage_buffers (plan.options.Options; memacc3, 4 Dec 2026): torch.distributed.pipelining preallocates its receive
# buffers per microbatch, activations on every stage but the first and gradients on every stage but the last
# (stage.py _prepare_forward_infra / _prepare_backward_infra: `for chunk_id in range(num_microbatches)`, called from
# the schedules' __init__ for every local stage: PipelineScheduleSingle and PipelineScheduleMulti, torch 2.5-2.13); the
# input gradient of each done microbatch stays in its receive buffer's .grad until the next step (until pytorch PR
# #164329, Oct 2025) and every stage keeps every microbatch's output in output_chunks (until PR #153383, May 2025):
# what the Dec 2024 build of the memory rows ran (plan.memory.pp_stage_buffer_bytes)
# selective_ops: torchtitan's "selective" activation checkpointing is per-op (selective_ac_option "op", its default
# and what its published Llama tables name "selective op"): plan.options.Options.selective_ops
# last_bucket_after_backward (plan.options.Options): the data-parallel (non-FSDP) gradient reduce runs in buckets issued
# from the backward's hooks in reverse parameter order, so the last bucket (the first layers' and the embedding's
# gradients, the last produced) starts only at the backward's end: PyTorch DDP's Reducer (torch/csrc/distributed/c10d/
# reducer.cpp @ad78a7b: mark_variable_ready -> mark_bucket_ready once a bucket's pending count reaches 0, buckets
# launched in order, finalize_backward queued after the final one), what torchtitan's DDP (replicate) runs;
# Megatron-Core's DDP and distributed optimizer (megatron/core/distributed/param_and_grad_buffer.py @0e9fcc1: buckets
# built over `params[::-1]`, "reverse order to roughly follow backprop order"; register_grad_ready -> start_grad_sync
# once every parameter of a bucket group has its gradient, on the last microbatch); DeepSpeed's ZeRO-1/2
# (deepspeedai/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py @7dee2e0: each gradient's hook runs
# reduce_independent_p_g_buckets_and_remove_grads, which calls reduce_ipg_grads when the next gradient would overflow
# reduce_bucket_size; independent_gradient_partition_epilogue reduces the remainder after the backward). Not NxD:
# torch-xla's ZeRO-1 reduce-scatters in the optimizer step of the compiled graph, not from backward hooks.
# p2p_overlap (plan.options.Options): Megatron-Bridge / NeMo 2's CommOverlapConfig sets overlap_p2p_comm True and
# batch_p2p_comm False whenever pp > 1 and vp > 1 ("PP overlap", src/megatron/bridge/training/comm_overlap.py
# @6b3b5ba7), and leaves overlap_p2p_comm_warmup_flush at Megatron-Core's False (model_parallel_config.py); the
# schedule is NVIDIA/Megatron-LM megatron/core/pipeline_parallel/schedules.py at core_v0.13.0-core_r0.16.0 (b0cc2706)
# and unchanged there through core_v0.17.1 (266f1c97). MEGATRON_CORE_FWD_SEND_WAIT: the first release whose interleaved
# schedule waits for each forward send at once (PR #4047, 260cba7, 16 Apr 2026; in core_v0.18.0 ba7b5ebc, not in the
# core_r0.17.0 branch): Options.p2p_fwd_send_wait, set by plan.software.megatron_core_options from the run's version.
MEGATRON_CORE_FWD_SEND_WAIT = (0, 18)
# replay_drops_dead_tail (plan.options.Options) on the fsdp2 stack: torch.utils.checkpoint's non-reentrant replay
# stops "as soon as it has computed all needed Tensors" (torch/utils/checkpoint.py set_checkpoint_early_stop, the
# default; _recomputation_hook.pack_hook raises _StopRecomputationError at the last tensor the forward had saved).
# The block's last save is its down-projection's inputs, which autograd saves before that GEMM runs (an op's
# inputs are saved in the derivative setup ahead of its kernel call: tools/autograd/gen_variable_type.py
# emit_save_inputs), so the replay ends before the GEMM, its TP reduction and the residual add. Under torch.compile
# the checkpointed block's backward graph (torch/_functorch/partitioners.py classify_nodes: the closure of the
# tangents' users) recomputes only the forward nodes it reads, which leaves out the same GEMM. Non-reentrant is what the runs use: torchtitan's ptd_checkpoint_wrapper (CheckpointImpl
# NO_REENTRANT at 0413364, the torch default from 2.2 at 7c3a1fa / 9dec370: pytorch/pytorch#108435), IBM fms-fsdp's
# non_reentrant_wrapper (fms_fsdp/policies/ac_handler.py, torch >= 2.2). TORCH_EARLY_STOP: the first torch release
# with it (the rewrite pytorch/pytorch#90105 and #96866 "Make early stop the default", March 2023, after torch 2.0.0
# was cut; in 2.1): a run on an older torch (MosaicML's llm-foundry image, torch 2.0.1) reruns the whole block
# (plan.software.torch_options, the csv column torch / --torch). Megatron-Core's CheckpointFunction and DeepSpeed's
# are reentrant (a whole rerun, then torch.autograd.backward): not these stacks.
TORCH_EARLY_STOP = (2, 1)
TORCH_CHECKPOINT_STACKS = {"fsdp2"}  # stacks whose recompute is torch.utils.checkpoint's non-reentrant replay
STACK_OPTIONS: dict[str, dict] = {
    "nxd": {"grad_bytes": 4, "tp_comm_overlap": False, "overlap_param_gather": False, "p2p_pair_allgather": True,
            "tp_bwd_overlap": True, "kv_replica_grad_bytes": NXD_KV_REDUCE_BYTES, "ce_bytes_per_logit": NXD_CE_BYTES, "grad_accum_in_hbm": True,
            "replay_drops_dead_tail": True, "norm_saved_bytes": NXD_NORM_SAVED_BYTES},
    "megatron": {"grad_bytes": 2, "tp_comm_overlap": True, "tp_overlap_sms": TE_OVERLAP_SMS, "overlap_param_gather": True, "fp8_weight_cache": True,
                 "fp8_param_gather": True,
                 "bucket_bytes": MEGATRON_BUCKET_PARAMS * 2, "moe_gemm_per_expert": True, "ce_bytes_per_logit": CROSS_ENTROPY_BYTES["te"], "wgrad_accumulation_fusion": True,
                 "moe_probs_in_experts": True, "last_bucket_after_backward": True, "p2p_overlap": True},
    "fsdp2": {"grad_bytes": 4, "tp_comm_overlap": False, "overlap_param_gather": False, "cp_comm": "allgather_rotate",
              "fsdp_pp_unsharded": True, "fp8_tp_allgather": True, "eager_rope_bytes": TORCHTITAN_ROPE_BYTES,
              "selective_ops": True, "cp_kv_repeated": True, "loss_peak_bytes_per_logit": PYTORCH_LOSS_PEAK_BYTES,
              "tp_loss_peak_bytes_per_logit": TORCH_LOSS_PARALLEL_PEAK_BYTES, "tp_saves_gathered_input": True,
              "last_bucket_after_backward": True, "replay_drops_dead_tail": True, "fsdp_root_unsharded": True,
              "fsdp_stream_pools": True, "fsdp_low_precision_shard": False, "pp_last_stage_keeps_outputs": True,
              "pp_stage_buffers": True},
    "deepspeed": {"grad_bytes": 4, "tp_comm_overlap": False, "overlap_param_gather": False,
                  "loss_peak_bytes_per_logit": PYTORCH_LOSS_PEAK_BYTES, "p2p_serial": True, "last_bucket_after_backward": True},
}
# Stacks whose selective recompute may also replay the MLP block, searched both ways: NxD's
# activations_checkpoint_recompute_mlp (NxDT examples/conf/hf_llama3_70B_config.yaml ships it with TP32 PP8)
MLP_RECOMPUTE_STACKS = {"nxd"}
GPU_ONLY = {"tp_comm_overlap", "moe_gemm_per_expert"}  # NVIDIA userbuffers / symmetric memory; Transformer Engine
# PyTorch SDPA's flash backend (what torchtitan runs) is FlashAttention-2, which reaches ~35% of peak on Hopper
# (Shah et al. 2024, FlashAttention-3, abstract: "FlashAttention-2 achieving only 35% utilization on H100");
# Megatron/NeMo run Transformer Engine's cuDNN fused attention: on Hopper TE prefers it to FlashAttention
# (transformer_engine/pytorch/attention/dot_product_attention/utils.py get_attention_backend: "Disabling
# FlashAttention to give FusedAttention preference on Hopper+ for performance reasons"). Its measured BF16 rate
# (CUDNN_HOPPER_EFF) is below FlashAttention-3's 75% headline, which is head dim 256 without a mask. On A100
# FlashAttention-2 reaches 50-73% (Dao 2023) = its GEMMs'.
FA2_HOPPER_EFF = 0.35
# cuDNN's fused attention forward, BF16, head dim 128, causal, 16k tokens: 539 TFLOP/s on an H100 SXM5 (Shah et al.
# 2024, FlashAttention-3, Fig. 5, the cuDNN bars: 518 / 529 / 539 at 4k / 8k / 16k; 595 without the mask), of the
# 989 dense BF16 peak. Its backward (Fig. 6: 516 at 16k, no mask) is 0.87 of that forward, FLASH_BWD_EFF's ratio.
CUDNN_HOPPER_EFF = 539.0 / 989.0
# PyTorch-native stacks (torchtitan, Composer: eager or torch.compile kernels, cuBLAS GEMMs, no Transformer Engine)
# reach less of a Hopper chip than the GEMM efficiency its catalog entry assumes (0.70, Megatron/TE class): their
# GEMMs and attention are scaled by this. Calibrated: `benchmarks/planner_accuracy.py --calibrate-h100` on the
# calibration set torchtitan_h100_1node (torchtitan Table 1: Llama 3.1 8B FSDP on one Grand Teton node, eager,
# compile, Float8; 3 rows); evaluated on torchtitan's multi-node rows and MosaicML's H100 SXM FSDP rows.
PYTORCH_HOPPER_SCALE = 0.92  # grid 0.55-1.00: 1.5% on those 3 rows since their chip's peak is the 700 W part's
# throughput under the 500 W cap (h100-hbm2e-500w 847 from MLPerf's 450 W / 700 W DGX H100 runs, h100power 4 Dec
# 2026; 0.85 and 1.6% at the 912 assumed before, which put the cap's cost into this scale and so slowed every 700 W
# H100 PyTorch run); since the Hopper GEMM efficiency it scales is
# megatron_h100_1node's 0.64 (h100p2p 4 Dec 2026; refit as --calibrate-h100-megatron does); 0.81 and 1.6% at 0.70,
# since the FSDP traffic hidden behind compute
# costs the SMs NCCL holds (collectives.overlapped_exposed_s, nccl 4 Dec 2026; 0.79 and 1.5% before, since eager's
# counted elementwise bytes and torchtitan's per-op selective checkpointing are timed; 0.76 and 4.7% before that; 0.73
# and 4.4% before the flash backward's lower efficiency, plan.step.FLASH_BWD_EFF, was counted)
HOPPER_CHIPS = {"h100", "h200", "h100-hbm2e-500w", "h100-pcie"}
# The same on A100: the chip's 0.80 was calibrated on Megatron-LM 2021-22 runs (fused kernels, unfused attention);
# PyTorch-native FSDP stacks reach 0.89 of it. Calibrated: `benchmarks/planner_accuracy.py --calibrate-a100-pytorch`
# (grid 0.70-1.00) on the calibration set mosaic_a100_1node (MosaicML llm-foundry MPT 1B-30B on one 8 x A100 80GB
# node, seq 2048 and 4096, Composer FSDP; 10 rows, 4.9% since their Triton attention is timed as the FA1-class
# kernel it is, attention_kernel "fa1"; 0.84 and 6.4% before, with it at the GEMMs' rate); evaluated on
# torchtitan's 64-A100 rows, IBM fms-fsdp's 128-A100 rows and MosaicML's multi-node A100 rows (their other tables).
# 0.90 and 4.7% since the hidden FSDP traffic costs the SMs NCCL holds (nccl, 4 Dec 2026; 0.89 and 4.9% before)
PYTORCH_AMPERE_SCALE = 0.90
AMPERE_CHIPS = {"a100-80gb", "a100-40gb"}
# Stacks whose kernels are PyTorch's own (cuBLAS GEMMs through torch, SDPA's FlashAttention-2; no Transformer
# Engine): torchtitan and DeepSpeed (ZeRO on PyTorch modules, as with Hugging Face models) get the scales above
PYTORCH_NATIVE = {"fsdp2", "deepspeed"}


# Attention kernels a run can name where it overrode its stack's choice (attention_kernel_eff). "fa2": Dao's
# flash-attn 2 package, which Transformer Engine calls when its cuDNN backend is switched off (NVTE_FUSED_ATTN=0):
# NeMo-Framework-Launcher's launcher_scripts/conf/config.yaml set that for every run from 562dcb4 (2024-02-13, the
# 24.03 and 24.03.01 tags included: "Disable cudnn FA until we've tested it more") to 04b8d09 (2024-08-29, "enable
# fused attention"); TE v1.4's DotProductAttention then takes FlashAttention, CP included (attn_forward_func_with_cp
# over flash_attn's varlen forward and backward). "cudnn": TE's FusedAttention (the megatron stack's default).
# "fa1": a FlashAttention-1-class kernel, what MosaicML's llm-foundry benchmarks ran: submit_benchmarks.py's
# --attn_impl defaults to "triton" (scripts/train/benchmarking/submit_benchmarks.py at 061f2c7 and every version
# before it; sweep.sh passes none; the mpt-*.yaml set attn_impl: triton), llm-foundry's Triton port of
# FlashAttention (llmfoundry/models/layers/flash_attn_triton.py on the pre-MLIR triton of setup.py,
# triton_pre_mlir_sm90), "slightly faster than" its CUDA `flash` = flash-attn 1.0.x (TUTORIAL.md at 061f2c7).
ATTENTION_KERNELS = ("fa2", "cudnn", "fa1")
# FlashAttention-1 against FlashAttention-2 on one chip: FA2 "yields around 2x speedup compared to FlashAttention"
# (Dao 2023, FlashAttention-2, abstract, A100: FA1 "25-40% of the theoretical maximum FLOPs/s", FA2 50-73%; sec. 4.1
# 1.7-3.0x). Both versions issue the same Ampere mma instructions on Hopper (the FA2 paper's H100 runs use "no
# special instructions"), so the ratio is taken to hold there too (an assumption: no H100 FA1 rate is published)
FA1_OVER_FA2 = 0.5


def attention_kernel_eff(kernel: str, chip, stack: str | None = None) -> float | None:
    """Options.attention_eff of a named attention kernel on this chip (hardware.catalog.Chip): on Hopper FlashAttention-2
    at FA2_HOPPER_EFF (times PYTORCH_HOPPER_SCALE in a PyTorch-native stack, as its default), cuDNN's at
    CUDNN_HOPPER_EFF; FlashAttention-1 at FA1_OVER_FA2 of FA2's rate, on Hopper and on A100 (where FA2 runs at the
    GEMMs' rate, as the model times it); None elsewhere (the chip's own rate: no published per-kernel rate)."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel = {kernel!r}: allowed: {', '.join(ATTENTION_KERNELS)}")
    native = stack in PYTORCH_NATIVE
    if kernel == "fa1" and chip.name in AMPERE_CHIPS:
        return chip.efficiency.matmul_eff_max * (PYTORCH_AMPERE_SCALE if native else 1.0) * FA1_OVER_FA2
    if chip.name not in HOPPER_CHIPS:
        return None
    if kernel == "cudnn":
        return CUDNN_HOPPER_EFF
    fa2 = FA2_HOPPER_EFF * (PYTORCH_HOPPER_SCALE if native else 1.0)
    return fa2 * FA1_OVER_FA2 if kernel == "fa1" else fa2


def offload_allowed(stack: Stack | None, pp, recompute_none):
    """Where the software can keep blocks' activations in host memory (parallel.offload_layers > 0), the one rule
    `plan` searches by and `estimate` notes against: pp and recompute_none (the layout recomputes nothing) are
    scalars or arrays of one shape; stack None (no stack named, the system's unrestricted software): everywhere."""
    shape = np.broadcast(np.asarray(pp), np.asarray(recompute_none)).shape
    if stack is None:
        return np.ones(shape, bool)
    ok = np.full(shape, stack.activation_offload)
    if not stack.offload_with_pp:
        ok &= np.asarray(pp) == 1
    if not stack.offload_with_recompute:
        ok &= np.asarray(recompute_none, bool)
    return ok


def check_stack(name: str) -> str:
    if name not in STACKS:
        raise ValueError(f"stack = {name!r}: allowed: {', '.join(STACKS)}")
    return name


def stack_options(name: str, chip) -> dict:
    """Options defaults of a named stack on this chip (hardware.catalog.Chip)."""
    opts = dict(STACK_OPTIONS[check_stack(name)])
    if chip.vendor != "nvidia":
        opts.update({k: False for k in GPU_ONLY})
    if name == "nxd" and chip.name in NXD_ADJACENT_KV_CHIPS:
        opts["kv_replicas_adjacent"] = True
    if name in PYTORCH_NATIVE and chip.name in HOPPER_CHIPS:
        opts["attention_eff"] = FA2_HOPPER_EFF * PYTORCH_HOPPER_SCALE
        opts["matmul_eff"] = chip.efficiency.matmul_eff_max * PYTORCH_HOPPER_SCALE
    if name == "megatron" and chip.name in HOPPER_CHIPS:
        opts["attention_eff"] = CUDNN_HOPPER_EFF
    if name in PYTORCH_NATIVE and chip.name in AMPERE_CHIPS:
        opts["matmul_eff"] = chip.efficiency.matmul_eff_max * PYTORCH_AMPERE_SCALE
    return opts
