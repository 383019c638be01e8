"""`paratrain launch`: run `paratrain train` on one node of a multi-node job through torchrun."""

from __future__ import annotations

import os
import sys

from paratrain import cli
from paratrain.cli import ConfigArgs, Output, RunFiles, command, opt, options_of, show
from paratrain.launch import torchrun as tr
from paratrain.launch.torchrun import NODES, LaunchSpec


def merge_extra(args) -> None:
    """Fold `paratrain train` arguments given after `--` into args, so the layout check sees the same config
    the workers will load."""
    p = cli.OneLineParser(prog="paratrain launch ... --", add_help=False)
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
@command("launch", (ConfigArgs, RunFiles, Output, options_of(LaunchSpec)),
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
    out = tr.prepare(args)
    if not args.json:
        tr.print_placement(out["placement"], out["nproc_per_node"], out["warnings"])
    if args.dry_run:
        return show(args, out, lambda: print(tr.shell_line(out["command"], out["env"])))
    print(f"paratrain launch: exec {tr.shell_line(out['command'], out['env'])}", file=sys.stderr, flush=True)
    # exec, not a child: the scheduler's SIGTERM then reaches torchrun, which stops its workers cleanly.
    os.execvpe(out["command"][0], out["command"], {**os.environ, **out["env"]})
