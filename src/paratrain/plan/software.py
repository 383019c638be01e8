"""The run's software as a user names it (`paratrain estimate` / `plan` flags, the accuracy benchmark's csv
columns) and the one mapping from it to `Options`: each rule is written here once, so a flag changes an estimate
exactly as the benchmark's column does (benchmarks/planner_accuracy.py _eval_options calls `software_options`).

Every field's None means "the stack's default" (plan.stacks; the system's stack where none is named). A bad value
raises ValueError naming the flag, the value and what is allowed (the CLI prints it as one line).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.hardware.catalog import System
from paratrain.plan.options import ATTENTION, CP_COMM, Options
from paratrain.plan.precision import OPTIMIZER_STATE_BYTES
from paratrain.plan.stacks import (
    ATTENTION_KERNELS,
    CROSS_ENTROPY_BYTES,
    CROSS_ENTROPY_LOSS_PEAK_BYTES,
    DEEPSPEED_BF16_ACCUM_BYTES,
    DEEPSPEED_ZERO_BUCKET_ELEMENTS,
    MEGATRON_CORE_FWD_SEND_WAIT,
    TORCH_CHECKPOINT_STACKS,
    TORCH_EARLY_STOP,
    attention_kernel_eff,
)

# FP8 scaling recipes, named as Megatron-LM's --fp8-recipe names them (megatron/training/arguments.py: delayed,
# tensorwise, mxfp8, blockwise): "current" is per-tensor current scaling ("tensorwise", Megatron-Bridge's FP8-CS,
# torchao float8's dynamic scaling), "delayed" Transformer Engine's DelayedScaling (amax history, a MAX all-reduce
# of the amaxes per fp8_autocast region: Options.fp8_amax_reduce), "mxfp8" MX block scaling (one E8M0 scale per 32
# elements, found while casting: Options.block_scaling). Blockwise (DeepSeek-V3's 1x128 / 128x128) is not modelled.
FP8_RECIPES = ("current", "delayed", "mxfp8")
MIB_BYTES = 2**20


@dataclass(frozen=True)
class Software:
    """What a run names about its software beyond the layout. The flag each field is spelled as is in its error.

    stack: plan.stacks name (None: the system's). attention: "flash" / "unfused" (None: the stack's).
    fp8: layer matmuls in FP8; fp8_recipe: one of FP8_RECIPES (None: current scaling, or the chip's own block
    scaling); implies fp8. bf16_sr: pure BF16 with stochastic rounding (no fp32 master, bf16 gradients).
    attention_kernel: one of plan.stacks.ATTENTION_KERNELS, where the run overrode its stack's kernel (its rate on
    Hopper: stacks.attention_kernel_eff; elsewhere the chip's). grad_bucket_mb: the data-parallel gradient bucket,
    MiB per collective call (Apex DistributedFusedAdam's bucket_cap_mb, torch DDP's bucket_cap_mb). grad_bytes:
    bytes per gradient element reduced (2, 4). dp_overlap: fraction of compute data-parallel traffic may hide
    behind ([0, 1]; 0: gradients reduced after the backward). cp_comm: Options.CP_COMM. fused_softmax: False where
    an unfused attention's softmax is not one kernel. torch_compile: False = PyTorch eager (Options.eager).
    tp_comm_overlap: TP collectives pipelined with their GEMMs. recompute_mlp: selective recompute also replays
    the MLP block (Options.recompute_mlp). cross_entropy: the loss kernel where the run names it, one of
    plan.stacks.CROSS_ENTROPY_BYTES (its HBM bytes per logit: Options.ce_bytes_per_logit). recompute_every: full
    recompute checkpoints one layer in N (Options.recompute_every; torchtitan's selective layer AC).
    zero1_grad_allreduce: ZeRO-1 all-reduces the whole gradient buffer before its post-step gather (DeepSpeed's
    BF16_Optimizer; Options.zero1_grad_allreduce), and that optimizer's per-microbatch fp32 gradient accumulation is
    timed with it (Options.grad_accum_in_hbm at plan.stacks.DEEPSPEED_BF16_ACCUM_BYTES).
    zero1_fp16_allreduce: DeepSpeed's fp16 ZeRO-1 (DeepSpeedZeroOptimizer, stage 1, under the pipeline engine,
    DeepSpeed v0.5.10-v0.6.0: plan.stacks.DEEPSPEED_ZERO_BUCKET_ELEMENTS): fp16 gradients all-reduced in buckets
    of 500M elements after the schedule, the updated partitions all-gathered after the step
    (Options.zero1_grad_allreduce, grad_bytes 2, bucket_bytes), and autograd's fp16 accumulation into .grad each
    microbatch (Options.grad_accum_in_hbm: 2 + 2 x 2 bytes per parameter). --grad-bytes / --grad-bucket-mb win.
    last_bucket_after_backward: the gradient all-reduce follows the backward bucket by bucket, its last bucket
    after the backward (InternLM's HybridZeroOptimizer; Options.last_bucket_after_backward).
    bf16_optimizer: Adam's states in bf16 with no fp32 master copy (NeMo's distributed_fused_adam with optim.dtype
    bf16: Options.master_weights False), the gradients as the stack keeps them. optimizer_state: what Apex
    DistributedFusedAdam keeps per parameter where NeMo picks it, one of precision.OPTIMIZER_STATE_BYTES
    (Options.optimizer_state_bytes; "bf16" is bf16_optimizer). dropout: False where the run sets
    attention and hidden dropout to 0 (Options.dropout: the GPT count keeps no masks). distribute_saved_activations:
    True where full recompute splits the checkpointed block inputs over the TP group (Megatron-LM
    --distribute-saved-activations, metaseq --distribute-checkpointed-activations; Options.distribute_saved_activations).
    param_gather_in_step: True where the run turns Megatron-Core's overlap_param_gather off (Megatron-Bridge 0.2.0's
    70B / 405B MXFP8 performance configs): the parameter all-gather runs in the optimizer step, exposed
    (Options.param_gather_in_step). megatron_core: the run's
    megatron-core release, "MAJOR.MINOR[.PATCH]" (the container's; megatron_core_options), None: before 0.18.
    torch: the run's torch release, "MAJOR.MINOR[.PATCH]" (torch_options), None: the stack's (a torch with
    checkpoint early stop).
    """

    stack: str | None = None
    attention: str | None = None
    fp8: bool = False
    fp8_recipe: str | None = None
    bf16_sr: bool = False
    attention_kernel: str | None = None
    grad_bucket_mb: float | None = None
    grad_bytes: int | None = None
    dp_overlap: float | None = None
    cp_comm: str | None = None
    fused_softmax: bool | None = None
    torch_compile: bool | None = None
    tp_comm_overlap: bool | None = None
    recompute_mlp: bool | None = None
    cross_entropy: str | None = None
    recompute_every: int | None = None
    zero1_grad_allreduce: bool | None = None
    zero1_fp16_allreduce: bool | None = None
    last_bucket_after_backward: bool | None = None
    bf16_optimizer: bool | None = None
    optimizer_state: str | None = None
    dropout: bool | None = None
    distribute_saved_activations: bool | None = None
    param_gather_in_step: bool | None = None
    megatron_core: str | None = None
    torch: str | None = None

    def __post_init__(self) -> None:
        for flag, value, allowed in (("--attention", self.attention, ATTENTION),
                                     ("--fp8-recipe", self.fp8_recipe, FP8_RECIPES),
                                     ("--attention-kernel", self.attention_kernel, ATTENTION_KERNELS),
                                     ("--cp-comm", self.cp_comm, CP_COMM), ("--grad-bytes", self.grad_bytes, (2, 4)),
                                     ("--cross-entropy", self.cross_entropy, tuple(CROSS_ENTROPY_BYTES)),
                                     ("--optimizer-state", self.optimizer_state, tuple(OPTIMIZER_STATE_BYTES))):
            if value is not None and value not in allowed:
                raise ValueError(f"{flag} = {value!r}: allowed: {', '.join(map(str, allowed))}")
        if self.grad_bucket_mb is not None and not self.grad_bucket_mb > 0:
            raise ValueError(f"--grad-bucket-mb = {self.grad_bucket_mb}: allowed: a number > 0 (MiB)")
        if self.dp_overlap is not None and not 0 <= self.dp_overlap <= 1:
            raise ValueError(f"--dp-overlap = {self.dp_overlap}: allowed: a number in [0, 1]")
        if self.recompute_every is not None and not (isinstance(self.recompute_every, int) and self.recompute_every >= 1):
            raise ValueError(f"--recompute-every = {self.recompute_every!r}: allowed: an integer >= 1")
        if self.megatron_core is not None:
            core_version(self.megatron_core)
        if self.torch is not None:
            release_version(self.torch, "--torch")
        if self.zero1_fp16_allreduce and (self.zero1_grad_allreduce or self.bf16_sr):
            raise ValueError("--zero1-fp16-allreduce (DeepSpeed's fp16 ZeRO-1) with --zero1-grad-allreduce or "
                             "--bf16-sr: one optimizer per run; allowed: one of them")
        if self.bf16_sr and self.grad_bytes == 4:
            raise ValueError("--grad-bytes 4 with --bf16-sr: pure BF16 keeps bf16 gradients; allowed: --grad-bytes 2 "
                             "or no --grad-bytes")


def release_version(text: str, flag: str) -> tuple[int, int]:
    """(major, minor) of a release as "0.17.1" / "2.1" names it; a bad one raises naming `flag`."""
    parts = text.split(".")
    if not (2 <= len(parts) <= 3 and all(x.isdigit() for x in parts)):
        raise ValueError(f"{flag} = {text!r}: allowed: MAJOR.MINOR or MAJOR.MINOR.PATCH (e.g. 0.17.1)")
    return int(parts[0]), int(parts[1])


def core_version(text: str) -> tuple[int, int]:
    """(major, minor) of a megatron-core release as "0.17.1" / "0.18" names it."""
    return release_version(text, "--megatron-core")


def torch_options(version: str | None, stack: str | None) -> dict:
    """What the torch release changes in Options (the one rule; the csv column torch, the flag --torch): on a stack
    whose recompute is torch.utils.checkpoint's non-reentrant replay (stacks.TORCH_CHECKPOINT_STACKS) the replay
    stops before the block's last GEMM from torch 2.1 (stacks.TORCH_EARLY_STOP; Options.replay_drops_dead_tail)
    and reruns the whole block before it. None, or another stack: the stack's default."""
    if version is None or stack not in TORCH_CHECKPOINT_STACKS:
        return {}
    return {"replay_drops_dead_tail": release_version(version, "--torch") >= TORCH_EARLY_STOP}


def megatron_core_options(version: str | None) -> dict:
    """What the megatron-core release changes in Options (the one rule; the csv column megatron_core, the flag
    --megatron-core): from 0.18 the interleaved schedule waits for each forward send at once
    (stacks.MEGATRON_CORE_FWD_SEND_WAIT). None: the schedule as read at core_r0.13-0.17."""
    if version is None:
        return {}
    return {"p2p_fwd_send_wait": core_version(version) >= MEGATRON_CORE_FWD_SEND_WAIT}


def software_options(system: System, sw: Software, system_stack: bool = True) -> Options:
    """Options of `sw` on `system`: the stack's defaults (Options.for_system), each field given overriding them.
    system_stack False (plan --any-stack): generic timing where no stack is named."""
    kw: dict = {"fp8": sw.fp8 or sw.fp8_recipe is not None}
    if sw.fp8_recipe == "mxfp8":
        kw["block_scaling"] = True
    if sw.fp8_recipe == "delayed":
        kw["fp8_amax_reduce"] = True
    if sw.bf16_sr:  # everything bf16: the gradients too (a named --grad-bytes 2 is the same)
        kw |= {"master_weights": False, "grad_bytes": 2}
    if sw.bf16_optimizer:  # bf16 Adam states updating the bf16 weights: no master copy, gradients unchanged
        kw["master_weights"] = False
    if sw.optimizer_state == "bf16":  # the same optimizer, named by its state
        kw["master_weights"] = False
    elif sw.optimizer_state is not None:  # a master copy (fp32 or bf16, or remainders): the state's size only
        kw["optimizer_state_bytes"] = float(OPTIMIZER_STATE_BYTES[sw.optimizer_state])
    if sw.zero1_fp16_allreduce:  # fp16 buckets all-reduced, autograd's fp16 accumulation (stacks, the constant)
        kw |= {"zero1_grad_allreduce": True, "grad_bytes": 2, "grad_accum_in_hbm": True,
               "bucket_bytes": float(DEEPSPEED_ZERO_BUCKET_ELEMENTS * 2)}
    if sw.grad_bytes is not None:
        kw["grad_bytes"] = sw.grad_bytes
    if sw.grad_bucket_mb is not None:
        kw["bucket_bytes"] = float(sw.grad_bucket_mb) * MIB_BYTES
    if sw.cross_entropy is not None:
        kw["ce_bytes_per_logit"] = CROSS_ENTROPY_BYTES[sw.cross_entropy]
        if sw.cross_entropy in CROSS_ENTROPY_LOSS_PEAK_BYTES:  # what that kernel keeps at the loss backward's peak
            kw["loss_peak_bytes_per_logit"] = CROSS_ENTROPY_LOSS_PEAK_BYTES[sw.cross_entropy]
            kw["tp_loss_peak_bytes_per_logit"] = None  # the named kernel at every tp, not the stack's TP loss
    runs_as = system.stack.runs_as if system_stack and system.stack is not None else None
    if sw.attention_kernel is not None:  # off Hopper no per-kernel rate: the chip's own (the stack's default)
        eff = attention_kernel_eff(sw.attention_kernel, system.chip, sw.stack or runs_as)  # the stack it is timed as
        kw |= {"attention_eff": eff} if eff is not None else {}
    optional = {"dp_overlap": sw.dp_overlap, "cp_comm": sw.cp_comm, "fused_softmax": sw.fused_softmax,
                "eager": None if sw.torch_compile is None else not sw.torch_compile,
                "tp_comm_overlap": sw.tp_comm_overlap, "recompute_mlp": sw.recompute_mlp,
                "recompute_every": sw.recompute_every, "zero1_grad_allreduce": sw.zero1_grad_allreduce,
                "last_bucket_after_backward": sw.last_bucket_after_backward, "dropout": sw.dropout,
                "distribute_saved_activations": sw.distribute_saved_activations,
                "param_gather_in_step": sw.param_gather_in_step}
    kw |= {k: v for k, v in optional.items() if v is not None}
    kw |= megatron_core_options(sw.megatron_core)
    kw |= torch_options(sw.torch, sw.stack or runs_as)
    if sw.zero1_grad_allreduce:  # BF16_Optimizer also adds each microbatch's bf16 gradients into its fp32 buffer
        kw |= {"grad_accum_in_hbm": True, "grad_accum_bytes": DEEPSPEED_BF16_ACCUM_BYTES}
    opts = Options.for_system(system, attention=sw.attention, stack=sw.stack, system_stack=system_stack, **kw)
    if sw.tp_comm_overlap and system.chip.vendor != "nvidia":  # userbuffers / symmetric memory (stacks.GPU_ONLY)
        raise ValueError(f"--tp-comm-overlap on, on {system.chip.name}: the overlap runs on NVIDIA GPUs only; "
                         f"allowed: off, or no --tp-comm-overlap")
    if sw.fused_softmax is False and opts.attention == "flash":  # a flash kernel has no separate softmax pass
        raise ValueError("--unfused-softmax with flash attention: only an unfused attention has a softmax kernel; "
                         "allowed: with --attention unfused (or a stack that runs it)")
    return opts
