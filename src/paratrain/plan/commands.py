"""`paratrain estimate` (one layout) and `paratrain plan` (search all layouts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from paratrain.cli import OnSystem, Output, UserError, Workload, command, opt, section_options, show
from paratrain.hardware.catalog import resolve_system
from paratrain.model.config import load_model_config
from paratrain.plan import report
from paratrain.plan.api import TIE_FRACTION, check_seq, estimate, layout_of, near_ties, search
from paratrain.plan.config_writer import write_training_config
from paratrain.plan.options import CP_COMM
from paratrain.plan.software import FP8_RECIPES, Software, software_options
from paratrain.plan.stacks import ATTENTION_KERNELS, CROSS_ENTROPY_BYTES

SOFTWARE = "software (how the stack runs; default: the stack's; docs/cli.md)"
ON_OFF = {"on": True, "off": False, None: None}


@dataclass(kw_only=True)
class PlanTarget(Workload, OnSystem, Output):
    model: str = opt("model preset (llama2-7b, llama3-70b, ...) or model TOML file", required=True)
    nodes: int = opt("number of nodes (instances / UltraServers)", required=True, ge=1)
    attention: Literal["flash", "unfused"] | None = opt("attention kernel (default: the system's stack; flash on "
                                                        "GPUs, unfused on NxD)")
    grad_bytes: int | None = opt("gradient precision (fp32=4; default: the stack's, 4 unless --stack megatron)",
                                 choices=(2, 4))
    stack: Literal["nxd", "megatron", "fsdp2", "deepspeed"] | None = opt(
        "training software: search only what it supports (plan) and time it as it runs (ZeRO-1 gather overlap, "
        "TP comm overlap, gradient precision); default: the system's")
    fp8: bool = opt("layer matmuls in FP8 at the chip's FP8 peak (Transformer Engine / torchao float8)")
    bf16_sr: bool = opt("pure BF16 with stochastic rounding (Neuron's Autocast:BF16+SR, XLA_USE_BF16=1): bf16 "
                        "weights, gradients and Adam states, no fp32 master copy (4 bytes of optimizer state per "
                        "parameter instead of 12)")
    train_tokens: float | None = opt("tokens to train: adds run time and cost", gt=0)
    max_seq: int | None = opt("the model's context length (default: the preset's); longer than the preset's "
                              "assumes RoPE scaling to it. A --seq beyond it is refused", ge=1)
    write_config: str | None = opt("write the (best) layout as a training config TOML", metavar="FILE",
                                   writes="file")
    # How the run's software runs, beyond --stack (plan.software: the same mapping the accuracy benchmark's csv
    # columns go through); unset: the stack's default
    fp8_recipe: str | None = opt(
        "FP8 scaling recipe (implies --fp8), as Megatron's --fp8-recipe: current (per-tensor current scaling, FP8-CS; "
        "the default), delayed (Transformer Engine's DelayedScaling, NeMo 1.0's fp8_hybrid: adds a blocking amax "
        "all-reduce over each stage's TP x CP x DP ranks twice per model chunk per microbatch), mxfp8 (MX block "
        "scaling, one scale per 32 elements: Blackwell's MXFP8)", choices=FP8_RECIPES, group=SOFTWARE)
    attention_kernel: str | None = opt(
        "attention kernel where the run overrides its stack's: fa2 (flash-attn 2: Transformer Engine with "
        "NVTE_FUSED_ATTN=0, NeMo launcher 24.03-24.07; ~35% of peak on Hopper), cudnn (TE's fused attention, "
        "the megatron stack's default on Hopper) or fa1 (FlashAttention-1 class, e.g. llm-foundry's attn_impl "
        "triton: half FA2's rate, on Hopper and A100); timed differently on Hopper (fa1: and A100) only",
        choices=ATTENTION_KERNELS,
        group=SOFTWARE)
    cross_entropy: str | None = opt(
        "the loss kernel where the run names it: te (Transformer Engine's Triton cross-entropy on the bf16 logits, "
        "the megatron stack's default, 10 bytes per logit) or mcore_fused (Megatron-Core's "
        "fused_vocab_parallel_cross_entropy over an fp32 copy, NeMo 1.0's cross_entropy_loss_fusion: 32) or mcore "
        "(the same unfused, eager: 52) or flash_xentropy (flash-attn's fused CrossEntropyLoss on the bf16 logits, "
        "llm-foundry's default: 6, keeping 4 bytes per logit at the loss backward's peak) or torch_compiled "
        "(torchtitan's torch.compile'd F.cross_entropy, from its Apr 2025 bbb1b61: 8, keeping 4)",
        choices=tuple(CROSS_ENTROPY_BYTES), group=SOFTWARE)
    grad_bucket_mb: float | None = opt(
        "data-parallel gradient bucket, MiB per collective call (Apex DistributedFusedAdam / torch DDP "
        "bucket_cap_mb); smaller buckets mean more, latency-bound calls at large DP. Default: the stack's "
        "(megatron 256 MiB, Megatron-LM max(40M, 1M x dp) parameters, paratrain's runtime 25 MiB)", gt=0,
        metavar="MIB", group=SOFTWARE)
    dp_overlap: float | None = opt(
        "fraction of compute the data-parallel traffic can hide behind: 0 where the software reduces gradients "
        "only after the backward (Megatron-LM 2021 local DDP); default: the system's", ge=0, le=1,
        metavar="FRACTION", group=SOFTWARE)
    cp_comm: str | None = opt(
        "context-parallel K/V exchange: ring (Megatron-Core p2p, hidden behind attention), allgather (one exposed "
        "all-gather, Llama 3's), allgather_rotate (torch context_parallel as torchtitan runs it); default: the "
        "stack's", choices=CP_COMM, group=SOFTWARE)
    unfused_softmax: bool = opt(
        "with --attention unfused: the softmax is several kernels, not one fused kernel (neuronx-nemo-megatron "
        "before 2.18)", group=SOFTWARE)
    torch_compile: Literal["on", "off"] | None = opt(
        "off: PyTorch eager, one kernel per op (torchtitan without torch.compile: fp32 norms, rotary, SwiGLU "
        "launched and moved separately); on: fused kernels. Default: the stack's (eager for paratrain's own "
        "runtime on probed local hosts)", group=SOFTWARE)
    tp_comm_overlap: Literal["on", "off"] | None = opt(
        "tensor-parallel collectives pipelined with their GEMMs (TE userbuffers, torch async TP); NVIDIA only. "
        "Default: the stack's (on for megatron on NVIDIA GPUs)", group=SOFTWARE)
    recompute_mlp: bool = opt(
        "selective recompute also replays the MLP block (NxD activations_checkpoint_recompute_mlp); plan "
        "--stack nxd searches both", group=SOFTWARE)
    recompute_every: int | None = opt(
        "full recompute checkpoints one layer in N, the others keep all activations (torchtitan's selective layer "
        "AC, selective_ac_option N; its default 2); default 1: every layer", ge=1, metavar="N", group=SOFTWARE)
    zero1_grad_allreduce: bool = opt(
        "with --zero-stage 1: the gradients are all-reduced whole, then each rank's updated partition all-gathered "
        "(DeepSpeed's BF16_Optimizer: bf16 with ZeRO stage 0 in the DeepSpeed config), and its eager fp32 gradient "
        "accumulation each microbatch timed; default: reduce-scattered",
        group=SOFTWARE)
    zero1_fp16_allreduce: bool = opt(
        "with --zero-stage 1: DeepSpeed's fp16 ZeRO-1 (DeepSpeedZeroOptimizer under the pipeline engine, v0.5.10-"
        "v0.6.0): fp16 gradients all-reduced in 500M-element buckets after the schedule, the updated partitions "
        "all-gathered, and autograd's fp16 accumulation each microbatch timed; default: reduce-scattered",
        group=SOFTWARE)
    last_bucket_after_backward: bool = opt(
        "the gradient all-reduce follows the backward bucket by bucket, the first once its bucket fills, the last "
        "after the backward (InternLM's HybridZeroOptimizer): one bucket's reduce is exposed at least; default: "
        "all of it may hide behind the last backward", group=SOFTWARE)
    bf16_optimizer: bool = opt(
        "Adam's m and v in bf16 and no fp32 master copy, the bf16 weights updated in place (NeMo's "
        "distributed_fused_adam with optim.dtype bf16 under megatron_amp_O2: store_params False): 4 bytes of "
        "optimizer state per parameter instead of 12; gradients as the stack keeps them", group=SOFTWARE)
    optimizer_state: str | None = opt(
        "what the optimizer keeps per parameter (Apex DistributedFusedAdam as NeMo sets it): fp32 (master, m, v: 12 "
        "bytes), fp32_remainders (store_param_remainders: 16-bit remainders beside the bf16 weights, fp32 m, v: 10), "
        "bf16_master (fp8_params with optim.dtype bf16: 6), bf16 (as --bf16-optimizer: 4); default: 12, or 4 "
        "without a master copy", group=SOFTWARE)
    no_dropout: bool = opt(
        "the run sets attention and hidden dropout to 0 (Megatron-LM --attention-dropout 0 --hidden-dropout 0): a "
        "GPT model keeps no dropout masks; default: the masks are kept (Korthikanti et al.)", group=SOFTWARE)
    distribute_saved_activations: bool = opt(
        "full recompute splits each block's checkpointed input over the TP group and all-gathers it before the replay "
        "(Megatron-LM --distribute-saved-activations, metaseq --distribute-checkpointed-activations); default: kept "
        "whole on every TP rank", group=SOFTWARE)
    param_gather_in_step: bool = opt(
        "the distributed optimizer's parameter all-gather runs synchronously in the optimizer step (Megatron-Core "
        "overlap_param_gather False with overlap_grad_reduce on: Megatron-Bridge 0.2.0's 70B / 405B MXFP8 "
        "performance configs): exposed whole; default: dispatched behind the next forward", group=SOFTWARE)
    megatron_core: str | None = opt(
        "the run's megatron-core release (MAJOR.MINOR[.PATCH], the container's: Megatron-Bridge "
        "docs/releases/software-versions.md): from 0.18 the interleaved schedule waits for each forward pipeline send "
        "at once (Megatron-LM PR #4047); default: the schedule as before 0.18", metavar="VERSION", group=SOFTWARE)
    torch: str | None = opt(
        "the run's torch release (MAJOR.MINOR[.PATCH]): with the fsdp2 stack's non-reentrant activation checkpointing "
        "a recomputed block stops before its last GEMM from torch 2.1 (checkpoint early stop) and reruns whole before "
        "it; default: a torch with early stop", metavar="VERSION", group=SOFTWARE)


# The layout flags are the trainer's [parallel] keys (names, types, bounds, help; defaults from the schema), so a
# layout is spelled the same in `estimate` and `train` (--pp-schedule = --parallel.pp_schedule).
LAYOUT = "layout (the trainer's parallel.* keys; docs/config.md)"
LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "sp", "ep", "etp", "dp_kind", "dp_replicate", "rank_order", "zero_stage", "recompute",
               "pp_schedule", "virtual_stages", "offload_layers")
LAYOUT_FIELDS = {name: (kind, f) for name, kind, f in [
    *section_options("parallel", LAYOUT_KEYS, LAYOUT), *section_options("train", ("microbatch",), LAYOUT)]}


def _load(args):
    model = load_model_config(args.model)
    model = model if args.max_seq is None else model.model_copy(update={"max_seq": args.max_seq})
    check_seq(model, args.seq)
    system = resolve_system(args.hardware)
    return model, system, software_options(system, software_of(args), system_stack=not getattr(args, "any_stack", False))


def software_of(args) -> Software:
    """The software flags as plan.software names them (its checks name the flag)."""
    return Software(stack=args.stack, attention=args.attention, fp8=args.fp8, fp8_recipe=args.fp8_recipe,
                    bf16_sr=args.bf16_sr, attention_kernel=args.attention_kernel, grad_bucket_mb=args.grad_bucket_mb,
                    grad_bytes=args.grad_bytes, dp_overlap=args.dp_overlap, cp_comm=args.cp_comm,
                    fused_softmax=False if args.unfused_softmax else None,
                    torch_compile=ON_OFF[args.torch_compile], tp_comm_overlap=ON_OFF[args.tp_comm_overlap],
                    recompute_mlp=True if args.recompute_mlp else None, cross_entropy=args.cross_entropy,
                    recompute_every=args.recompute_every,
                    zero1_grad_allreduce=True if args.zero1_grad_allreduce else None,
                    zero1_fp16_allreduce=True if args.zero1_fp16_allreduce else None,
                    last_bucket_after_backward=True if args.last_bucket_after_backward else None,
                    bf16_optimizer=True if args.bf16_optimizer else None,
                    optimizer_state=args.optimizer_state,
                    dropout=False if args.no_dropout else None, megatron_core=args.megatron_core,
                    distribute_saved_activations=True if args.distribute_saved_activations else None,
                    param_gather_in_step=True if args.param_gather_in_step else None,
                    torch=args.torch)


@command("estimate", PlanTarget, "predict time, memory and cost of one layout", **LAYOUT_FIELDS,
         pp_layers=(str, opt("layers per pipeline stage: auto (the planner's choice), balanced (the runtime's "
                             "default), or one count per (virtual) stage, e.g. 8,9,8,7", "auto",
                             short="--parallel.pp_layers", group=LAYOUT)))
def cmd_estimate(args) -> None:
    model, system, options = _load(args)
    layout = layout_of({k: getattr(args, k) for k in LAYOUT_KEYS if getattr(args, k) is not None}, args.microbatch,
                       args.pp_layers)  # read as the trainer reads its [parallel] section
    est = estimate(model, system, args.nodes, args.seq, args.global_batch, layout, options, stack=args.stack,
                   train_tokens=args.train_tokens)
    _write(args, est, model, system)
    show(args, est.to_dict(), lambda: report.print_estimate(est))


@command("plan", PlanTarget, "search all layouts, rank by time or cost",
         top=(int, opt("how many candidates to show", 10, ge=1)),
         objective=(Literal["time", "cost"], opt("rank by step time or by USD per token", "time")),
         any_stack=(bool, opt("search choices the system's stack lacks too")),
         max_microbatch=(int, opt("largest microbatch searched", 64, ge=1)),
         max_days=(float | None, opt("with --train-tokens: only layouts that finish the run within this many days",
                                     gt=0)))
def cmd_plan(args) -> None:
    model, system, options = _load(args)
    if args.max_days is not None and not args.train_tokens:
        raise UserError("--max-days needs --train-tokens (how many tokens the run trains)")
    result = search(model, system, args.nodes, args.seq, args.global_batch, top=args.top, objective=args.objective,
                    options=options, max_microbatch=args.max_microbatch, train_tokens=args.train_tokens,
                    any_stack=args.any_stack, stack=args.stack,
                    max_time_s=None if args.max_days is None else args.max_days * 86400)
    if not result.candidates:
        raise UserError(report.why_nothing_fits(result, model, system, args.nodes, args.seq, args.global_batch))
    best = result.candidates[0]
    _write(args, best, model, system)
    searched = args.stack or ("any" if args.any_stack or system.stack is None else system.stack.name)
    info = {"stack": searched, "combinations": result.combinations, "evaluated": result.valid,
            "fitting": result.fitting, "seconds": result.seconds, "configs_per_s": result.configs_per_s,
            "objective": args.objective, "ties_with_best": near_ties(result.candidates, args.objective),
            "tie_fraction": TIE_FRACTION}
    show(args, {"best": best.to_dict(), "candidates": [c.to_dict() for c in result.candidates], "search": info},
         lambda: report.print_plan(result, info, experts=model.num_experts > 0))


def _write(args, est, model, system) -> None:
    if args.write_config and args.bf16_sr:
        raise UserError("--write-config with --bf16-sr: paratrain's trainer keeps fp32 master weights (AdamW under "
                        "autocast); allowed: --write-config without --bf16-sr")
    if args.write_config:
        path = write_training_config(args.write_config, est, model, args.model, system.devices_per_node,
                                     args.hardware, stack=args.stack)
        print(f"wrote {path}") if not args.json else None
