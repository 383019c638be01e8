"""`paratrain launch`: run `paratrain train` on one node of a multi-node job through torchrun."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from paratrain import cli
from paratrain.cli import ConfigArgs, Output, RunFiles, command, opt, options_of, show
from paratrain.launch import torchrun as tr
from paratrain.launch.torchrun import LaunchSpec

NODES, RDZV = "nodes and processes", "rendezvous and restarts"
RDZV_KEYS = ("rdzv_endpoint", "rdzv_id", "rdzv_backend", "rdzv_conf", "max_restarts", "monitor_interval_s")


def merge_extra(args) -> None:
    """Fold `paratrain train` arguments given after `--` into args, so the layout check sees the same config
    the workers will load."""
    p = argparse.ArgumentParser(prog="paratrain launch ... --", add_help=False)
    for cls in (ConfigArgs, RunFiles):  # train's own options (those launch passes on), and its config keys
        cli.add_options(p, cls)
    cli.add_config_keys(p)
    known, rest = p.parse_known_args(args.extra[1:] if args.extra[:1] == ["--"] else args.extra)
    if rest:
        raise ValueError(f"arguments after --: {' '.join(rest)}: allowed: paratrain train's --config, --set, "
                         "--SECTION.KEY, --resume-from, --summary-json")
    for name in ("config", "resume_from", "summary_json"):
        mine, theirs = getattr(args, name), getattr(known, name)
        if mine and theirs and mine != theirs:
            raise ValueError(f"--{name.replace('_', '-')} given twice ('{mine}' and '{theirs}' after --)")
        setattr(args, name, mine or theirs)
    args.set, args.extra = [*args.set, *known.set], []


# the torchrun options of LaunchSpec (launch/torchrun.py); node counts as given (resolved at launch)
@command("launch", (ConfigArgs, RunFiles, Output, options_of(LaunchSpec, ("local_addr", "ifname"), group="network"),
                    options_of(LaunchSpec, RDZV_KEYS, group=RDZV), options_of(LaunchSpec, ("node_rank",), group=NODES)),
         "run training on one node of a multi-node job (torchrun wrapper)",
         nnodes=(str, opt("node count N, or MIN:MAX for an elastic job", "1", env="PET_NNODES", group=NODES)),
         nproc_per_node=(str, opt("processes per node: a number, 'gpu' (one per accelerator device: CUDA GPU, "
                                  "logical NeuronCore), 'auto' (one per accelerator device, else 1), or a catalog "
                                  "system (its devices per node, e.g. trn2.48xlarge: 64)", "auto",
                                  env="PET_NPROC_PER_NODE", group=NODES)),
         hybrid_shard=(bool, opt("HSDP across nodes: parallel.dp_kind=hsdp, dp_replicate = nnodes (nnodes/pp)")),
         dry_run=(bool, opt("print the torchrun command and placement; run nothing")),
         extra=(list[str], opt("more `paratrain train` arguments, after --", positional=True, nargs="*",
                               factory=list)))
def run_launch(args) -> None:
    if args.json and not args.dry_run:
        raise ValueError("--json: allowed only with --dry-run (a real launch hands the terminal to torchrun)")
    merge_extra(args)
    rdzv_conf = args.rdzv_conf or [c for c in os.environ.get("PET_RDZV_CONF", "").split(",") if c]
    nnodes, nproc = tr.parse_nnodes(args.nnodes), tr.resolve_nproc(args.nproc_per_node)
    cfg, extra_sets = tr.resolve_config(args.config, args.set, args.hybrid_shard, nnodes, nproc)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(LaunchSpec) if hasattr(args, f.name)}
    spec = LaunchSpec(**given | {"nnodes": nnodes, "nproc_per_node": nproc, "rdzv_conf": rdzv_conf,
                                 "train_args": tr.train_arguments(args.config, [*args.set, *extra_sets],
                                                                  args.resume_from, args.summary_json)})
    cmd = tr.build_command(spec)  # validates the flags
    layouts = tr.check_layout(cfg, nnodes, nproc)  # validates the layout for every allowed node count
    env, warnings = tr.launch_env(spec), tr.warnings_for(cfg, spec)
    if args.dry_run:
        return show(args, {"command": cmd, "env": env, "mode": spec.mode(), "nnodes": str(nnodes),
                           "nproc_per_node": nproc, "placement": {str(k): v for k, v in layouts.items()},
                           "warnings": warnings},
                    lambda: (tr.print_placement(layouts, nproc, warnings), print(tr.shell_line(cmd, env))))
    tr.print_placement(layouts, nproc, warnings)
    print(f"paratrain launch: exec {tr.shell_line(cmd, env)}", file=sys.stderr, flush=True)
    # exec, not a child: the scheduler's SIGTERM then reaches torchrun, which stops its workers cleanly.
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
