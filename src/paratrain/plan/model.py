"""The analytic performance model: step time, FLOPs, memory and communication of one parallel layout.

Every formula works element-wise on numpy arrays, so `search` evaluates tens of thousands of layouts in one
pass and `estimate` is the same code on arrays of length one. No torch (fast import). The formulas, their
sources and their assumptions are written up in docs/planner.md.

Conventions: T = tokens of one microbatch on one device (b * s / cp); h hidden, f ffn, kv = kv heads * head
dim, a heads, t = tp, L layers. Bytes: bf16 activations/weights (2), fp32 gradients (4, Megatron's main
grads), fp32 Adam master + m + v (12).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from paratrain.config.names import DP_KINDS, PP_SCHEDULES, RECOMPUTE  # noqa: F401 - re-exported (plan.api, tests)
from paratrain.config.schema import ParallelSection
from paratrain.hardware.catalog import System
from paratrain.model.config import ModelConfig
from paratrain.plan.stages import Loads, balanced_loads, best_loads, rank_times, same_rank

STAGE_SPLITS = ("balanced", "auto")  # the runtime's default split, or the one that minimises the slowest stage
# the trainer's names (paratrain.config.names); evaluate's integer codes index them: schedule codes >= 3 are the
# V-shaped zero-bubble schedules (zbv, dualpipev)
SCHEDULES = PP_SCHEDULES
# Attention FLOPs per token per layer per hidden unit, forward: QK^T and AV over the keys a query sees. Causal
# (what is computed with flash attention and what MFU counts here): 2 x 2 x s/2 x h; the full square (Narayanan et
# al. 2021, PaLM): 2 x 2 x s x h. Both MFUs are reported; only the causal one is bounded by the timing model.
ATTENTION_CONVENTION = "causal"
CAUSAL_ATTENTION_FLOPS = 2.0
ATTENTION = ("flash", "unfused")
CP_COMM = ("ring", "allgather", "allgather_rotate")  # how context parallelism exchanges K/V (Options.cp_comm)
MOE_FLEX_BACKENDS = ("deepep", "hybridep")  # Megatron-Core's moe_flex_dispatcher_backend values

BF16_BYTES = 2
FLASH_BWD_MATMULS = 5  # per attention block in FlashAttention-2's backward (forward: 2)
# FlashAttention's backward reaches a lower fraction of peak than its forward: "up to 73% of the theoretical max
# throughput in the forward pass, and up to 63% ... in the backward pass" (Dao 2023, FlashAttention-2, sec. 1; the
# dS = P o (dP - D) elementwise step, the recomputed P and the dQ accumulation are the extra non-matmul work). The
# only published forward/backward split; applied to every flash kernel (FA2, cuDNN/FA3, NKI) as their ratio
FLASH_BWD_EFF = 63 / 73
FP8_BYTES = 1
FP8_CAST_BYTES = 5  # per element scaled to FP8: amax read (2), cast read (2) + write (1)
FP8_CAST_KERNELS = 8  # amax + cast for the input and the weight of each of the 4 layer matmuls
FP4_BYTES = 0.5
MX_BLOCK = 32  # elements sharing one 1-byte (E8M0) scale in the OCP MX formats (MXFP8, MXFP4)
WEIGHT_BYTES = 2
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam m + v
ADAM_STEP_BYTES = 32  # per parameter per step: read p, g, m, v (fp32), write p, m, v, bf16 copy
# Pure BF16 training with stochastic rounding (Neuron's "Autocast:BF16+SR": XLA_USE_BF16=1 makes every fp32 tensor
# bf16, so the weights are their own master copy and Adam's m and v are bf16; Neuron docs: stochastic rounding
# "enables running at half precision speeds (BF16) while maintaining accuracy ... it also helps ... reduce memory
# footprint"): m + v, and per step read p, g, m, v and write p, m, v, all 2 bytes (Options.master_weights False)
BF16_OPTIMIZER_BYTES = 4
BF16_ADAM_STEP_BYTES = 14
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
    matmul_eff: fraction of peak the GEMMs reach where the software does not reach the chip's matmul_eff_max
    (PyTorch-native stacks on Hopper, see plan.stacks); None: the chip's.
    attention_eff: fraction of peak the attention kernel reaches where it is not the chip's matmul_eff_max
    (FlashAttention-2, PyTorch SDPA's flash backend, on Hopper: see plan.stacks).
    overlap_param_gather: Megatron-Core's distributed optimizer with overlap_grad_reduce and overlap_param_gather
    (NeMo / Megatron-Bridge's settings): the post-step parameter all-gather and the gradient reduce-scatter are
    dispatched as Megatron-Core does (_megatron_dp_exposed_s: bucket by bucket behind the first microbatch's
    forward, chunk by chunk under interleaving); otherwise (NxD ZeRO-1) the post-step gather is exposed.
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
    cp_kv_repeated: the attention op receives K and V already repeated to the query heads (torchtitan's Llama runs
    repeat_kv before SDPA, and torch's context_parallel wraps SDPA), so context parallelism exchanges K/V at the
    query width, not GQA's.
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
    attention_eff: float | None = None
    matmul_eff: float | None = None
    fp8_weight_cache: bool = False
    recompute_mlp: bool = False
    selective_ops: bool = False
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
    moe_probs_in_experts: bool = False
    ce_bytes_per_logit: float = 12.0
    loss_peak_bytes_per_logit: float = 6.0
    wgrad_accumulation_fusion: bool = False
    cp_comm: str = "ring"
    p2p_pair_allgather: bool = False
    tp_bwd_overlap: bool = False
    fsdp_pp_unsharded: bool = False
    fp8_tp_allgather: bool = False
    cp_kv_repeated: bool = False
    master_weights: bool = True

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
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"grad_bytes = {self.grad_bytes}: allowed: 2, 4")
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


# ---- collectives ----------------------------------------------------------------------------------------
def collective_time_s(system: System, kind: str, nbytes, degree, stride):
    """Time of a hierarchical ring collective over a group of `degree` ranks spaced `stride` apart.

    Ranks are numbered tp fastest, then cp, dp, pp, so a group with stride s has D // s members inside a
    domain of D devices. Level by level from the innermost tier: reduce-scatter inside the domain, the
    next level works on 1/n of the data, then all-gather back (the all-reduce = RS + AG of Thakur et al. 2005
    ring costs: 2(n-1)/n * bytes / bw; RS or AG alone (n-1)/n * bytes / bw). nbytes is the full buffer
    (all-reduce input, all-gather output, reduce-scatter input). Latency: min(n-1, 2 log2 n) steps per level
    (ring for small groups, tree-like for large ones, as NCCL/Neuron pick), plus the link's fixed
    collective_overhead_us per level (launch and synchronisation of one collective call). Where ranks
    time-share cores (a CPU host running more ranks than cores), each step also waits for the next rank to be
    scheduled: + (ranks per core - 1) x timeshare_step_us per step, and each rank gets 1/(ranks per core)
    of a core to copy and reduce with (bandwidth divided alike).
    """
    factor = {"allreduce": 2.0, "allgather": 1.0, "reducescatter": 1.0}[kind]
    if np.ndim(nbytes) == np.ndim(degree) == np.ndim(stride) == 0:
        try:
            return np.float64(_collective_scalar_s(system, kind, factor, float(nbytes), float(degree), float(stride)))
        except ZeroDivisionError:  # a zero bandwidth: numpy's inf below
            pass
    nbytes = np.asarray(nbytes, dtype=float)
    degree = np.asarray(degree, dtype=float)
    stride = np.asarray(stride, dtype=float)
    total = np.zeros(np.broadcast(nbytes, degree, stride).shape)
    inside_prev = np.ones_like(total)
    share = timesharing_ranks(system)
    ring_only_gathers = system.chip.vendor == "nvidia"
    for tier in system.tiers:
        if tier.domain_devices:
            inside = np.clip(np.floor(tier.domain_devices / stride), 1.0, degree)
        else:
            inside = degree * np.ones_like(total)
        n = inside / inside_prev
        data = nbytes / inside_prev
        bw = tier.per_device_bw_bytes_per_s(system) * torus_link_fraction(system, tier, inside, stride)
        # all-reduce: NCCL and Neuron pick ring (n-1 steps per phase) or tree / recursive halving-doubling
        # (log2 n) whichever is cheaper; all-gather and reduce-scatter: NCCL runs them as rings only (no tree:
        # src/graph/tuning.cc counts nsteps = nRanks - 1), Neuron also has recursive doubling-halving for them
        # (Neuron docs, "Inter-node Collectives": ring, mesh and RDH)
        steps = ring_steps(n) if kind == "allreduce" or not ring_only_gathers else n - 1.0
        link = tier.interconnect
        step_s = (link.latency_us + (share - 1) * link.timeshare_step_us) * 1e-6
        level = factor * ((n - 1) / n * data * share / bw + steps * step_s) + link.collective_overhead_us * 1e-6
        total = total + np.where(n > 1, level, 0.0)
        inside_prev = np.maximum(inside, inside_prev)
    return total


def _collective_scalar_s(system: System, kind: str, factor: float, nbytes: float, degree: float, stride: float):
    """collective_time_s for one group: the same operations in the same order on Python floats (bitwise the same
    result), without numpy's overhead on 0-d arrays (~60 us a call; a calibration fit or a layout search makes
    ~10^5 calls)."""
    total, inside_prev = 0.0, 1.0
    share = timesharing_ranks(system)
    ring_only_gathers = system.chip.vendor == "nvidia"
    for tier in system.tiers:
        inside = min(max(float(math.floor(tier.domain_devices / stride)), 1.0), degree) if tier.domain_devices \
            else degree
        n = inside / inside_prev
        data = nbytes / inside_prev
        bw = tier.per_device_bw_bytes_per_s(system) * float(torus_link_fraction(system, tier, inside, stride))
        if kind == "allreduce" or not ring_only_gathers:
            steps = min(n - 1.0, 2.0 * math.ceil(math.log2(max(n, 1.0))))  # ring_steps
        else:
            steps = n - 1.0
        link = tier.interconnect
        step_s = (link.latency_us + (share - 1) * link.timeshare_step_us) * 1e-6
        if n > 1:
            total = total + (factor * ((n - 1) / n * data * share / bw + steps * step_s)
                             + link.collective_overhead_us * 1e-6)
        inside_prev = max(inside, inside_prev)
    return total


def torus_link_fraction(system: System, tier, members, stride):
    """Share of a 2D-torus tier's links (Interconnect.torus_links_per_chip, 0: a switched fabric, all of them)
    that a ring collective over `members` ranks `stride` apart can drive. Neuron runs "multiple cycles with
    mutually exclusive wires in parallel for full wire bandwidth", and "when using all 16 Neuron Devices, there
    are 2 non-overlapping Hamiltonian cycles on 2D Torus" (Neuron docs, neuron-runtime/explore/
    intranode-collective-comm.rst): a group covering every chip of the torus uses all 4 links of a chip; a group
    on fewer chips (a row or a 2 x k block of the 4 x 4 torus, with at most 3 neighbours in the group) has one
    such cycle, 2 links; two chips share one link."""
    links = tier.interconnect.torus_links_per_chip
    if not links:
        return 1.0
    per_chip = system.devices_per_chip
    chips = np.minimum(members, np.maximum(1.0, members * np.asarray(stride, dtype=float) / per_chip))
    used = np.select([chips >= tier.domain_devices / per_chip, chips >= 3], [links, 2.0], 1.0)
    return np.minimum(used, links) / links


def ring_steps(n):
    """Latency-bound steps of one collective phase over n ranks: a ring's n - 1 for small groups, a tree's
    2 log2 n for large ones (NCCL and Neuron pick the cheaper)."""
    n = np.asarray(n, dtype=float)
    return np.minimum(n - 1.0, 2.0 * np.ceil(np.log2(np.maximum(n, 1.0))))


def timesharing_ranks(system: System) -> float:
    """Ranks that take turns on one core: more than 1 only where devices outnumber the chip's cores (a CPU host
    described by `paratrain probe`, sized for more ranks than cores); accelerator devices never time-share."""
    return max(1.0, system.devices_per_chip / system.chip.cores_per_chip)


def p2p_time_s(system: System, nbytes, stride, ranks=2):
    """Point-to-point send between ranks `stride` apart (pipeline neighbours, a CP ring's hops) in a chain or ring of
    `ranks` members: over the innermost tier whose domain holds the whole group (stride x ranks devices), at the
    per-device bandwidth of that tier (all boundary ranks send at once). Where the group spans domains, some of its
    hops cross them (pipeline stages 16 apart on 32-device nodes: every other stage boundary leaves the node), and
    a pipeline or a ring runs at the pace of its slowest hop."""
    nbytes = np.asarray(nbytes, dtype=float)
    span = np.asarray(stride, dtype=float) * np.maximum(np.asarray(ranks, dtype=float), 2.0)
    time = None
    for tier in reversed(system.tiers):
        bw = tier.per_device_bw_bytes_per_s(system)
        link = tier.interconnect
        share = timesharing_ranks(system)
        t = (nbytes * share / bw
             + (link.latency_us + (share - 1) * link.timeshare_step_us + link.collective_overhead_us) * 1e-6)
        time = t if time is None else np.where(span <= tier.domain_devices, t, time)
    return time


# ---- per-layer shapes -----------------------------------------------------------------------------------
def layer_matmuls(model: ModelConfig, seq: int, attention: str):
    """Forward matmuls of one layer as (name, N, K, shard) with M = tokens; shard "n" or "k" is the dim TP splits.

    Attention core returned separately (it scales with seq). The query and attention-output width is
    heads x head_dim, which is not the hidden size where the head dim is set apart (Qwen3, GPT-OSS)."""
    h, f, kv, q = model.hidden, model.ffn, model.kv_dim, query_dim(model)
    mlp_in = 2 * f if model.arch == "llama" else f
    return [("qkv", q + 2 * kv, h, "n"), ("proj", h, q, "k"), ("mlp_in", mlp_in, h, "n"), ("mlp_out", h, f, "k")]


def query_dim(model: ModelConfig) -> int:
    """Width of the queries and of the attention output (the output projection's input): heads x head_dim."""
    return model.heads * model.head_dim


def activation_bytes_per_token(model: ModelConfig, seq: int, attention: str, fp8: bool = False):
    """Korthikanti et al. 2022 activation memory per token per layer, split by how it shards.

    Returns (sp_part, tp_part, core_part) in bytes: sp_part is replicated across TP ranks unless sequence
    parallelism shards it; tp_part is always split by TP; core_part (softmax/dropout of attention scores) is
    split by TP and dropped by selective recompute. GPT: 10h + 24h + 5as = 34h + 5as per token, the paper's
    s*b*h*(34 + 5as/h). Llama: no dropout, RMSNorm, SwiGLU (gate, up and their product kept: 6f), GQA (K,V
    are 2kv each). fp8: the inputs of the FP8 matmuls are kept for backward in FP8, 1 byte (Transformer Engine
    saves the cast input for the weight gradient): QKV and MLP inputs (h each), the output projection's input
    (heads x head_dim) and the second MLP matmul's input (f).
    """
    h, f, kv, a, q = model.hidden, model.ffn, model.kv_dim, model.heads, query_dim(model)
    if model.arch == "gpt":
        sp_part = 4 * h + 2 * h + 2 * h + 2 * h  # 2 LayerNorm inputs, QKV input, MLP input, 2 dropout masks
        tp_part = 2 * q + 2 * kv + 2 * kv + 2 * q + 2 * f + 2 * f  # Q, K, V, proj input, fc1 out, GeLU out
        core = 5 * a * seq if attention == "unfused" else 4 * a  # softmax (2), dropout mask (1) and output (2)
    else:
        sp_part = 4 * h + 2 * h + 2 * h  # 2 RMSNorm inputs, QKV input, MLP input
        tp_part = 2 * q + 2 * kv + 2 * kv + 2 * q + 6 * f  # Q, K, V, proj input, gate, up, gate*up
        core = 2 * a * seq if attention == "unfused" else 4 * a  # softmax output, or fp32 log-sum-exp (flash)
    if fp8:  # QKV input, MLP input, projection input and second MLP input stored at 1 byte instead of 2
        sp_part, tp_part = sp_part - 2 * h, tp_part - q - f
    return float(sp_part), float(tp_part), float(core)


def _mlp_params_per_layer(model: ModelConfig) -> float:
    """Matmul parameters of one layer's MLP (SwiGLU: gate, up, down; GPT: fc1, fc2)."""
    return float((3 if model.arch == "llama" else 2) * model.hidden * model.ffn)


def mlp_activation_bytes_per_token(model: ModelConfig) -> float:
    """HBM traffic of the MLP's activation function per token (SwiGLU: read gate and up, write the product;
    bias-GeLU: read + write), the elementwise part of the MLP block."""
    return float((3 if model.arch == "llama" else 2) * model.ffn * BF16_BYTES)


def elementwise_bytes_per_token(model: ModelConfig, seq: int, attention: str):
    """HBM traffic of the memory-bound ops of one layer's forward, per token: (sp_part, tp_part, core, kernels).

    sp_part: norms and residual/dropout adds (replicated across TP ranks without SP). tp_part: activation
    function, rotary. core: the unfused attention's scale/mask/softmax/dropout over a*s scores.
    kernels: number of separate elementwise kernels (each pays the chip's kernel overhead).
    """
    h, kv, a = model.hidden, model.kv_dim, model.heads
    norms = 2 * (2 * h) * BF16_BYTES  # two norms, read + write h each
    residual = 2 * (3 * h) * BF16_BYTES  # two residual (+bias+dropout) adds: read 2h, write h
    if model.arch == "llama":
        act = mlp_activation_bytes_per_token(model)  # SwiGLU: read gate and up, write product
        # fused RoPE: read + write q and k once (unfused_rope_s times the unfused path instead)
        rope = 0 if model.rope_attention_factor != 1.0 else 2 * (query_dim(model) + kv) * BF16_BYTES
        core = 2 * a * seq * BF16_BYTES  # fused scale-mask-softmax: read + write scores
        kernels = 6
    else:
        act = mlp_activation_bytes_per_token(model)  # bias-GeLU: read + write
        rope = 0
        core = (2 + 2.5) * a * seq * BF16_BYTES  # softmax read/write + dropout read/write/mask
        kernels = 7
    if attention == "flash":
        core, kernels = 0, kernels - 1
    return float(norms + residual), float(act + rope), float(core), kernels


def eager_elementwise_bytes_per_token(model: ModelConfig, opts: Options) -> tuple[float, float]:
    """(sp_part, tp_part) HBM bytes per token of a Llama block's elementwise ops forward in eager PyTorch (the
    EAGER_* counts): norms and residual adds (replicated across TP ranks without SP), then SwiGLU, rotary and the
    GQA K/V repeat (split by TP)."""
    q, kv = query_dim(model), model.kv_dim
    repeat = EAGER_REPEAT_KV_BYTES * (q + kv) if model.n_kv_heads < model.heads else 0.0
    tp_part = EAGER_SWIGLU_BYTES * model.ffn + opts.eager_rope_bytes * (q + kv) + repeat
    return float(EAGER_NORM_RESIDUAL_BYTES * model.hidden), float(tp_part)


# RoPE as Megatron-Core runs it where the model has YaRN's attention factor (mscale != 1: "not supported by TE's
# fused RoPE. Using unfused implementation", megatron/core/models/common/embeddings/rope_utils.py, the same in the
# Megatron-LM commits Megatron-Bridge v0.2.2-v0.4.0 pin; GPT-OSS's factor 32 gives 1.35): _apply_rotary_pos_emb_bshd
# in eager PyTorch on q and on k. Per element of the tensor, bf16 (2 bytes): forward -x2 (read + write half),
# cat((-x2, x1)) (read + write), t * cos, rotated * sin (read + write each), their sum (read 2, write 1) and the
# final cat with the empty pass-through part (read + write): 12 passes, 24 bytes; 6 kernels plus 6 small ones for
# the cos/sin tables (cos, sin, * mscale, .to). Backward (autograd): grad * cos, grad * sin, the negation's and the
# chunk's gradients (a cat), the sum of the two paths and the slice's gradient (zeros + copy): 13 passes, 26 bytes,
# 8 kernels.
UNFUSED_ROPE_FWD_BYTES = 24
UNFUSED_ROPE_BWD_BYTES = 26
UNFUSED_ROPE_FWD_KERNELS = 12  # per rotated tensor (q, k)
UNFUSED_ROPE_BWD_KERNELS = 8


def unfused_rope_s(model: ModelConfig, system: System, T, tp):
    """(forward s, backward s) of one layer's RoPE on the unfused path (UNFUSED_ROPE_*): q (heads x head_dim / tp)
    and k (the rank's kv heads) of T tokens. Zero for a model without YaRN's attention factor (its RoPE is the fused
    kernel, in elementwise_bytes_per_token)."""
    if model.rope_attention_factor == 1.0:
        return 0.0, 0.0
    elements = T * (query_dim(model) / tp + model.kv_dim / np.minimum(tp, model.n_kv_heads))
    fwd = memory_time_s(system, elements * UNFUSED_ROPE_FWD_BYTES, 2 * UNFUSED_ROPE_FWD_KERNELS)
    bwd = memory_time_s(system, elements * UNFUSED_ROPE_BWD_BYTES, 2 * UNFUSED_ROPE_BWD_KERNELS)
    return fwd, bwd


ROOFLINE_SHARPNESS = 2.0


def soft_roofline(compute_s, memory_s):
    """max(compute, memory) smoothed: (c^k + m^k)^(1/k), k = 2. A kernel near the ridge point cannot overlap
    its loads and its math perfectly; far from it the result is the plain roofline."""
    k = ROOFLINE_SHARPNESS
    return (compute_s**k + memory_s**k) ** (1.0 / k)


def matmul_time_s(system: System, m, n, k, fp8: bool = False, opts: Options | None = None, extra_bytes=0.0):
    """One matmul: a soft roofline of compute (matmul_eff_max of peak) and operand traffic (memory_bw_eff of
    HBM bandwidth), plus the fixed per-kernel cost (launch, pipeline fill, tail wave; measured to fit better
    added than as a floor, see docs/planner.md) that makes small matmuls inefficient. fp8: the operands are
    low-precision (1-byte FP8, or 1/2-byte FP4 plus one scale byte per 32 with opts.fp4) and the tensor cores
    run at that format's peak (the output stays BF16). extra_bytes: HBM traffic beyond that (an output read back
    to accumulate into, plan.moe.wgrad_accumulate_s)."""
    eff = system.chip.efficiency
    flops = 2.0 * m * n * k
    in_bytes = low_precision_bytes(system, opts or Options(fp8=fp8)) if fp8 else BF16_BYTES
    traffic = in_bytes * (m * k + k * n) + BF16_BYTES * m * n + extra_bytes
    peak = low_precision_flops(system, opts or Options(fp8=True)) if fp8 else system.device_peak_flops
    mm_eff = opts.matmul_eff if opts is not None and opts.matmul_eff is not None else eff.matmul_eff_max
    compute = flops * matmul_tile_factor(system, m, n, k) / (peak * mm_eff)
    memory = traffic / (system.device_hbm_bw_bytes_per_s * eff.memory_bw_eff)
    return soft_roofline(compute, memory) + eff.kernel_overhead_s


def matmul_tile_factor(system: System, m, n, k):
    """Work a systolic matrix engine does for an m x k by k x n GEMM over what the GEMM needs: its dimensions run in
    whole tiles (chip.matmul_tile; 1 where the chip sets none). Trainium's TensorEngine contracts at most 128 partitions
    per instruction against a stationary tile of at most 128 columns while at most 512 moving columns stream through
    (NKI architecture guide, trainium_inferentia2_arch.rst; nki.isa.nc_matmul), so k rounds up to 128 and the two
    output dimensions to 128 and 512, whichever way round wastes less (the compiler picks the stationary operand).
    Backward's GEMMs are counted at the forward's factor (their contraction is one of these dimensions)."""
    tile, moving = system.chip.matmul_tile, system.chip.matmul_moving_tile
    if not tile:
        return 1.0

    def up(x, t):
        x = np.maximum(np.asarray(x, dtype=float), 1.0)
        return np.ceil(x / t) * t / x
    return up(k, tile) * np.minimum(up(n, tile) * up(m, moving), up(m, tile) * up(n, moving))


def device_fp8_flops(system: System) -> float:
    """FP8 peak of one device (the BF16 peak where the chip lists no faster FP8 rate)."""
    fp8 = system.chip.fp8_tflops
    return max(system.device_peak_flops, (fp8 or 0.0) * 1e12 / system.devices_per_chip)


def low_precision_flops(system: System, opts: Options) -> float:
    """Peak of one device for the layer matmuls' format: FP4 (falling back to FP8, then BF16, where the chip
    lists no faster rate) or FP8; the BF16 rate for per-tensor FP8 on a chip whose fast rates are MX-only."""
    if system.chip.fp8_block_scaled and not block_scaled(system, opts):
        return system.device_peak_flops  # Trainium3: only the MX formats get the faster rate (NC-v4)
    if opts.fp4 and system.chip.fp4_tflops:
        return max(device_fp8_flops(system), system.chip.fp4_tflops * 1e12 / system.devices_per_chip)
    return device_fp8_flops(system)


def block_scaled(system: System, opts: Options) -> bool:
    """Whether the low-precision formats carry a scale per MX_BLOCK elements (FP4 always does)."""
    if opts.fp4:
        return True
    return system.chip.fp8_block_scaled if opts.block_scaling is None else opts.block_scaling


def low_precision_bytes(system: System, opts: Options) -> float:
    """Bytes per element of a low-precision matmul operand, its block scale included."""
    element = FP4_BYTES if opts.fp4 else FP8_BYTES
    return element + (1.0 / MX_BLOCK if block_scaled(system, opts) else 0.0)


def cast_cost(system: System, opts: Options) -> tuple[float, int]:
    """(HBM bytes per element, kernels per layer) of scaling and casting the layer matmuls' operands. Per-tensor
    current scaling reads the tensor once for its amax and once to cast (2 + 2 + 1 bytes, two kernels per
    operand); block scaling finds each block's scale while casting (2 bytes read, the element and its share of
    the scale written, one kernel per operand)."""
    if block_scaled(system, opts):
        return BF16_BYTES + low_precision_bytes(system, opts), FP8_CAST_KERNELS // 2
    return float(FP8_CAST_BYTES), FP8_CAST_KERNELS


def memory_time_s(system: System, nbytes, kernels):
    eff = system.chip.efficiency
    return nbytes / (system.device_hbm_bw_bytes_per_s * eff.memory_bw_eff) + kernels * eff.kernel_overhead_s


# ---- the whole step -------------------------------------------------------------------------------------
def _per_layer_compute(model, system, seq, opts, T, tp, sp, cp, zero=0):
    """Forward compute time of one layer on one device, split into matmuls, attention core and elementwise."""
    matmuls, cast_bytes, mlp, column = 0.0, 0.0, 0.0, []
    split_fwd = split_bwd = 0.0  # what splitting the GEMMs for TP overlap adds (tp_overlap_split_s)
    sac = sum(matmul_time_s(system, T, n, k, opts.fp8, opts) for n, k in _op_sac_recomputed(model, tp)) \
        if opts.selective_ops else 0.0
    for name, n, k, shard in layer_matmuls(model, seq, opts.attention):
        n_dev, k_dev = (n / tp, k) if shard == "n" else (n, k / tp)
        if name == "qkv":  # GQA with tp > kv heads: each rank computes (a replica of) one K and one V head
            n_dev = query_dim(model) / tp + 2 * model.kv_dim / np.minimum(tp, model.n_kv_heads)
        one = matmul_time_s(system, T, n_dev, k_dev, opts.fp8, opts)
        matmuls = matmuls + one
        if opts.tp_comm_overlap:
            fwd_extra, bwd_extra = tp_overlap_split_s(system, opts, name, shard, one, T, n_dev, k_dev, tp)
            split_fwd, split_bwd = split_fwd + fwd_extra, split_bwd + bwd_extra
        mlp = mlp + (one if name.startswith("mlp") else 0.0)
        if shard == "n":  # column-parallel (QKV, MLP in): under SP an all-gather feeds each
            column.append(one)
        # FP8 (Transformer Engine / torchao current scaling): each matmul's input is scaled (an amax read) and
        # cast (read bf16, write fp8) before the GEMM: 2 + 2 + 1 bytes per element, memory-bound. The weight too,
        # at every call (torchao float8), unless the stack caches the cast weight across microbatches
        # (Options.fp8_weight_cache: then once per step, in evaluate)
        weight = np.where(opts.fp8_weight_cache & (zero < 3), 0.0, n_dev * k_dev)  # ZeRO-3 re-gathers: no cache
        cast_bytes = cast_bytes + (cast_cost(system, opts)[0] * (T * k_dev + weight) if opts.fp8 else 0.0)
    heads = model.heads / tp
    s_local = seq / cp
    d = model.head_dim
    b_seqs = T / s_local  # microbatch sequences on this device
    # Attention core per head as two batched matmuls (QK^T and AV) over the visible keys.
    keys = seq if opts.attention == "unfused" else seq / 2.0  # flash skips the masked half (causal)
    core_flops = 2 * 2.0 * b_seqs * heads * s_local * keys * d
    eff = system.chip.efficiency
    core_traffic = BF16_BYTES * b_seqs * heads * (4 * s_local * d)
    if opts.attention == "unfused":
        core_traffic = core_traffic + 2 * BF16_BYTES * b_seqs * heads * s_local * keys  # scores written, read
    attn_eff = opts.attention_eff if opts.attention_eff is not None else (
        opts.matmul_eff if opts.matmul_eff is not None else eff.matmul_eff_max)
    core = soft_roofline(core_flops / (system.device_peak_flops * attn_eff),
                         core_traffic / (system.device_hbm_bw_bytes_per_s * eff.memory_bw_eff)) + 2 * eff.kernel_overhead_s
    sp_b, tp_b, core_b, kernels = elementwise_bytes_per_token(model, seq, opts.attention)
    if opts.eager:
        kernels = EAGER_ELEMENTWISE_KERNELS
        matmuls = matmuls + EAGER_EXTRA_MATMULS * system.chip.efficiency.kernel_overhead_s
        if model.arch == "llama":  # the counted bytes (EAGER_*); GPT blocks keep the fused count (not counted)
            sp_b, tp_b = eager_elementwise_bytes_per_token(model, opts)
    sp_scale = np.where(sp, 1.0 / tp, 1.0)
    elem_bytes = T * (sp_b * sp_scale + tp_b / tp + core_b * (seq / cp / seq) / tp) + cast_bytes
    elementwise = memory_time_s(system, elem_bytes, kernels + (cast_cost(system, opts)[1] if opts.fp8 else 0))
    # the MLP block alone (replayed by Options.recompute_mlp): its matmuls and its activation function
    mlp = mlp + memory_time_s(system, T * mlp_activation_bytes_per_token(model) / tp, 1)
    overlapped = (tp > 1) & sp
    return (matmuls, core, elementwise, mlp, column, sac, np.where(overlapped, split_fwd, 0.0),
            np.where(overlapped, split_bwd, 0.0))


# Transformer Engine's userbuffer TP overlap as NeMo / Megatron-Bridge configure it (tp_overlap_configs/userbuffers.py,
# every H100/B200 TransformerLayerTPOverlapCfg): the GEMMs fed by an all-gather (qkv_fprop, fc1_fprop and the
# row-parallel linears' proj_dgrad, fc2_dgrad) run as RingExchangeOverlapCfg, one GEMM per arriving chunk of T/tp
# rows; the forward GEMMs that feed a reduce-scatter (proj_fprop, fc2_fprop) as PipelineOverlapCfg, num_splits 4, with
# set_sm_margin: the GEMM runs on the SMs the reduce-scatter kernels leave (num_sm 24 for proj, 16 for fc2 in the
# configs with hidden 8192 and below, 8 at 16384); the column-parallel dgrads and every wgrad run bulk overlaps (the
# whole GEMM, 2-4 SMs for the collective: not counted). torch's async TP (fused_all_gather_matmul /
# fused_matmul_reduce_scatter) splits likewise into tp chunks, on copy engines (no SMs taken: Options.tp_overlap_sms
# empty)
TE_PIPELINE_SPLITS = 4
TE_OVERLAP_SMS = (("proj", 24), ("mlp_out", 16))


def tp_overlap_split_s(system: System, opts: Options, name, shard, whole, T, n_dev, k_dev, tp):
    """(forward s, backward s) one layer matmul gains from being split for TP communication overlap
    (Options.tp_comm_overlap with SP; TE_*): an all-gather-fed GEMM runs as tp GEMMs of T/tp rows (its weight read
    each time, its fixed cost paid each time), a reduce-scatter-fed one as TE_PIPELINE_SPLITS GEMMs on the SMs the
    collective leaves (Options.tp_overlap_sms). Forward: column-parallel ring exchange, row-parallel pipeline;
    backward: the row-parallel dgrad is a ring exchange (its shape taken as the forward's)."""
    def split(parts, sms_taken=0.0):
        sms = system.chip.cores_per_chip
        slow = sms / max(sms - sms_taken, 1.0)
        return parts * matmul_time_s(system, T / parts, n_dev, k_dev, opts.fp8, opts) * slow - whole
    ring = split(np.maximum(tp, 1.0))
    if shard == "n":
        return ring, 0.0
    if not opts.tp_overlap_sms:  # torch's fused_matmul_reduce_scatter: tp chunks too
        return ring, ring
    return split(TE_PIPELINE_SPLITS, dict(opts.tp_overlap_sms).get(name, 0.0)), ring


# torch's context_parallel (torch.distributed.tensor.experimental._attention, the allgather-rotate ring torchtitan runs)
# merges each ring step's SDPA output into an fp32 accumulator in eager ops (_SDPAMerger with convert_to_f32, the
# default): per step, bytes per element of the rank's attention output (query width), forward: the block output to
# fp32 (read 2, write 4), out - block_out (12), x sigmoid(lse difference) (8), out - that (12): 38 on a full step, 31
# on a round-robin partial one (half the work plus _partial_update's clone of the whole accumulator), about 34.5,
# plus the torch.cat of K and V for the next step (8, K and V at the query width: torchtitan repeats them before
# SDPA); once: the first block's conversion and the result's cast back (6 + 6). Backward
# (_templated_ring_attention_backward), per step: dQ += the block's bf16 dQ in fp32 (10), dK and dV likewise (20),
# the fp32 torch.cat of dK/dV for the rotation (16), the K/V cat (8), about 2 more for the partial updates' clones;
# once: the fp32 zeros for dQ, dK, dV (12) and their casts back to bf16 (18)
CP_MERGE_FWD_STEP_BYTES = 42.5
CP_MERGE_FWD_ONCE_BYTES = 12
CP_MERGE_BWD_STEP_BYTES = 56
CP_MERGE_BWD_ONCE_BYTES = 30
CP_MERGE_FWD_KERNELS = 6  # per step: cast, sub, sigmoid, mul, sub, cat (logsigmoid on the lse: small)
CP_MERGE_BWD_KERNELS = 5  # per step: three accumulations, two cats


def cp_merge_s(model: ModelConfig, system: System, opts: Options, T, tp, cp):
    """(forward s, backward s) of one layer's ring-attention merge traffic under torch's context_parallel
    (Options.cp_comm "allgather_rotate"; CP_MERGE_*): memory-bound eager ops over the rank's attention output
    (T tokens x query width / tp), cp - 1 merges forward, cp accumulations backward. Zero for the other CP
    implementations (Megatron-Core / Transformer Engine fuse their corrections; Llama 3's all-gather runs one
    attention call over the gathered K/V) and without CP."""
    if opts.cp_comm != "allgather_rotate":
        return 0.0, 0.0
    elements = T * query_dim(model) / tp
    steps = np.maximum(cp - 1.0, 0.0)
    fwd = memory_time_s(system, elements * (CP_MERGE_FWD_ONCE_BYTES + steps * CP_MERGE_FWD_STEP_BYTES),
                        steps * CP_MERGE_FWD_KERNELS + 2)
    bwd = memory_time_s(system, elements * (CP_MERGE_BWD_ONCE_BYTES + cp * CP_MERGE_BWD_STEP_BYTES),
                        cp * CP_MERGE_BWD_KERNELS + 6)
    return np.where(cp > 1, fwd, 0.0), np.where(cp > 1, bwd, 0.0)


def _op_sac_recomputed(model: ModelConfig, tp):
    """(N, K) per device of the matmuls torchtitan's per-op selective checkpointing recomputes (Options.selective_ops),
    every second one of the block: Llama's wq, wk, wv, wo, w1, w3, w2 -> wk (column-parallel, the rank's kv heads),
    wo (row-parallel), w3 (column-parallel); a GPT block's fused qkv, out, fc1, fc2 -> out and fc2."""
    wo = (model.hidden, query_dim(model) / tp)
    if model.arch != "llama":
        return [wo, (model.hidden, model.ffn / tp)]
    return [(model.kv_dim / np.minimum(tp, model.n_kv_heads), model.hidden), wo, (model.ffn / tp, model.hidden)]


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


def evaluate(model: ModelConfig, system: System, seq: int, global_batch: int, *, nodes, tp, pp, dp, cp,
             microbatch, sp, recompute, pp_schedule, virtual_stages, zero_stage, dp_kind, opts: Options,
             split: str = "balanced", stage_loads: Loads | None = None, ep=1, etp=1, dp_replicate=None) -> dict:
    """Evaluate layouts (numpy arrays of equal length, or scalars). Integer codes index RECOMPUTE, SCHEDULES
    and DP_KINDS. Returns a dict of arrays (times in s, bytes, FLOPs); no validity filtering here.

    Pipeline stage sizes (plan/stages.py): split "balanced" is the runtime's default (equal layer counts),
    "auto" the split that minimises the slowest rank's time (kept balanced where the faster split would not
    fit in memory and the balanced one does); stage_loads (layers per rank of an explicit split) overrides
    both. The loads used come back as stage_layers_{first,last,inner} and stage_balanced. ep, etp: expert
    parallelism of a MoE model (plan/moe.py: the dense formulas time its dense view, the routed experts add on).
    virtual_stages: model chunks per pipeline rank (2 under the V schedules). dp_replicate (HSDP): replica groups,
    None = one per node."""
    from paratrain.plan import moe as moe_plan

    if split not in STAGE_SPLITS:
        raise ValueError(f"split = {split!r}: allowed: {', '.join(STAGE_SPLITS)}")
    f64 = lambda x: np.asarray(x, dtype=float)  # noqa: E731
    nodes, tp, pp, dp, cp, b, v, ep, etp = map(f64, (nodes, tp, pp, dp, cp, microbatch, virtual_stages, ep, etp))
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

    # -- compute per layer, forward; backward = 2x matmuls and attention, 2x elementwise traffic --
    mm, core, elem, mlp_fwd, column_mm, sac_mm, split_fwd, split_bwd = _per_layer_compute(
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
    selective = core + (mlp_fwd if opts.recompute_mlp else 0.0)
    if opts.selective_ops:  # torchtitan's per-op SAC: three matmuls and every elementwise op, not the attention core
        selective = sac_mm + elem + quantize + bias_fwd + rope_fwd
    recompute_fwd = np.where(rc == 2, fwd_compute, np.where(rc == 1, selective, 0.0))
    if opts.recompute_norm_act:  # Megatron-Core's recompute_modules "layernorm", "moe_act" (plan.moe)
        norm_act = moe_plan.norm_act_replay_s(flops_model, system, T, tp, sp, etp, moe[5] if moe is not None else 0.0)
        recompute_fwd = recompute_fwd + np.where(rc == 2, 0.0, norm_act)
    # FlashAttention's backward recomputes the scores and probabilities and runs 5 matmuls to the forward's 2
    # (Dao 2023, FlashAttention-2 sec. 3.2), at a lower fraction of peak than its forward (FLASH_BWD_EFF);
    # unfused attention keeps P and runs 4 (dP, dV, dQ, dK) as plain batched GEMMs
    core_bwd = FLASH_BWD_MATMULS / 2.0 / FLASH_BWD_EFF if opts.attention == "flash" else 2.0
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
    replay = np.where(rc == 2, 2.0, np.where((rc == 1) & (opts.recompute_mlp | (opts.selective_ops & sp)), 1.5, 1.0))
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
        tp_bwd = np.where((tp > 1) & sp, hidden(comm, 2 * mm) * replay, tp_bwd)
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
    cp_fwd, cp_bwd = _context_parallel_s(system, model, opts, T, tp, cp, core, core_bwd * (core - merge_fwd) + merge_bwd)

    layer_fwd = fwd_compute + tp_fwd + cp_fwd + a2a_fwd
    layer_bwd = bwd_compute + tp_bwd + cp_bwd + a2a_bwd

    # -- first/last stage extras: embedding lookup, output projection (logits) and cross-entropy --
    logits_mm = matmul_time_s(system, T, V / tp, h, opts=opts)
    ce_bytes = T * (V / tp) * opts.ce_bytes_per_logit  # the loss's traffic over the logits, both directions
    head_fwd = logits_mm + memory_time_s(system, ce_bytes / 2, 2) + tp_head_fwd
    head_bwd = 2 * logits_mm + memory_time_s(system, ce_bytes / 2, 2) + tp_head_bwd
    embed = memory_time_s(system, 2 * T * h * BF16_BYTES, 1) + tp_embed

    # -- pipeline: p2p activations between stages (Megatron scatter/gather: 1/t of them per rank) --
    stride_pp = tp * cp * dp
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
    # the same sequences. Ranks are numbered tp fastest, then cp, so that group starts at stride tp.
    dp_group = dp * cp
    per_node = np.maximum(1.0, np.minimum(dp_group, system.devices_per_node / tp))
    hsdp_shard = per_node if dp_replicate is None else dp_group / np.asarray(dp_replicate, float)
    dp_shard = np.where(kind == 2, hsdp_shard, dp_group)

    moe_mem = moe_plan.memory_terms(flops_model, opts, T=T, tp=tp, cp=cp, dp=dp, ep=ep, etp=etp, zero=zero, rc=rc,
                                    routed=moe[5], sp=sp) if moe is not None else None

    def memory_of(loads):
        return memory_per_device(model, system, seq, opts, T=T, tp=tp, pp=pp, dp=dp, cp=cp, sp=sp, rc=rc,
                                 sched=sched, v=v, m=m, zero=zero, dp_shard=dp_shard, loads=loads, moe=moe_mem,
                                 ep=ep, etp=etp)

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
    stage_mb = stage_fwd + stage_bwd + p2p_per_mb  # the slowest stage per microbatch

    # zero-bubble split of backward: W (weight gradients) = half of the backward matmuls
    stage_w = layers_per_stage * mm
    bubble = pipeline_bubble_s(sched, pp, v, m, stage_fwd, stage_bwd - stage_w, stage_w)
    pipeline = m * stage_mb + bubble

    # -- data parallel: gradient reduce (and parameter gather for ZeRO-1/2/3) --
    params_rank, layers_rank = _largest_rank(model, loads, pp, v_shape)
    params_dev = params_rank / tp
    # Link sharing: data-parallel traffic hidden behind compute still needs its links free. Across nodes the
    # node's NICs also carry the pipeline's sends when the stages are on different nodes; inside a node (the
    # whole DP group within one NVLink/NeuronLink domain) the links also carry the TP collectives. That
    # busy time is taken out of the window the DP traffic can hide in.
    node = system.devices_per_node
    dp_out = tp * dp_group > node  # the DP group spans nodes
    pp_out = (pp > 1) & (stride_pp >= node)
    tp_busy = m * (layers_per_stage * (tp_fwd + tp_bwd) + head_on * (tp_head_fwd + tp_head_bwd) + embed_on * tp_embed)
    link_busy = np.where(dp_out, np.where(pp_out, m * p2p_per_mb, 0.0), np.where(tp > 1, tp_busy, 0.0))
    dp_time, dp_exposed = _data_parallel_s(system, opts, params_dev, dp_group, dp_shard, tp, zero, kind, m,
                                           stage_fwd, stage_bwd, layers_rank,
                                           layers_rank * model.params_per_layer() / tp / params_dev, link_busy,
                                           pp=pp, chunks=np.where(sched == 2, v, 1.0))
    expert_opt = 0.0
    if moe is not None:  # routed experts reduce over their own expert-data-parallel group
        ex_time, ex_exposed, ex_params, ex_shard = moe_plan.expert_data_parallel_s(
            flops_model, system, opts, tp=tp, cp=cp, dp=dp, ep=ep, etp=etp, zero=zero, kind=kind, m=m,
            stage_fwd=stage_fwd, stage_bwd=stage_bwd, layers=layers_rank, link_busy=link_busy + dp_time, pp=pp,
            chunks=np.where(sched == 2, v, 1.0))
        dp_time, dp_exposed = dp_time + ex_time, dp_exposed + ex_exposed
        expert_opt = memory_time_s(system, np.where(zero >= 1, ex_params / ex_shard, ex_params) * ADAM_STEP_BYTES, 0)

    # -- optimizer step: memory-bound Adam over this device's share of the parameters --
    opt_share = np.where(zero >= 1, params_dev / dp_shard, params_dev)
    step_bytes = ADAM_STEP_BYTES if opts.master_weights else BF16_ADAM_STEP_BYTES
    optimizer = memory_time_s(system, opt_share * step_bytes, 4) + expert_opt

    # FP8 with a weight cache: each step casts the device's layer weights once (amax, cast) and keeps a transposed
    # copy for backward
    cast_bytes, cast_kernels = cast_cost(system, opts)
    weight_cast = memory_time_s(system, layers_rank * model.params_per_layer() / tp
                                * (cast_bytes + low_precision_bytes(system, opts)), 2 * cast_kernels)
    fp8_cast = np.where(opts.fp8 & opts.fp8_weight_cache & (zero < 3), weight_cast, 0.0)
    step = pipeline + dp_exposed + optimizer + fp8_cast

    # -- FLOPs: one attention convention, causal, for counting and for timing (flash attention skips the masked
    # half; the other convention, the full s x s square of Narayanan et al. 2021 / PaLM, is reported beside it) --
    tokens = global_batch * seq
    flops = {}
    for name, attn_per_token in (("causal", CAUSAL_ATTENTION_FLOPS), ("full", 4.0)):
        attn_fwd = attn_per_token * L * seq * h  # forward attention FLOPs per token
        fwd = 2.0 * flops_model.num_matmul_params() + attn_fwd
        mlp_flops = 2.0 * L * _mlp_params_per_layer(model) if opts.recompute_mlp else 0.0
        if opts.recompute_mlp and flops_model.num_experts:  # the active routed experts are recomputed too
            mlp_flops += 2.0 * flops_model.moe_layers * flops_model.experts_per_token * 3 * h * flops_model.moe_ffn
        selective_flops = attn_fwd + mlp_flops
        if opts.selective_ops:  # the recomputed matmuls (N x K per device times tp: the whole layer's)
            selective_flops = 2.0 * L * sum(n * k for n, k in _op_sac_recomputed(model, 1))
        recompute = np.where(rc == 2, fwd - 2.0 * V * h, np.where(rc == 1, selective_flops, 0.0)) * tokens
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
        "time_ep_comm_s": m * layers_per_stage * (a2a_fwd + a2a_bwd) * ones,
        "time_pp_comm_s": m * p2p_per_mb,
        "time_head_s": m * head_on * (head_fwd + head_bwd - tp_head_fwd - tp_head_bwd),
        "time_bubble_s": bubble, "time_dp_comm_s": dp_time, "time_dp_exposed_s": dp_exposed,
        "time_optimizer_s": optimizer, "time_fp8_cast_s": fp8_cast * np.ones_like(step), "bubble_fraction": bubble / step,
        # buffer bytes handed to collectives per device per step, by kind (for the simulator/cost model)
        "comm_tp_bytes": np.where(tp > 1, m * layers_per_stage * act_bytes * np.where(rc == 2, 6.0, 4.0)
                                  * ((1.0 + FP8_BYTES / BF16_BYTES) / 2 if opts.fp8 and opts.fp8_tp_allgather else 1.0), 0.0),
        "comm_pp_bytes": np.where(pp > 1, m * 2 * chunks * p2p_bytes, 0.0),
        "comm_ep_bytes": m * layers_per_stage * (moe[4] if moe is not None else 0.0) * ones,
        "comm_dp_bytes": np.where(dp * cp > 1, params_dev * (opts.grad_bytes + opts.param_bytes * np.where(
            kind >= 1, np.where((pp > 1) & opts.fsdp_pp_unsharded, 1.0, np.where(zero == 2, m, 2 * m)),
            np.where(zero >= 1, 1.0, 0.0))), 0.0),
        "cost_usd_per_hour": cost_per_hour,
        "stage_layers_first": loads.first * ones, "stage_layers_last": loads.last * ones,
        "stage_layers_inner": loads.inner * ones, "stage_balanced": loads.balanced & (ones > 0),
        **memory,
    }


def _calls_s(system, kind, total_bytes, calls, degree, stride):
    """`calls` collectives of equal size sharing `total_bytes`: the volume is paid once, the latency and
    per-call overhead `calls` times (what makes many small collectives slower than one large one)."""
    return calls * collective_time_s(system, kind, total_bytes / np.maximum(calls, 1), degree, stride)  # 0 calls: 0


def _context_parallel_s(system, model, opts, T, tp, cp, core_fwd, core_bwd):
    """(forward, backward) exposed time of one layer's context-parallel K/V exchange (Options.cp_comm).

    ring (Megatron-Core cp_comm_type p2p, ring attention): the K/V of the local tokens pass (cp - 1) times
    between neighbours while the attention blocks compute; backward passes K/V and dK/dV. allgather (Dubey et al.
    2024, Llama 3 sec. 3.3.2: "we first all-gather the key (K) and value (V) tensors, and then compute attention
    output for the local query (Q) tensor chunk"; "the all-gather communication latency is exposed in the critical
    path"): one all-gather of K/V before the attention forward, the reduce-scatter of dK/dV after its backward,
    both exposed. allgather_rotate (torch.distributed.tensor context_parallel with rotate method "allgather",
    torchtitan's default context_parallel_rotate_method: "all-gather all kv shards on ranks after the first
    sub-SDPA computation"): the gather hides only behind the local block's attention (1/cp of it); backward
    gathers K/V again the same way and rotates dK/dV around a ring in fp32 (its dkv_rotater is always
    ALL_TO_ALL, convert_to_f32), hidden behind the other blocks' backward."""
    kv_width = query_dim(model) / tp if opts.cp_kv_repeated else model.kv_dim / np.minimum(tp, model.n_kv_heads)
    kv_local = 2 * T * kv_width * BF16_BYTES  # K and V of the local tokens, as they reach the attention op
    if opts.cp_comm == "ring":
        ring = (cp - 1) * p2p_time_s(system, kv_local, tp, cp)
        fwd, bwd = np.maximum(0.0, ring - core_fwd), np.maximum(0.0, 2 * ring - 2 * core_fwd)
    else:
        gather = collective_time_s(system, "allgather", cp * kv_local, cp, tp)
        if opts.cp_comm == "allgather":
            fwd = gather
            bwd = collective_time_s(system, "reducescatter", cp * kv_local, cp, tp)
        else:
            dkv_ring = (cp - 1) * p2p_time_s(system, 2 * kv_local, tp, cp)  # fp32: twice the bf16 K/V bytes
            fwd = np.maximum(0.0, gather - core_fwd / cp)
            bwd = np.maximum(0.0, gather - core_bwd / cp) + np.maximum(0.0, dkv_ring - core_bwd * (cp - 1) / cp)
    return np.where(cp > 1, fwd, 0.0), np.where(cp > 1, bwd, 0.0)


def default_bucket_bytes(opts, dp):
    """Bytes of one gradient bucket (one collective call): opts.bucket_bytes, or where the run leaves it unset
    Megatron-Core's default, max(40M, 1M x dp) parameters of the data-parallel group dp
    (DistributedDataParallel.__init__: `max(40000000, 1000000 * dp_group.size())`)."""
    return (np.maximum(40e6, 1e6 * dp) * opts.grad_bytes) if opts.bucket_bytes is None else opts.bucket_bytes


def _data_parallel_s(system, opts, params_dev, dp, dp_shard, stride_dp, zero, kind, m, stage_fwd, stage_bwd,
                     stage_layers_dev, block_share, link_busy=0.0, pp=1.0, chunks=1.0, bucket_dp=None):
    """(all DP communication time, the part not hidden behind compute) per step.

    DDP all-reduces gradients in buckets (default_bucket_bytes; bucket_dp: the group whose size sets the default
    bucket where it is not dp, Megatron-Core's dense group for the expert buffers) once per step;
    ZeRO-1/2 reduce-scatter the same buckets and all-gather the updated parameters after the optimizer
    step; FSDP (one unit per block plus the root, as torchtitan and paratrain wrap it) gathers every
    unit for the forward of every microbatch and every block again for its backward, and reduce-scatters each
    unit once per step (gradient sync only on the last microbatch); HSDP does that inside a node (dp_shard
    ranks) and all-reduces each unit's shard across nodes. The gradient reduce can only hide behind the last
    microbatch's backward (earlier microbatches only accumulate); FSDP/HSDP prefetch their gathers behind
    every microbatch, but all DP traffic together cannot hide behind more than the step's compute; the
    post-step gather of ZeRO-1/2 has nothing to hide behind. FSDP under a pipeline with
    opts.fsdp_pp_unsharded (torchtitan): one gather per unit per step, prefetched behind the first microbatch's
    forward, and the reduce-scatters after the last backward, exposed.
    """
    grad_bytes = params_dev * opts.grad_bytes
    param_bytes = params_dev * opts.param_bytes
    bucket = default_bucket_bytes(opts, dp if bucket_dp is None else bucket_dp)
    buckets = np.maximum(1.0, np.ceil(grad_bytes / bucket))
    units = stage_layers_dev + 1.0  # block_share: the blocks' part of the parameters (backward re-gathers them)
    reduce_ar = _calls_s(system, "allreduce", grad_bytes, buckets, dp, stride_dp)
    reduce_rs = _calls_s(system, "reducescatter", grad_bytes, buckets, dp, stride_dp)
    post_gather = _calls_s(system, "allgather", param_bytes, buckets, dp, stride_dp)
    unit_rs = _calls_s(system, "reducescatter", grad_bytes, units, dp, stride_dp)
    shard_rs = _calls_s(system, "reducescatter", grad_bytes, units, dp_shard, stride_dp)
    # per microbatch: every unit gathered for forward, the blocks again for backward
    unit_ag = (_calls_s(system, "allgather", param_bytes, units, dp, stride_dp)
               + _calls_s(system, "allgather", param_bytes * block_share, stage_layers_dev, dp, stride_dp))
    shard_ag = (_calls_s(system, "allgather", param_bytes, units, dp_shard, stride_dp)
                + _calls_s(system, "allgather", param_bytes * block_share, stage_layers_dev, dp_shard, stride_dp))
    repl_ar = _calls_s(system, "allreduce", grad_bytes / dp_shard, units, dp / dp_shard, stride_dp * dp_shard)
    zero12 = (zero >= 1) & (zero <= 2)
    # FSDP without resharding after forward (fsdp/hsdp with zero_stage 2, FSDP1's SHARD_GRAD_OP), and paratrain's
    # ZeRO-1/2, which run as that: each unit gathered once per microbatch, reduce-scattered once per step
    as_fsdp = ((kind >= 1) & (zero == 2)) | (zero12 & opts.zero12_as_fsdp)
    fwd_ag = _calls_s(system, "allgather", param_bytes, units, dp, stride_dp)
    gathers = np.select([as_fsdp, kind == 1, kind == 2], [m * fwd_ag, m * unit_ag, m * shard_ag], 0.0)
    reduces = np.select([zero == 0, as_fsdp, zero <= 2, kind == 1, kind == 2],
                        [reduce_ar, unit_rs, reduce_rs, unit_rs, shard_rs + repl_ar])
    post_step = np.where(zero12 & ~as_fsdp, post_gather, 0.0)  # DeepSpeed/Megatron: gather after the step
    overlap = system.efficiency.dp_overlap if opts.dp_overlap is None else opts.dp_overlap
    window_all = np.maximum(0.0, overlap * m * (stage_fwd + stage_bwd) - link_busy)
    window_last = np.maximum(0.0, overlap * stage_bwd - link_busy / np.maximum(m, 1.0))
    exposed = np.maximum(np.maximum(gathers + reduces - window_all, reduces - window_last), 0.0) + post_step
    if opts.overlap_param_gather:  # Megatron-Core's distributed optimizer: its own dispatch order, below
        usable = np.maximum(0.0, overlap - link_busy / np.maximum(m * (stage_fwd + stage_bwd), 1e-30))
        megatron = _megatron_dp_exposed_s(post_step, reduces, buckets, pp, chunks, stage_fwd, stage_bwd, usable)
        exposed = np.where(zero12 & ~as_fsdp, np.maximum(megatron, gathers + reduces + post_step - window_all),
                           exposed)
    # FSDP/HSDP layer by layer: with prefetch (FSDP2 and DeepSpeed ZeRO-3 gather layer i+1 while layer i
    # computes) a gather hides only behind one layer's compute, so when a layer's compute is short (small
    # microbatch per device, many ranks) the rest is exposed, layer after layer; the first gather of every
    # microbatch's forward has nothing before it. Backward: each layer's re-gather and (on the last
    # microbatch) its gradient reduce-scatter behind that layer's backward; the last reduce-scatter after it.
    layers = np.maximum(stage_layers_dev, 1.0)
    c_f, c_b = overlap * stage_fwd / layers, overlap * stage_bwd / layers
    group = np.where(kind == 2, dp_shard, dp)
    ag1 = collective_time_s(system, "allgather", param_bytes * block_share / layers, group, stride_dp)
    rs1 = collective_time_s(system, "reducescatter", grad_bytes * block_share / layers, group, stride_dp)
    fwd = ag1 + (layers - 1) * np.maximum(0.0, ag1 - c_f)
    kept = as_fsdp & (kind >= 1)  # parameters still gathered from the forward: no backward re-gather
    bwd = np.where(kept, 0.0, layers * np.maximum(0.0, ag1 - c_b))
    # HSDP: each unit's shard is all-reduced across the replicas right after its reduce-scatter, on the same
    # stream (FSDP1 _post_backward_hook -> _all_reduce_grads; FSDP2 foreach_reduce's all_reduce after the
    # reduce-scatter), so it hides behind the backward of the layers before it, as the reduce-scatter does; the
    # last unit's and the root's (embedding, head) are left after the backward
    replicas = dp / np.maximum(dp_shard, 1.0)
    ar1 = np.where(kind == 2, collective_time_s(system, "allreduce", grad_bytes * block_share / layers / dp_shard,
                                                replicas, stride_dp * dp_shard), 0.0)
    root_ar = np.where(kind == 2, collective_time_s(system, "allreduce", grad_bytes * (1 - block_share) / dp_shard,
                                                    replicas, stride_dp * dp_shard), 0.0)
    bwd_sync = layers * np.maximum(0.0, np.where(kept, 0.0, ag1) + rs1 + ar1 - c_b) + rs1 + ar1 + root_ar
    per_layer = m * fwd + (m - 1) * bwd + bwd_sync
    exposed = np.where(kind >= 1, np.maximum(exposed, per_layer), exposed)
    # torchtitan's FSDP under torch.distributed.pipelining (Options.fsdp_pp_unsharded): gathered once in the first
    # microbatch's forward (prefetched layer by layer), kept; every unit's reduce-scatter issued together by
    # backward_maybe_with_nosync's run_post_backward after the stage's last backward, with nothing left to hide behind
    pinned = (kind >= 1) & (np.asarray(pp) > 1) & opts.fsdp_pp_unsharded
    gathers = np.where(pinned, fwd_ag, gathers)
    reduces = np.where(pinned, np.where(kind == 2, shard_rs + repl_ar, unit_rs), reduces)
    exposed = np.where(pinned, np.maximum(0.0, np.minimum(fwd, fwd_ag)) + reduces, exposed)
    total = gathers + reduces + post_step
    return np.where(dp > 1, total, 0.0), np.where(dp > 1, exposed, 0.0)


def _megatron_dp_exposed_s(gather, reduce, buckets, pp, chunks, fwd, bwd, usable):
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
    (backward_step_helper_postprocess) behind pp chunk backwards, chunk 0's after the last one, exposed."""
    pp = np.asarray(pp, float)
    n = np.maximum(chunks, 1.0)
    k = np.maximum(buckets, 1.0)
    per_chunk = lambda c, window: c / n + (n - 1) * np.maximum(0.0, (c - usable * pp * window) / n)  # noqa: E731
    interleaved = per_chunk(gather, fwd) + per_chunk(reduce, bwd)
    chain = gather / k + (k - 1) * np.maximum(0.0, (gather - usable * fwd) / k)
    flat = chain + np.maximum(pp - 1.0, 0.0) * gather + np.maximum(0.0, reduce - usable * bwd)
    return np.where((pp > 1) & (n > 1), interleaved, flat)


def pipeline_bubble_s(sched, pp, v, m, fwd, bwd_input, bwd_weight):
    """Idle time of the pipeline per step, from per-microbatch stage times (all chunks of the stage).

    GPipe and 1F1B: (p-1) stage-times (Huang et al. 2019; Narayanan et al. 2021). Interleaved 1F1B with v
    chunks per device: (p-1)/v (Narayanan et al. 2021). ZB-V (Qi et al. 2024, two chunks): (p-1) *
    (F + B - 2W) per chunk, zero when the weight-gradient pass W fills the gaps, never negative. DualPipeV
    (DeepSeek-AI 2024, the V-shaped half of DualPipe) is timed as ZB-V: the same V placement and split backward;
    torch's ScheduleDualPipeV runs a paired F and B one after the other (no DualPipe overlap kernels).
    """
    full = fwd + bwd_input + bwd_weight
    zb = np.where(m >= 2 * pp, np.maximum(0.0, (fwd + bwd_input - 2 * bwd_weight) / 2.0), full / 2.0)
    per = np.select([sched <= 1, sched == 2, sched >= 3], [full, full / v, zb])
    return np.where(pp > 1, (pp - 1) * per, 0.0)


def _slowest_rank(loads: Loads, pp, v_shape, per_layer, embed, head):
    """(layers, embedding there 0/1, head there 0/1) of the rank with the longest time per microbatch.
    Ties go to the head's rank, then the embedding's (a balanced split's last stage, as before)."""
    first, last, inner = rank_times(loads, pp, v_shape, per_layer, embed, head)
    one = same_rank(pp, v_shape)
    is_last = last >= np.maximum(first, inner)
    is_first = ~is_last & (first >= inner)
    layers = np.select([is_last, is_first], [loads.last, loads.first], loads.inner)
    embed_on = np.where(is_first | (is_last & one), 1.0, 0.0)
    head_on = np.where(is_last | (is_first & one), 1.0, 0.0)
    return layers, embed_on, head_on


def _rank_params(model: ModelConfig, loads: Loads, pp, v_shape):
    """Parameters of the (first, last, inner) ranks: their layers plus the embedding on the first and the head
    (final norm + output projection) on the last; both on one rank under a V schedule or pp = 1."""
    per_layer = model.params_per_layer()
    one = same_rank(pp, v_shape)
    first = loads.first * per_layer + model.embedding_params() + np.where(one, model.head_params(), 0.0)
    last = np.where(one, first, loads.last * per_layer + model.head_params())
    return first, last, loads.inner * per_layer


def _largest_rank(model: ModelConfig, loads: Loads, pp, v_shape):
    """(parameters, layers) of the rank holding the most parameters (its data-parallel traffic and optimizer
    step are the slowest)."""
    first, last, inner = _rank_params(model, loads, pp, v_shape)
    params = np.maximum.reduce([first, last, inner])
    layers = np.select([params == last, params == first], [loads.last, loads.first], loads.inner)
    return params, layers


def inflight_microbatches(sched, pp, v, m, rank=0):
    """Microbatches whose activations pipeline rank `rank` holds at its peak, in units of its whole stage (all
    its chunks). 1F1B: rank r runs p - r - 1 warm-up forwards before its first backward, so it holds p - r
    (Narayanan et al. 2021); interleaved: Megatron-core's warm-up of 2(p - r - 1) + (v - 1)p chunk forwards plus
    the one in flight, v chunks to a stage, p (1 + (p-1)/(p v)) on the first rank (Korthikanti et al. 2022);
    GPipe: all m; ZB-V: as many as 1F1B's first rank on every rank (its rank 0 holds both ends). Never more
    than the step's m microbatches."""
    r = np.asarray(rank, dtype=float)
    one_f_one_b = np.minimum(pp - r, m)
    interleaved = np.minimum((2 * (pp - r - 1) + (v - 1) * pp + 1) / v, m)
    return np.select([sched == 0, sched == 2, sched >= 3], [m, interleaved, np.minimum(pp, m)], one_f_one_b)


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


def memory_per_device(model, system, seq, opts, *, T, tp, pp, dp, cp, sp, rc, sched, v, m, zero, dp_shard,
                      loads: Loads | None = None, moe: dict | None = None, ep=1, etp=1):
    """Memory of the rank that needs the most (loads: layers per rank, default the balanced split). Each rank
    holds its own schedule's microbatches in flight: the first rank the most, the last (with the head and its
    logits) the fewest, the inner ranks counted as the second, the most loaded of them. moe: plan.moe.memory_terms,
    the routed experts' bytes per layer on top of the dense view (`model`)."""
    v_shape = np.asarray(sched) >= 3
    loads = loads or balanced_loads(model.layers, pp, v, v_shape)

    sp_part, tp_part, core = activation_bytes_per_token(model, seq / 1, opts.attention, opts.fp8)
    if opts.attention == "unfused":
        core = core / cp  # scores over the local query rows only
    sp_scale = np.where(sp, 1.0 / tp, 1.0)
    layer_full = T * (sp_part * sp_scale + tp_part / tp + core / tp)
    # recompute_mlp keeps the MLP block's input (already counted) instead of its gate/up (fc1/GeLU) outputs
    mlp_kept = (6 if model.arch == "llama" else 4) * model.ffn if opts.recompute_mlp else 0
    layer_selective = T * (sp_part * sp_scale + (tp_part - mlp_kept) / tp)
    if opts.selective_ops:  # torchtitan's per-op SAC keeps the save list's outputs, plus the log-sum-exp (core)
        layer_selective = T * (selective_ops_bytes_per_token(model, tp, sp) + core / tp)
    layer_input = T * 2 * model.hidden * sp_scale
    per_layer = np.select([rc == 0, rc == 1], [layer_full, layer_selective], layer_input)
    rebuilt = np.where(rc == 2, layer_full, 0.0)  # one layer rebuilt during backward
    logits = T * model.vocab / tp * opts.loss_peak_bytes_per_logit  # the loss backward's peak on the last stage
    one = same_rank(pp, v_shape)
    ranks = []  # (weights, grads, optimizer, activations) of the first, last and inner ranks
    pinned = (np.asarray(zero) == 3) & (np.asarray(pp) > 1) & opts.fsdp_pp_unsharded
    # ZeRO-3 / FSDP over more than one rank gathers a unit (a layer) at a time: at the start of backward the last layer's unsharded
    # parameters, the prefetched next one's, the layer's unsharded gradient (param dtype) and the reduce-scatter input
    # it is copied into (reduce dtype; torch FSDP2 foreach_reduce, FSDP1 _reduce_grad); during the loss backward before
    # it, the loss's peak beside the last layer's parameters (not resharded after forward). Both are transient: counted
    # with the activations
    unit = model.params_per_layer() / tp
    fsdp_unit = np.where((np.asarray(zero) == 3) & ~pinned & (np.asarray(dp_shard) > 1), 1.0, 0.0)  # sharded
    working = fsdp_unit * unit * (3 * opts.param_bytes + opts.grad_bytes)
    head_extra = np.maximum(logits + fsdp_unit * unit * opts.param_bytes, working)
    ranks_at = (0.0, np.where(one, 0.0, pp - 1), np.minimum(1.0, pp - 1))  # pipeline rank of first, last, inner
    for params, layers, head, r in zip(_rank_params(model, loads, pp, v_shape), (loads.first, loads.last, loads.inner),
                                       (one, True, False), ranks_at, strict=True):
        params_dev = params / tp
        inflight = inflight_microbatches(sched, pp, v, m, r)
        # FP8 with a weight cache keeps the cast weight and its transpose between microbatches (2 x 1 byte)
        fp8_copies = np.where((zero < 3) & opts.fp8 & opts.fp8_weight_cache, 2 * FP8_BYTES, 0.0) * params_dev
        ex = moe or {"weights": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "once": 0.0}
        # FSDP kept gathered under a pipeline (Options.fsdp_pp_unsharded): the gathered copy beside the shard, and
        # the gradients accumulated unsharded in the reduce dtype until the last backward
        gathered = np.where(pinned, params_dev * opts.param_bytes, 0.0)
        ranks.append((params_dev * WEIGHT_BYTES / np.where(zero == 3, dp_shard, 1.0) + gathered + fp8_copies
                      + layers * ex["weights"],
                      params_dev * opts.grad_bytes / np.where((zero >= 2) & ~pinned, dp_shard, 1.0) + layers * ex["grads"],
                      params_dev * (OPTIMIZER_BYTES if opts.master_weights else BF16_OPTIMIZER_BYTES)
                      / np.where(zero >= 1, dp_shard, 1.0) + layers * ex["optimizer"],
                      (per_layer + ex["activations"]) * layers * inflight + rebuilt + ex["once"]
                      + np.where(head, head_extra, working)))
    shape = np.broadcast_shapes(*(np.shape(x) for r in ranks for x in r))
    parts = np.array([[np.broadcast_to(x, shape) for x in r] for r in ranks])  # rank, part, layouts...
    worst = np.asarray(np.argmax(parts.sum(axis=1), axis=0))
    weights, grads, optimizer, activations = np.take_along_axis(parts, worst[None, None], axis=0)[0]
    total = weights + grads + optimizer + activations
    eff = system.efficiency
    groups = process_groups(tp, pp, dp, cp, dp_shard, ep, etp)
    reserved = eff.runtime_reserved_bytes + groups * eff.comm_buffer_bytes_per_group
    capacity = (system.device_memory_bytes - reserved) * eff.memory_usable_fraction
    return {"memory_weights_bytes": weights, "memory_grads_bytes": grads, "memory_optimizer_bytes": optimizer,
            "memory_activations_bytes": activations, "memory_per_device_bytes": total,
            "memory_capacity_bytes": capacity * np.ones_like(total), "fits": total <= capacity}
