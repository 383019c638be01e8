"""`paratrain estimate` (one layout) and `paratrain plan` (search all layouts)."""

from __future__ import annotations

import argparse
import json
import math

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
      --tp 8 --pp 4 --sp --schedule interleaved_1f1b --virtual-stages 5 --json

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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or model TOML file")
    p.add_argument("--hardware", required=True, help="system name (paratrain hardware list) or TOML file")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes (instances / UltraServers)")
    p.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--attention", choices=["flash", "unfused"], default=None,
                   help="attention kernel (default: the system's stack; flash on GPUs, unfused on NxD)")
    p.add_argument("--grad-bytes", type=int, choices=[2, 4], default=None,
                   help="gradient precision (fp32=4; default: the stack's, 4 unless --stack megatron)")
    p.add_argument("--stack", choices=["nxd", "megatron", "fsdp2", "deepspeed"], default=None,
                   help="training software: search only what it supports (plan) and time it as it runs "
                        "(ZeRO-1 gather overlap, TP comm overlap, gradient precision); default: the system's")
    p.add_argument("--fp8", action="store_true",
                   help="layer matmuls in FP8 at the chip's FP8 peak (Transformer Engine / torchao float8)")
    p.add_argument("--train-tokens", type=float, default=None, help="tokens to train: adds run time and cost")
    p.add_argument("--max-seq", type=int, default=None,
                   help="the model's context length (default: the preset's); longer than the preset's assumes RoPE "
                        "scaling to it. A --seq beyond it is refused")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--write-config", metavar="FILE", help="write the (best) layout as a training config TOML")


