"""The text tables of `paratrain estimate` and `paratrain plan`."""

from __future__ import annotations

from paratrain.config.ranks import DEFAULT_RANK_ORDER


def why_nothing_fits(result, model, system, nodes: int, seq: int, global_batch: int) -> str:
    """Why a search found no candidate: no valid layout at all, or none that fits in memory (or the deadline)."""
    where = (f"{model.name} on {nodes} x {system.name} ({nodes * system.devices_per_node} devices), seq {seq}, "
             f"global batch {global_batch}")
    if result.valid == 0:
        return (f"no valid layout for {where}: tp must divide heads and ffn, pp the layers, tp*pp*cp the devices, "
                "and dp * microbatch the global batch; try a global batch with more factors in common with the "
                "device count, or another node count")
    return (f"none of the {result.valid} valid layouts for {where} fits in memory (or the --max-days limit): try "
            "more nodes or --any-stack (FSDP)")


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def print_estimate(est) -> None:
    from paratrain.plan.stages import describe

    lay = est.layout
    print(f"{est.model} on {est.nodes} x {est.system} ({est.devices} devices), seq {est.seq}, "
          f"global batch {est.global_batch}")
    print(f"layout: tp {lay.tp}  pp {lay.pp}  dp {lay.dp}  cp {lay.cp}  sp {'on' if lay.sp else 'off'}  "
          f"microbatch {lay.microbatch} ({est.microbatches} per step)  recompute {lay.recompute}"
          f"{' (+ MLP)' if est.recompute_mlp else ''}  "
          f"schedule {lay.pp_schedule} (v={lay.virtual_stages})  {lay.dp_kind} zero-{lay.zero_stage}"
          + (f"  ep {lay.ep} etp {lay.etp}" if lay.ep > 1 or lay.etp > 1 else "")
          + (f"  ranks {lay.rank_order}" if lay.rank_order != DEFAULT_RANK_ORDER else "")
          + (f"  offload {lay.offload_layers} blocks/stage to host" if lay.offload_layers else ""))
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


def runner_up_difference(best, second, parts: int = 3) -> str:
    """Why #1 ranks above #2, in the step-time breakdown's own terms: the step difference and the `parts` components
    that differ most between them (each at least 1% of #1's step), signed as #2 minus #1."""
    a, b = best.time_breakdown_s, second.time_breakdown_s
    deltas = sorted(((k, b.get(k, 0.0) - a.get(k, 0.0)) for k in set(a) | set(b)), key=lambda kv: -abs(kv[1]))
    shown = [f"{k} {d:+.3f}" for k, d in deltas[:parts] if abs(d) >= 0.01 * best.step_time_s]
    gap = second.step_time_s - best.step_time_s
    return (f"#2 is {gap:+.4f} s per step ({gap / best.step_time_s:+.1%})"
            + (f": {', '.join(shown)} s" if shown else ": no component differs by 1% of the step"))


def print_plan(result, info, experts: bool = False) -> None:
    """The ranked table, then the best layout in full. `experts` (a MoE model): ep and etp columns, which the
    search varies too (without them two rows of one table can read the same)."""
    best = result.candidates[0]
    offload = any(c.layout.offload_layers for c in result.candidates)  # the column only where a layout offloads
    print(f"{best.model} on {best.nodes} x {best.system} (stack: {info['stack']}): {info['combinations']:,} combinations, "
          f"{info['evaluated']:,} valid layouts evaluated, {info['fitting']:,} fit; {info['seconds'] * 1000:.0f} ms "
          f"({info['configs_per_s']:,.0f} layouts/s)")
    head = (f"{'#':>2} {'nodes':>5} {'tp':>3} {'pp':>3} {'dp':>6} {'cp':>2} {'sp':>3} "
            + (f"{'ep':>3} {'etp':>3} " if experts else "")
            + f"{'mb':>3} {'recompute':>9} " + (f"{'off':>3} " if offload else "")
            + f"{'pp_schedule':>16} {'v':>2} {'dp_kind':>7} {'Z':>1} {'step s':>9} {'MFU':>6} {'GiB/dev':>8} {'$/Mtok':>8}")
    print(head)
    for i, c in enumerate(result.candidates, 1):
        lay = c.layout
        cost = "-" if c.cost_usd_per_million_tokens is None else f"{c.cost_usd_per_million_tokens:.3f}"
        print(f"{i:>2} {c.nodes:>5} {lay.tp:>3} {lay.pp:>3} {lay.dp:>6} {lay.cp:>2} {'on' if lay.sp else 'off':>3} "
              + (f"{lay.ep:>3} {lay.etp:>3} " if experts else "")
              + f"{lay.microbatch:>3} {'sel+mlp' if c.recompute_mlp else lay.recompute:>9} "
              + (f"{lay.offload_layers:>3} " if offload else "") + f"{lay.pp_schedule:>16} {lay.virtual_stages:>2} {lay.dp_kind:>7} "
              f"{lay.zero_stage:>1} {c.step_time_s:>9.4f} {c.mfu:>6.1%} {c.memory_per_device_bytes / 2**30:>8.2f} {cost:>8}")
    if len(result.candidates) > 1:
        print(f"note: {runner_up_difference(best, result.candidates[1])}")
    if info.get("ties_with_best"):
        ranks = ", ".join(f"#{r}" for r in info["ties_with_best"])
        what = "step time" if info.get("objective", "time") == "time" else "cost per token"
        print(f"note: {ranks} within {info['tie_fraction']:.0%} of #1's {what}: a tie at the planner's resolution "
              f"(docs/planner.md, 'The planner as a chooser'); measure the tied layouts on the cluster before committing")
    print()
    print_estimate(best)
