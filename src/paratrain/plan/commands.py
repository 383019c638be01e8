"""`paratrain estimate` (one layout) and `paratrain plan` (search all layouts)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from paratrain.cli import Output, UserError, Workload, command, opt, print_json, section_options, show

ESTIMATE_HELP = """\
Predict step time, MFU/HFU, memory per device, communication and cost of ONE parallel layout, from the
analytic model in docs/planner.md (no accelerator needed, milliseconds).

--model is a preset (llama2-7b, llama3-8b, ...) or a TOML file with arch (llama|gpt), layers, hidden, heads,
kv_heads, ffn_hidden, vocab. --hardware is a system from `paratrain hardware list` (or a TOML file); --nodes
counts that system's units (instances or UltraServers). Ranks map to the system's device unit (a NeuronCore
on Trn1: 32 per trn1.32xlarge; a GPU on p4d/p5).

examples:
  paratrain estimate --model llama2-7b --hardware trn1.32xlarge --nodes 128 --seq 4096 --global-batch 1024 \\
      --tp 8 --pp 1 --sp --recompute selective
  paratrain estimate --model llama3-70b --hardware p5.48xlarge --nodes 64 --seq 8192 --global-batch 512 \\
      --tp 8 --pp 4 --sp --pp-schedule interleaved_1f1b --virtual-stages 5 --json

With pp > 1 the planner also picks the layers per pipeline stage (--pp-layers auto, the default): fewer on the
stage that runs the output head (or embedding) when that makes the slowest stage faster; --pp-layers balanced
is the runtime's default split, --pp-layers 8,9,8,7 a split of your own (one count per (virtual) stage).
"""

PLAN_HELP = """\
Search every valid layout (tp, pp, cp, sp, dp, microbatch, recompute, ZeRO stage / FSDP, pipeline schedule,
virtual stages) that fits in memory, and rank by step time (or by USD per token with --objective cost, which
also tries fewer nodes: powers of two down from --nodes). Only the choices the system's usual training stack
supports are searched (NxD on Trn1: ZeRO-1, 1F1B/interleaved); --any-stack lifts that, --stack NAME searches
what that software supports and times it as it runs (nxd: ZeRO-1 with the post-step gather exposed; megatron:
distributed optimizer with overlapped gathers, bf16 gradients, Transformer Engine TP overlap; fsdp2: torchtitan's
FSDP/HSDP layer by layer; deepspeed: ZeRO-1..3). --fp8 runs the layer matmuls at the FP8 peak. MFU counts
attention causally (the timing convention); the full-square MFU of papers is printed beside it.

examples:
  paratrain plan --model llama2-7b --hardware trn1.32xlarge --nodes 128 --seq 4096 --global-batch 1024
  paratrain plan --model llama3-70b --hardware p5.48xlarge --nodes 128 --seq 8192 --global-batch 1024 --top 5 --json
  paratrain plan --model llama2-7b --hardware p4d.24xlarge --nodes 64 --seq 4096 --global-batch 1024 \\
      --objective cost --train-tokens 2e12 --max-days 30
  paratrain plan --model llama3-70b --hardware trn1.32xlarge --nodes 16 --seq 8192 --global-batch 1024 --stack nxd
  paratrain plan --model llama3-70b --hardware dgx-h100 --nodes 8 --seq 8192 --global-batch 256 --stack megatron --fp8
  paratrain plan ... --write-config configs/planned.toml   # then: paratrain train --config configs/planned.toml