def register(subparsers) -> None:
    est = subparsers.add_parser("estimate", help="predict time, memory and cost of one layout",
                                description=ESTIMATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(est)
    est.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    est.add_argument("--pp", type=int, default=1, help="pipeline parallel degree")
    est.add_argument("--dp", type=int, default=None, help="data parallel degree (default: the rest)")
    est.add_argument("--cp", type=int, default=1, help="context parallel degree")
    est.add_argument("--sp", action="store_true", help="sequence parallelism (with tp > 1)")
    est.add_argument("--microbatch", type=int, default=1, help="sequences per microbatch")
    est.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    est.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b", "zbv"], default="1f1b")
    est.add_argument("--virtual-stages", type=int, default=None, help="chunks per device (interleaved: >1, zbv: 2)")
    est.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                     help="0 plain DDP, 1/2 distributed optimizer, 3 fully sharded (default 1, or 3 with fsdp/hsdp)")
    est.add_argument("--dp-kind", choices=["ddp", "fsdp", "hsdp"], default="ddp")
    est.add_argument("--pp-layers", default="auto",
                     help="layers per pipeline stage: auto (the planner's choice, default), balanced (the "
                          "runtime's default), or one count per (virtual) stage, e.g. 8,9,8,7")
    est.set_defaults(func=cmd_estimate)

    plan = subparsers.add_parser("plan", help="search all layouts, rank by time or cost",
                                 description=PLAN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(plan)
    plan.add_argument("--top", type=int, default=10, help="how many candidates to show")
    plan.add_argument("--objective", choices=["time", "cost"], default="time")
    plan.add_argument("--any-stack", action="store_true", help="search choices the system's stack lacks too")
    plan.add_argument("--max-microbatch", type=int, default=64)
    plan.add_argument("--max-days", type=float, default=None,
                      help="with --train-tokens: only layouts that finish the run within this many days")
    plan.set_defaults(func=cmd_plan)


def _options(args, system):
    from paratrain.plan.model import Options

    kw = {"fp8": args.fp8} | ({} if args.grad_bytes is None else {"grad_bytes": args.grad_bytes})
    return Options.for_system(system, attention=args.attention, stack=args.stack, **kw)


def _load(args):
    from paratrain.cli import UserError
    from paratrain.hardware.catalog import resolve_system
    from paratrain.model.config import load_model_config

    for name in ("nodes", "seq", "global_batch"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} = {getattr(args, name)}: must be >= 1")
    if args.train_tokens is not None and not args.train_tokens > 0:
        raise UserError(f"--train-tokens = {args.train_tokens}: must be > 0")
    from paratrain.plan.api import check_seq

    model = load_model_config(args.model)
    if args.max_seq is not None:
        if args.max_seq < 1:
            raise UserError(f"--max-seq = {args.max_seq}: must be >= 1")
        model = model.model_copy(update={"max_seq": args.max_seq})
    check_seq(model, args.seq)
    return model, resolve_system(args.hardware)


def cmd_estimate(args) -> int:
    from paratrain.plan.api import Layout, estimate

    model, system = _load(args)
    dp_kind = args.dp_kind
    zero = args.zero_stage if args.zero_stage is not None else (1 if dp_kind == "ddp" else 3)
    v = args.virtual_stages if args.virtual_stages is not None else (2 if args.schedule == "zbv" else 1)
    layout = Layout(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, sp=args.sp, microbatch=args.microbatch,
                    recompute=args.recompute, schedule=args.schedule, virtual_stages=v, zero_stage=zero,
                    dp_kind=dp_kind, pp_layers=_pp_layers(args.pp_layers))
    est = estimate(model, system, args.nodes, args.seq, args.global_batch, layout, _options(args, system),
                   stack=args.stack, train_tokens=args.train_tokens)
    if args.write_config:
        _write(args, est, model, system)
    if args.json:
        print(json.dumps(_clean(est.to_dict()), indent=2))
    else:
        _print_estimate(est)
    return 0


def _pp_layers(text: str) -> str | tuple[int, ...]:
    """--pp-layers: 'auto', 'balanced', or comma-separated counts ('8,9,8,7' or '[8, 9, 8, 7]')."""
    from paratrain.cli import UserError

    if text in ("auto", "balanced"):
        return text
    try:
        return tuple(int(n) for n in text.strip("[] ").split(","))
    except ValueError:
        raise UserError(f"--pp-layers = {text!r}: allowed: auto, balanced, or layer counts per stage such as "
                        f"8,9,8,7") from None


def cmd_plan(args) -> int:
    from paratrain.cli import UserError
    from paratrain.plan.api import search

    model, system = _load(args)
    if args.top < 1:
        raise UserError(f"--top = {args.top}: must be >= 1")
    if args.max_microbatch < 1:
        raise UserError(f"--max-microbatch = {args.max_microbatch}: must be >= 1")
    if args.max_days is not None and not args.max_days > 0:
        raise UserError(f"--max-days = {args.max_days}: must be > 0")

    if args.max_days is not None and not args.train_tokens:
        raise UserError("--max-days needs --train-tokens (how many tokens the run trains)")
    result = search(model, system, args.nodes, args.seq, args.global_batch, top=args.top,
                    objective=args.objective, options=_options(args, system), max_microbatch=args.max_microbatch,
                    train_tokens=args.train_tokens, any_stack=args.any_stack, stack=args.stack,
                    max_time_s=None if args.max_days is None else args.max_days * 86400)
    if not result.candidates:
        devices = args.nodes * system.devices_per_node
        where = f"{model.name} on {args.nodes} x {system.name} ({devices} devices), seq {args.seq}, global batch {args.global_batch}"
        if result.valid == 0:
            raise UserError(f"no valid layout for {where}: tp must divide heads and ffn, pp the layers, tp*pp*cp the "
                            "devices, and dp * microbatch the global batch; try a global batch with more factors in "
                            "common with the device count, or another node count")
        raise UserError(f"none of the {result.valid} valid layouts for {where} fits in memory (or the --max-days "
                        "limit): try more nodes or --any-stack (FSDP)")
    best = result.candidates[0]
    if args.write_config:
        _write(args, best, model, system)
    searched = args.stack or ("any" if args.any_stack or system.stack is None else system.stack.name)
    search_info = {"stack": searched, "combinations": result.combinations, "evaluated": result.valid,
                   "fitting": result.fitting,
                   "seconds": result.seconds, "configs_per_s": result.configs_per_s, "objective": args.objective}
    if args.json:
        print(json.dumps(_clean({"best": best.to_dict(), "candidates": [c.to_dict() for c in result.candidates],
                                 "search": search_info}), indent=2))
    else:
        _print_plan(result, search_info)
    return 0


def _write(args, est, model, system) -> None:
    from paratrain.plan.config_writer import write_training_config

    path = write_training_config(args.write_config, est, model, args.model, system.devices_per_node, args.hardware)
    if not args.json:
        print(f"wrote {path}")


def _clean(obj):
    """JSON-safe: NaN/inf become null; schedule is also exposed under layout for consumers."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def _print_estimate(est) -> None:
    from paratrain.plan.stages import describe

    lay = est.layout
    print(f"{est.model} on {est.nodes} x {est.system} ({est.devices} devices), seq {est.seq}, "
          f"global batch {est.global_batch}")
    print(f"layout: tp {lay.tp}  pp {lay.pp}  dp {lay.dp}  cp {lay.cp}  sp {'on' if lay.sp else 'off'}  "
          f"microbatch {lay.microbatch} ({est.microbatches} per step)  recompute {lay.recompute}  "
          f"schedule {lay.schedule} (v={lay.virtual_stages})  {lay.dp_kind} zero-{lay.zero_stage}")
    if lay.pp > 1:
        kind = "balanced" if est.balanced_step_time_s is None else \
            f"uneven; balanced would take {est.balanced_step_time_s:.4f} s"
        print(f"layers per stage {describe(lay.pp_layers)} ({kind})")
    print(f"step time        {est.step_time_s:.4f} s    tokens/s {est.tokens_per_s:,.0f}")
    print(f"MFU {est.mfu:.1%}   HFU {est.hfu:.1%}   bubble {est.bubble_fraction:.1%}   (causal attention FLOPs; "
          f"full-square convention of Narayanan/PaLM: MFU {est.mfu_full_attention:.1%})")
    print(f"memory/device    {_gib(est.memory_per_device_bytes)} of {_gib(est.memory_capacity_bytes)} usable "
          f"({'fits' if est.fits else 'DOES NOT FIT'})")
    print("  " + "  ".join(f"{k} {_gib(v)}" for k, v in est.memory_breakdown_bytes.items()))
    print("time breakdown per step (s):")
    print("  " + "  ".join(f"{k} {v:.4f}" for k, v in est.time_breakdown_s.items() if v))
    if est.cost_usd_per_hour is not None:
        print(f"cost             ${est.cost_usd_per_hour:,.2f}/h   ${est.cost_usd_per_million_tokens:.4f} per M tokens")
    if est.time_to_train_s is not None:
        cost = "" if est.cost_usd_per_run is None else f", ${est.cost_usd_per_run:,.0f}"
        print(f"run              {est.time_to_train_s / 86400:.2f} days{cost}")
    for note in est.notes:
        print(f"note: {note}")


def _print_plan(result, info) -> None:
    best = result.candidates[0]
    print(f"{best.model} on {best.nodes} x {best.system} (stack: {info['stack']}): {info['combinations']:,} combinations, "
          f"{info['evaluated']:,} valid layouts evaluated, {info['fitting']:,} fit; {info['seconds'] * 1000:.0f} ms "
          f"({info['configs_per_s']:,.0f} layouts/s)")
    head = (f"{'#':>2} {'nodes':>5} {'tp':>3} {'pp':>3} {'dp':>6} {'cp':>2} {'sp':>3} {'mb':>3} {'recompute':>9} "
            f"{'schedule':>16} {'v':>2} {'dp_kind':>7} {'Z':>1} {'step s':>9} {'MFU':>6} {'GiB/dev':>8} {'$/Mtok':>8}")
    print(head)
    for i, c in enumerate(result.candidates, 1):
        lay = c.layout
        cost = "-" if c.cost_usd_per_million_tokens is None else f"{c.cost_usd_per_million_tokens:.3f}"
        print(f"{i:>2} {c.nodes:>5} {lay.tp:>3} {lay.pp:>3} {lay.dp:>6} {lay.cp:>2} {'on' if lay.sp else 'off':>3} "
              f"{lay.microbatch:>3} {lay.recompute:>9} {lay.schedule:>16} {lay.virtual_stages:>2} {lay.dp_kind:>7} "
              f"{lay.zero_stage:>1} {c.step_time_s:>9.4f} {c.mfu:>6.1%} {c.memory_per_device_bytes / 2**30:>8.2f} {cost:>8}")
    print()
    _print_estimate(best)
