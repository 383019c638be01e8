"""`paratrain estimate` (one layout) and `paratrain plan` (search all layouts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from paratrain.cli import OnSystem, Output, UserError, Workload, command, opt, section_options, show
from paratrain.hardware.catalog import resolve_system
from paratrain.model.config import load_model_config
from paratrain.plan import report
from paratrain.plan.api import check_seq, estimate, layout_of, search
from paratrain.plan.config_writer import write_training_config
from paratrain.plan.options import Options


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


# The layout flags are the trainer's [parallel] keys (names, types, bounds, help; defaults from the schema), so a
# layout is spelled the same in `estimate` and `train` (--pp-schedule = --parallel.pp_schedule).
LAYOUT = "layout (the trainer's parallel.* keys; docs/config.md)"
LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "sp", "ep", "etp", "dp_kind", "dp_replicate", "zero_stage", "recompute",
               "pp_schedule", "virtual_stages")
LAYOUT_FIELDS = {name: (kind, f) for name, kind, f in [
    *section_options("parallel", LAYOUT_KEYS, LAYOUT), *section_options("train", ("microbatch",), LAYOUT)]}


def _load(args):
    model = load_model_config(args.model)
    model = model if args.max_seq is None else model.model_copy(update={"max_seq": args.max_seq})
    check_seq(model, args.seq)
    system = resolve_system(args.hardware)
    kw = {"fp8": args.fp8} | ({} if args.grad_bytes is None else {"grad_bytes": args.grad_bytes})
    if args.bf16_sr:  # everything bf16: the gradients too
        if args.grad_bytes == 4:
            raise UserError("--grad-bytes 4 with --bf16-sr: pure BF16 keeps bf16 gradients; allowed: --grad-bytes 2 "
                            "or no --grad-bytes")
        kw |= {"master_weights": False, "grad_bytes": 2}
    return model, system, Options.for_system(system, attention=args.attention, stack=args.stack,
                                             system_stack=not getattr(args, "any_stack", False), **kw)


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
            "objective": args.objective}
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
