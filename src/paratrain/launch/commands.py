"""`paratrain launch`: run `paratrain train` on one node of a multi-node job through torchrun."""

from __future__ import annotations

import argparse
import json
import os
import sys

from paratrain.launch.torchrun import (
    LaunchSpec,
    build_command,
    check_layout,
    hybrid_shard_replicas,
    launch_env,
    parse_nnodes,
    shell_line,
)

HELP = """\
Run `paratrain train` on this node through torchrun (torch.distributed.run). Start the same command on
every node; torchrun rendezvouses the nodes, numbers the ranks node by node and restarts workers after a
failure. Use --dry-run to see the exact torchrun command instead of running it.

Placement: ranks fill a node before the next one, and tp is the innermost mesh dimension, so with
--nproc-per-node a multiple of parallel.tp every tensor-parallel group stays inside a node; dp and pp
span nodes. A layout that would put a TP group across hosts is refused.

examples:
  # one node, 8 processes (same as torchrun --standalone)
  paratrain launch --nproc-per-node 8 -- --config configs/tiny.toml --set parallel.tp=2 --set train.microbatch=4

  # 4 nodes, elastic c10d rendezvous on node001 (run on every node, same command)
  paratrain launch --nnodes 4 --nproc-per-node 8 --rdzv-endpoint node001:29400 --rdzv-id $JOB_ID \\
      -- --config run.toml --set parallel.tp=8

  # survive node loss: 2..4 nodes, 3 restarts, resume from the newest checkpoint (checkpoint.interval > 0,
  # checkpoint.dir on storage every node sees: shared file system or s3://)
  paratrain launch --nnodes 2:4 --nproc-per-node 8 --rdzv-endpoint node001:29400 --rdzv-id $JOB_ID \\
      --max-restarts 3 -- --config run.toml --set checkpoint.interval=100

  # static ranks (no elasticity), e.g. when a scheduler hands out node ranks
  paratrain launch --nnodes 2 --node-rank $NODE_RANK --rdzv-endpoint $MASTER_ADDR:29500 --nproc-per-node 8 \\
      -- --config run.toml

  # hybrid sharding: FSDP shards inside each node, replicas across nodes (dp_kind=hsdp, dp_replicate=nnodes)
  paratrain launch --nnodes 4 --nproc-per-node 8 --rdzv-endpoint node001:29400 --hybrid-shard -- --config run.toml

Defaults come from torchrun's own PET_* variables when set (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_RDZV_ENDPOINT, PET_RDZV_ID, PET_RDZV_BACKEND, PET_RDZV_CONF, PET_MAX_RESTARTS), which the Kubeflow
training operator sets in every PyTorchJob pod: there `paratrain launch -- --config run.toml` is enough.

Arguments after `--` (or the --config/--set given here) go to `paratrain train`. Cluster recipes (Slurm,
Kubernetes, AWS trn1/p5) are in recipes/ and explained in docs/multinode.md.
"""