Each pipelined layout is ranked with its best layers-per-stage split (parallel.pp_layers, written by
--write-config when it is not the balanced default); see docs/planner.md "Pipeline stage sizes".
"""


@dataclass(kw_only=True)
class PlanTarget(Workload, Output):
    model: str = opt("model preset (llama2-7b, llama3-70b, ...) or model TOML file", required=True)
    hardware: str = opt("system name (paratrain hardware list) or hardware TOML file", required=True)
    nodes: int = opt("number of nodes (instances / UltraServers)", required=True, ge=1)
    attention: Literal["flash", "unfused"] | None = opt("attention kernel (default: the system's stack; flash on "
                                                        "GPUs, unfused on NxD)")
    grad_bytes: int | None = opt("gradient precision (fp32=4; default: the stack's, 4 unless --stack megatron)",
                                 choices=(2, 4))
    stack: Literal["nxd", "megatron", "fsdp2", "deepspeed"] | None = opt(
        "training software: search only what it supports (plan) and time it as it runs (ZeRO-1 gather overlap, "
        "TP comm overlap, gradient precision); default: the system's")
    fp8: bool = opt("layer matmuls in FP8 at the chip's FP8 peak (Transformer Engine / torchao float8)")
    train_tokens: float | None = opt("tokens to train: adds run time and cost", gt=0)
    max_seq: int | None = opt("the model's context length (default: the preset's); longer than the preset's "
                              "assumes RoPE scaling to it. A --seq beyond it is refused", ge=1)
    write_config: str | None = opt("write the (best) layout as a training config TOML", metavar="FILE")


# The layout flags are the trainer's [parallel] keys (names, types, bounds, help; defaults from the schema), so a
# layout is spelled the same in `estimate` and `train` (--pp-schedule = --parallel.pp_schedule).
LAYOUT = "layout (the trainer's parallel.* keys; docs/config.md)"
LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "sp", "ep", "etp", "dp_kind", "dp_replicate", "zero_stage", "recompute",
               "pp_schedule", "virtual_stages")
EstimateArgs = dataclasses.make_dataclass("EstimateArgs", [*section_options("parallel", LAYOUT_KEYS, LAYOUT), (
    "microbatch", int, opt("sequences per microbatch (train.microbatch)", 1, ge=1, short="--train.microbatch",
                           group=LAYOUT)), (
    "pp_layers", str, opt("layers per pipeline stage: auto (the planner's choice), balanced (the runtime's default), "
                          "or one count per (virtual) stage, e.g. 8,9,8,7", "auto", short="--parallel.pp_layers",
                          group=LAYOUT))], bases=(PlanTarget,), kw_only=True)


@dataclass(kw_only=True)
class PlanArgs(PlanTarget):
    top: int = opt("how many candidates to show", 10, ge=1)
    objective: Literal["time", "cost"] = opt("rank by step time or by USD per token", "time")
    any_stack: bool = opt("search choices the system's stack lacks too")
    max_microbatch: int = opt("largest microbatch searched", 64, ge=1)
    max_days: float | None = opt("with --train-tokens: only layouts that finish the run within this many days",
                                 gt=0)


def _load(args):
    from paratrain.hardware.catalog import resolve_system
    from paratrain.model.config import load_model_config
    from paratrain.plan.api import check_seq
    from paratrain.plan.model import Options

    model = load_model_config(args.model)
    if args.max_seq is not None:
        model = model.model_copy(update={"max_seq": args.max_seq})
    check_seq(model, args.seq)
    system = resolve_system(args.hardware)
    kw = {"fp8": args.fp8} | ({} if args.grad_bytes is None else {"grad_bytes": args.grad_bytes})
    return model, system, Options.for_system(system, attention=args.attention, stack=args.stack, **kw)


@command("estimate", EstimateArgs, "predict time, memory and cost of one layout", ESTIMATE_HELP)
def cmd_estimate(args) -> None:
    from paratrain.plan.api import estimate
    from paratrain.plan.report import print_estimate

    model, system, options = _load(args)
    est = estimate(model, system, args.nodes, args.seq, args.global_batch, _layout(args), options, stack=args.stack,
                   train_tokens=args.train_tokens)
    _write(args, est, model, system)
    print_json(est.to_dict()) if args.json else print_estimate(est)


def _layout(args):
    """The planner's Layout of the flags given, read as the trainer reads them: its [parallel] section (its
    checks, its defaults for what is not given), then the planner's Layout by the one conversion
    (plan.api.layout_from_parallel)."""
    from dataclasses import replace

    from pydantic import ValidationError

    from paratrain.config import ParallelSection, format_validation_error
    from paratrain.plan.api import layout_from_parallel

    try:
        pcfg = ParallelSection(**{k: getattr(args, k) for k in LAYOUT_KEYS if getattr(args, k) is not None})
    except ValidationError as err:  # one line, the trainer's message
        raise UserError(format_validation_error(err).replace("invalid config: config: ", "layout: ")) from None
    return replace(layout_from_parallel(pcfg, args.microbatch), pp_layers=_pp_layers(args.pp_layers))


def _pp_layers(text: str) -> str | tuple[int, ...]:
    """--pp-layers: 'auto', 'balanced', or comma-separated counts ('8,9,8,7' or '[8, 9, 8, 7]')."""
    if text in ("auto", "balanced"):
        return text
    try:
        return tuple(int(n) for n in text.strip("[] ").split(","))
    except ValueError:
        raise UserError(f"--pp-layers = {text!r}: allowed: auto, balanced, or layer counts per stage such as "
                        f"8,9,8,7") from None


@command("plan", PlanArgs, "search all layouts, rank by time or cost", PLAN_HELP)
def cmd_plan(args) -> None:
    from paratrain.plan.api import search
    from paratrain.plan.report import print_plan, why_nothing_fits

    model, system, options = _load(args)
    if args.max_days is not None and not args.train_tokens:
        raise UserError("--max-days needs --train-tokens (how many tokens the run trains)")
    result = search(model, system, args.nodes, args.seq, args.global_batch, top=args.top, objective=args.objective,
                    options=options, max_microbatch=args.max_microbatch, train_tokens=args.train_tokens,
                    any_stack=args.any_stack, stack=args.stack,
                    max_time_s=None if args.max_days is None else args.max_days * 86400)
    if not result.candidates:
        raise UserError(why_nothing_fits(result, model, system, args.nodes, args.seq, args.global_batch))
    best = result.candidates[0]
    _write(args, best, model, system)
    searched = args.stack or ("any" if args.any_stack or system.stack is None else system.stack.name)
    info = {"stack": searched, "combinations": result.combinations, "evaluated": result.valid,
            "fitting": result.fitting, "seconds": result.seconds, "configs_per_s": result.configs_per_s,
            "objective": args.objective}
    show(args, {"best": best.to_dict(), "candidates": [c.to_dict() for c in result.candidates], "search": info},
         lambda: print_plan(result, info))


def _write(args, est, model, system) -> None:
    from paratrain.plan.config_writer import write_training_config

    if args.write_config:
        path = write_training_config(args.write_config, est, model, args.model, system.devices_per_node,
                                     args.hardware)
        print(f"wrote {path}") if not args.json else None