def pet(name: str, default=None):
    """torchrun's environment default for a flag (PET_<NAME>), as the Kubeflow training operator sets them."""
    return os.environ.get(f"PET_{name}", default)


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="run training on one node of a multi-node job (torchrun wrapper)",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("nodes and processes")
    g.add_argument("--nnodes", default=pet("NNODES", "1"), help="node count N, or MIN:MAX for an elastic job (default 1)")
    g.add_argument("--nproc-per-node", default=pet("NPROC_PER_NODE", "auto"),
                   help="processes per node: a number, 'gpu' (one per accelerator device: CUDA GPU, logical "
                        "NeuronCore), 'auto' (default: one per accelerator device, else 1), or a catalog system "
                        "(its devices per node, e.g. trn2.48xlarge: 64)")
    g.add_argument("--node-rank", type=int, default=pet("NODE_RANK"),
                   help="this node's rank for a static (non-elastic) rendezvous; omit for c10d")
    r = p.add_argument_group("rendezvous and restarts")
    r.add_argument("--rdzv-endpoint", default=pet("RDZV_ENDPOINT"), help="HOST[:PORT] of the rendezvous (c10d store; or the master for static)")
    r.add_argument("--rdzv-id", default=pet("RDZV_ID", "paratrain"), help="job id shared by all nodes of one job")
    r.add_argument("--rdzv-backend", default=pet("RDZV_BACKEND", "c10d"), choices=["c10d", "etcd-v2"],
                   help="elastic rendezvous backend (default c10d: no extra service)")
    r.add_argument("--rdzv-conf", action="append", default=None, metavar="KEY=VALUE",
                   help="rendezvous option, repeatable: join_timeout=900, last_call_timeout=30, is_host=1, ...")
    r.add_argument("--max-restarts", type=int, default=pet("MAX_RESTARTS", 0),
                   help="worker-group restarts before the job fails (default 0); each restart resumes from "
                        "the newest complete checkpoint")
    r.add_argument("--monitor-interval", type=float, default=None, help="seconds between worker health checks")
    n = p.add_argument_group("network")
    n.add_argument("--local-addr", help="address this node advertises to the others (default: its FQDN)")
    n.add_argument("--ifname", help="network interface for gloo/NCCL bootstrap (sets GLOO_SOCKET_IFNAME and "
                                    "NCCL_SOCKET_IFNAME), e.g. eth0 or ens5")
    t = p.add_argument_group("training")
    t.add_argument("--config", "-c", help="TOML config for `paratrain train`")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for `paratrain train` (repeatable)")
    t.add_argument("--hybrid-shard", action="store_true",
                   help="HSDP across nodes: parallel.dp_kind=hsdp, dp_replicate = nnodes (nnodes/pp)")
    t.add_argument("--resume-from", help="passed to `paratrain train --resume-from`")
    t.add_argument("--summary-json", help="passed to `paratrain train --summary-json`")
    o = p.add_argument_group("output")
    o.add_argument("--dry-run", action="store_true", help="print the torchrun command and placement; run nothing")
    o.add_argument("--json", action="store_true", help="with --dry-run: print command, env and placement as JSON")
    p.add_argument("extra", nargs="*", help="more `paratrain train` arguments, after --")
    p.set_defaults(func=run_launch)


def resolve_nproc(text: str) -> int:
    if str(text).isdigit() and int(text) >= 1:
        return int(text)
    if text in ("auto", "gpu"):
        from paratrain.device import accelerator_count

        gpus = accelerator_count()  # cuda, neuron (logical NeuronCores) or any torch.accelerator
        if text == "gpu" and not gpus:
            raise ValueError("--nproc-per-node=gpu: this torch build sees no accelerator device; give a number")
        return gpus or 1
    from paratrain.hardware.catalog import get_catalog

    systems = get_catalog().systems
    if text in systems:  # ranks per node from the catalog: one per device unit (GPU, logical NeuronCore)
        return systems[text].devices_per_node
    raise ValueError(f"--nproc-per-node='{text}': allowed: a number >= 1, 'gpu', 'auto' (the accelerators torch "
                     f"sees) or a catalog system (its devices per node, e.g. trn2.48xlarge = "
                     f"{systems['trn2.48xlarge'].devices_per_node})")


def merge_extra(args) -> None:
    """Fold `paratrain train` arguments given after `--` into args, so the layout check sees the same config
    the workers will load."""
    extra = list(args.extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    p = argparse.ArgumentParser(prog="paratrain launch ... --", add_help=False)
    p.add_argument("--config", "-c")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--resume-from")
    p.add_argument("--summary-json")
    known, rest = p.parse_known_args(extra)
    if rest:
        raise ValueError(f"arguments after --: {' '.join(rest)}: allowed: paratrain train's --config, --set, "
                         "--resume-from, --summary-json")
    for name in ("config", "resume_from", "summary_json"):
        mine, theirs = getattr(args, name), getattr(known, name)
        if mine and theirs and mine != theirs:
            raise ValueError(f"--{name.replace('_', '-')} given twice ('{mine}' and '{theirs}' after --)")
        setattr(args, name, mine or theirs)
    args.set = [*args.set, *known.set]
    args.extra = []


def train_arguments(args, extra_sets: list[str]) -> list[str]:
    out = ["--config", args.config] if args.config else []
    for item in [*args.set, *extra_sets]:
        out += ["--set", item]
    if args.resume_from:
        out += ["--resume-from", args.resume_from]
    if args.summary_json:
        out += ["--summary-json", args.summary_json]
    return out


def resolve_config(args, nnodes, nproc: int):
    """The training config as the workers will load it, plus the overrides --hybrid-shard adds."""
    from paratrain.config import load_config

    cfg = load_config(args.config, args.set)
    if not args.hybrid_shard:
        return cfg, []
    if nnodes.elastic:
        raise ValueError(f"--hybrid-shard with --nnodes={nnodes}: dp_replicate is fixed when the job starts, "
                         "so the node count cannot change; use a fixed --nnodes or plain FSDP for elastic jobs")
    replicas = hybrid_shard_replicas(cfg, nnodes.max_nodes, nproc)
    sets = ['parallel.dp_kind="hsdp"', f"parallel.dp_replicate={replicas}"]
    return load_config(args.config, [*args.set, *sets]), sets


def warnings_for(cfg, spec: LaunchSpec) -> list[str]:
    notes = []
    if spec.max_restarts and not cfg.checkpoint.interval:
        notes.append("--max-restarts without checkpoint.interval: a restart begins again from step 0 "
                     "(set checkpoint.interval to resume from the newest checkpoint)")
    if spec.nnodes.max_nodes > 1 and cfg.checkpoint.resume == "auto" and not cfg.checkpoint.dir.startswith("s3://"):
        notes.append(f"checkpoints go to '{cfg.checkpoint.dir or cfg.metrics.run_dir + '/checkpoints'}': every "
                     "node must see the same folder (shared file system) for a restart to resume")
    return notes


def run_launch(args) -> int:
    if args.json and not args.dry_run:
        raise ValueError("--json: allowed only with --dry-run (a real launch hands the terminal to torchrun)")
    merge_extra(args)
    if args.rdzv_conf is None:  # argparse appends to a list default, so the env default is applied here
        args.rdzv_conf = [c for c in pet("RDZV_CONF", "").split(",") if c]
    nnodes = parse_nnodes(args.nnodes)
    nproc = resolve_nproc(args.nproc_per_node)
    cfg, extra_sets = resolve_config(args, nnodes, nproc)
    spec = LaunchSpec(nnodes=nnodes, nproc_per_node=nproc, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, rdzv_backend=args.rdzv_backend,
                      rdzv_conf=args.rdzv_conf, max_restarts=args.max_restarts,
                      monitor_interval_s=args.monitor_interval, local_addr=args.local_addr, ifname=args.ifname,
                      train_args=train_arguments(args, extra_sets))
    cmd = build_command(spec)  # validates the flags
    layouts = check_layout(cfg, nnodes, nproc)  # validates the layout for every allowed node count
    env = launch_env(spec)
    if args.dry_run and args.json:
        print(json.dumps({"command": cmd, "env": env, "mode": spec.mode(), "nnodes": str(nnodes),
                          "nproc_per_node": nproc, "placement": {str(k): v for k, v in layouts.items()},
                          "warnings": warnings_for(cfg, spec)}, indent=2))
        return 0
    for n, place in layouts.items():
        shown = ", ".join(f"{d}: {where}" for d, where in place.items()) or "one rank, no parallel groups"
        print(f"paratrain launch: {n} node(s) x {nproc}: {shown}", file=sys.stderr)
    for note in warnings_for(cfg, spec):
        print(f"paratrain launch: note: {note}", file=sys.stderr)
    if args.dry_run:
        print(shell_line(cmd, env))
        return 0
    print(f"paratrain launch: exec {shell_line(cmd, env)}", file=sys.stderr, flush=True)
    # exec, not a child: the scheduler's SIGTERM then reaches torchrun, which stops its workers cleanly.
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached
