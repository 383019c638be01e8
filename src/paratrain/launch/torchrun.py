"""Build the torchrun (`torch.distributed.run`) invocation for one node, and check the layout fits the nodes.

paratrain does not have its own launcher: every node runs torchrun, which rendezvouses the nodes (c10d, or a
static master address), numbers the ranks node by node (node k holds global ranks k*P .. k*P+P-1 for P
processes per node), restarts the workers after a failure and sets RANK/WORLD_SIZE/MASTER_ADDR for
`paratrain train`. This module only decides the flags and refuses a layout that would put a tensor-parallel
group across hosts, before any process starts.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field, fields

import numpy as np

from paratrain.config import MESH_DIMS, TrainConfig, check_batch_layout, resolve_degrees
from paratrain.config.options import described
from paratrain.config.ranks import DEFAULT_RANK_ORDER, expand_hsdp, mesh_ranks, order_dims

DEFAULT_RDZV_PORT = 29400  # torchrun's default c10d rendezvous port
DEFAULT_MASTER_PORT = 29500  # torchrun's default static master port
NODES, RDZV = "nodes and processes", "rendezvous and restarts"  # sections of `paratrain launch --help`


@dataclass(frozen=True)
class NodeRange:
    """--nnodes: a fixed count N, or an elastic range MIN:MAX."""

    min_nodes: int
    max_nodes: int

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    def __str__(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}" if self.elastic else str(self.min_nodes)

    def counts(self) -> range:
        return range(self.min_nodes, self.max_nodes + 1)


def parse_nnodes(text: str) -> NodeRange:
    try:
        lo, _, hi = str(text).partition(":")
        rng = NodeRange(int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"--nnodes='{text}': allowed: a node count N or an elastic range MIN:MAX, "
                         "e.g. 4 or 2:4") from None
    if rng.min_nodes < 1 or rng.max_nodes < rng.min_nodes:
        raise ValueError(f"--nnodes='{text}': allowed: 1 <= MIN <= MAX")
    return rng


def parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint='{text}': allowed: HOST[:PORT] with a port in 1..65535, "
                         f"e.g. node001:{default_port}")
    return host, int(port)


@dataclass
class LaunchSpec:
    """Everything torchrun needs on one node. `train_args` go to `paratrain train` unchanged."""

    nnodes: NodeRange
    nproc_per_node: int
    # Each field's help is its `paratrain launch` option's, in its help section (group); env: torchrun's variable
    # that is its default when set.
    node_rank: int | None = described(  # set = static rendezvous (every node knows its rank)
        "this node's rank for a static (non-elastic) rendezvous; omit for c10d", None, env="PET_NODE_RANK", group=NODES)
    rdzv_endpoint: str | None = described("HOST[:PORT] of the rendezvous (c10d store; or the master for static)", None,
                                          env="PET_RDZV_ENDPOINT", group=RDZV)
    rdzv_id: str = described("job id shared by all nodes of one job", "paratrain", env="PET_RDZV_ID", group=RDZV)
    rdzv_backend: str = described("elastic rendezvous backend (c10d: no extra service)", "c10d", env="PET_RDZV_BACKEND",
                                  choices=["c10d", "etcd-v2"], group=RDZV)
    rdzv_conf: list[str] = described("rendezvous option, repeatable: join_timeout=900, last_call_timeout=30, is_host=1, "
                                     "... (default: PET_RDZV_CONF, comma-separated)", factory=list, metavar="KEY=VALUE",
                                     group=RDZV)
    max_restarts: int = described("worker-group restarts before the job fails; each restart resumes from the newest "
                                  "complete checkpoint", 0, env="PET_MAX_RESTARTS", group=RDZV)
    monitor_interval_s: float | None = described("time between worker health checks", None, group=RDZV)
    local_addr: str | None = described("address this node advertises to the others (default: its FQDN)", None,
                                       group="network")
    ifname: str | None = described("network interface for gloo/NCCL bootstrap (sets GLOO_SOCKET_IFNAME and "
                                   "NCCL_SOCKET_IFNAME), e.g. eth0 or ens5", None, group="network")
    train_args: list[str] = field(default_factory=list)
    python: str = sys.executable

    def mode(self) -> str:
        if self.node_rank is not None:
            return "static"
        if self.nnodes.max_nodes == 1 and not self.rdzv_endpoint:
            return "standalone"
        return "elastic"


def validate_spec(spec: LaunchSpec) -> None:
    """Flag combinations torchrun would reject late or silently misuse, refused up front."""
    if spec.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={spec.nproc_per_node}: allowed: >= 1")
    if spec.max_restarts < 0:
        raise ValueError(f"--max-restarts={spec.max_restarts}: allowed: >= 0")
    if spec.monitor_interval_s is not None and not spec.monitor_interval_s > 0:
        raise ValueError(f"--monitor-interval-s={spec.monitor_interval_s}: allowed: seconds > 0")
    if spec.node_rank is not None:
        if spec.nnodes.elastic:
            raise ValueError(f"--node-rank with --nnodes={spec.nnodes}: a fixed node rank needs a fixed node "
                             "count; for an elastic range drop --node-rank (c10d assigns ranks)")
        if not 0 <= spec.node_rank < spec.nnodes.max_nodes:
            raise ValueError(f"--node-rank={spec.node_rank}: allowed: 0..{spec.nnodes.max_nodes - 1}")
    multi = spec.nnodes.max_nodes > 1
    if multi and not spec.rdzv_endpoint:
        raise ValueError(f"--nnodes={spec.nnodes} needs --rdzv-endpoint HOST:PORT (a host every node can reach, "
                         "usually the first node)")
    if spec.rdzv_endpoint:
        parse_endpoint(spec.rdzv_endpoint, DEFAULT_RDZV_PORT)
    for item in spec.rdzv_conf:
        if "=" not in item:
            raise ValueError(f"--rdzv-conf='{item}': allowed: KEY=VALUE, e.g. join_timeout=900")


def build_command(spec: LaunchSpec) -> list[str]:
    """The exact torchrun command line for this node."""
    validate_spec(spec)
    cmd = [spec.python, "-m", "torch.distributed.run"]
    mode = spec.mode()
    if mode == "standalone":
        cmd += ["--standalone", "--nnodes", "1"]
    elif mode == "static":
        host, port = parse_endpoint(spec.rdzv_endpoint, DEFAULT_MASTER_PORT)
        cmd += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
                "--master-addr", host, "--master-port", str(port)]
    else:
        cmd += ["--nnodes", str(spec.nnodes), "--rdzv-backend", spec.rdzv_backend,
                "--rdzv-endpoint", spec.rdzv_endpoint, "--rdzv-id", spec.rdzv_id]
        if spec.rdzv_conf:
            cmd += ["--rdzv-conf", ",".join(spec.rdzv_conf)]
    cmd += ["--nproc-per-node", str(spec.nproc_per_node), "--max-restarts", str(spec.max_restarts)]
    if spec.monitor_interval_s is not None:
        cmd += ["--monitor-interval", str(spec.monitor_interval_s)]
    if spec.local_addr:
        cmd += ["--local-addr", spec.local_addr]
    return cmd + ["-m", "paratrain", "train", *spec.train_args]


def launch_env(spec: LaunchSpec) -> dict[str, str]:
    """Environment additions for the workers: the network interface for gloo and NCCL's bootstrap sockets.

    Without them both libraries pick the interface that the hostname resolves to, which on multi-homed
    hosts (a management NIC beside the fabric, a container bridge) is often not the one the peers reach."""
    env = {}
    if spec.ifname:
        env["GLOO_SOCKET_IFNAME"] = spec.ifname
        env["NCCL_SOCKET_IFNAME"] = spec.ifname
    if spec.max_restarts and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        # torchrun's agent shares its c10d store with the workers by default, but a surviving rank-0 agent does
        # not republish MASTER_ADDR for a new rendezvous round, so a node that restarts and rejoins waits for it
        # forever (pytorch/pytorch#135712; seen here with torch 2.13). The opt-out gives each round a fresh
        # worker store.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # torchrun sets 1 too, but says so in a warning per node
    return env


def shell_line(cmd: list[str], env: dict[str, str]) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + shlex.join(cmd)


# ---- placement: which mesh groups stay inside a node -------------------------------------------------------


def rank_grid(dims: dict[str, int], rank_order: str = DEFAULT_RANK_ORDER) -> np.ndarray:
    """Global ranks laid out on the mesh whose axes are `dims` (their order), placed by `rank_order` as build_mesh
    places them (paratrain.config.ranks; the default is init_device_mesh's row-major grid)."""
    order = expand_hsdp(rank_order) if "dp_shard" in dims else order_dims(rank_order)
    return mesh_ranks(order, dims, tuple(dims))


def groups_crossing_nodes(dims: dict[str, int], dim: str, nproc_per_node: int,
                          rank_order: str = DEFAULT_RANK_ORDER) -> int:
    """How many process groups along `dim` contain ranks of more than one node."""
    grid = np.moveaxis(rank_grid(dims, rank_order), list(dims).index(dim), -1).reshape(-1, dims[dim])
    nodes = grid // nproc_per_node
    return int((nodes.min(axis=1) != nodes.max(axis=1)).sum())


def mesh_dims(cfg: TrainConfig, world_size: int) -> dict[str, int]:
    """The mesh axes paratrain builds for this world size (pp, dp, cp, tp: their names and sizes; which ranks
    sit where is parallel.rank_order); for HSDP the dp dimension is split into (dp_replicate, dp_shard), replicas
    outermost, as FSDP2's HSDP mesh is."""
    degrees = resolve_degrees(cfg.parallel, world_size)
    dims = {d: degrees[d] for d in MESH_DIMS}
    if cfg.parallel.dp_kind != "hsdp":
        return dims
    rep = cfg.parallel.dp_replicate
    if degrees["dp"] % rep:
        raise ValueError(f"parallel.dp_replicate={rep} must divide the data-parallel size {degrees['dp']} "
                         f"(world size {world_size})")
    return {"pp": dims["pp"], "dp_replicate": rep, "dp_shard": degrees["dp"] // rep, "cp": dims["cp"],
            "tp": dims["tp"]}


def placement(cfg: TrainConfig, nnodes: int, nproc_per_node: int) -> dict[str, str]:
    """For each mesh dimension of size > 1: 'intra-node' or 'across nodes' (some or all groups span hosts)."""
    dims = mesh_dims(cfg, nnodes * nproc_per_node)
    order = cfg.parallel.rank_order
    return {d: ("across nodes" if groups_crossing_nodes(dims, d, nproc_per_node, order) else "intra-node")
            for d, size in dims.items() if size > 1}


def hybrid_shard_replicas(cfg: TrainConfig, nnodes: int, nproc_per_node: int) -> int:
    """dp_replicate that makes each FSDP shard group exactly one node: nnodes for pp=1 (nnodes/pp in general)."""
    p = cfg.parallel
    inside_dp = order_dims(p.rank_order)[:order_dims(p.rank_order).index("dp")]
    if "pp" in inside_dp:  # the shard groups would interleave with the pipeline stages, not fill a node
        raise ValueError(f"--hybrid-shard with parallel.rank_order='{p.rank_order}': pp sits inside dp, so a node "
                         f"holds several stages' ranks, not whole shard groups; allowed: an order with dp inside pp "
                         f"(e.g. {DEFAULT_RANK_ORDER}), or parallel.dp_kind/dp_replicate set by hand")
    per_node = p.tp * p.cp
    if nproc_per_node % per_node:
        raise ValueError(f"--hybrid-shard: --nproc-per-node={nproc_per_node} must be a multiple of "
                         f"parallel.tp*parallel.cp = {per_node} so that one node holds whole shard groups")
    if nnodes % p.pp:
        raise ValueError(f"--hybrid-shard: --nnodes={nnodes} must be a multiple of parallel.pp={p.pp}")
    return nnodes // p.pp


def check_layout(cfg: TrainConfig, nnodes: NodeRange, nproc_per_node: int) -> dict[int, dict[str, str]]:
    """Refuse, with the reason, any node count in the range whose layout is invalid or splits a TP group
    across hosts. Returns the placement for each allowed node count."""
    tp = cfg.parallel.tp
    if nproc_per_node % tp:
        raise ValueError(
            f"parallel.tp={tp} with --nproc-per-node={nproc_per_node}: tensor-parallel groups would span hosts "
            f"(TP exchanges activations in every layer and needs the intra-node links); allowed: "
            f"--nproc-per-node a multiple of parallel.tp")
    out = {}
    for n in nnodes.counts():
        world = n * nproc_per_node
        try:
            degrees = resolve_degrees(cfg.parallel, world)
            check_batch_layout(cfg, degrees["dp"])
            out[n] = placement(cfg, n, nproc_per_node)
        except ValueError as exc:
            hint = " (every node count in an elastic range must give a valid layout)" if nnodes.elastic else ""
            raise ValueError(f"--nnodes={nnodes}: with {n} node(s) x {nproc_per_node} = {world} ranks: "
                             f"{exc}{hint}") from None
        if out[n].get("tp") == "across nodes":  # cannot happen while tp is innermost (the rank_order rule)
            raise ValueError(f"parallel.tp={tp}: parallel.rank_order='{cfg.parallel.rank_order}' would put TP "
                             f"groups across hosts")
    return out


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


def resolve_config(config: str | None, sets: list[str], hybrid_shard: bool, nnodes: NodeRange, nproc: int):
    """The training config as the workers will load it, plus the overrides --hybrid-shard adds."""
    from paratrain.config import load_config

    cfg = load_config(config, sets)
    if not hybrid_shard:
        return cfg, []
    if nnodes.elastic:
        raise ValueError(f"--hybrid-shard with --nnodes={nnodes}: dp_replicate is fixed when the job starts, "
                         "so the node count cannot change; use a fixed --nnodes or plain FSDP for elastic jobs")
    replicas = hybrid_shard_replicas(cfg, nnodes.max_nodes, nproc)
    hybrid = ['parallel.dp_kind="hsdp"', f"parallel.dp_replicate={replicas}"]
    return load_config(config, [*sets, *hybrid]), hybrid


def prepare(opts) -> dict:
    """One node's launch from `paratrain launch`'s options (each LaunchSpec field by its name), checked before
    anything runs: the torchrun command, its environment, the placement at every allowed node count, warnings."""
    nnodes, nproc = parse_nnodes(opts.nnodes), resolve_nproc(opts.nproc_per_node)
    cfg, hybrid = resolve_config(opts.config, opts.set, opts.hybrid_shard, nnodes, nproc)
    spec = LaunchSpec(**{f.name: getattr(opts, f.name) for f in fields(LaunchSpec) if hasattr(opts, f.name)} | {
        "nnodes": nnodes, "nproc_per_node": nproc, "train_args": train_arguments(
            opts.config, [*opts.set, *hybrid], opts.resume_from, opts.summary_json),
        "rdzv_conf": opts.rdzv_conf or [c for c in os.environ.get("PET_RDZV_CONF", "").split(",") if c]})
    cmd = build_command(spec)  # validates the flags, then the layout at every allowed node count
    return {"command": cmd, "env": launch_env(spec), "mode": spec.mode(), "nnodes": str(nnodes),
            "nproc_per_node": nproc, "placement": check_layout(cfg, nnodes, nproc), "warnings": warnings_for(cfg, spec)}


def train_arguments(config: str | None, sets: list[str], resume_from: str | None, summary_json: str | None):
    """The `paratrain train` arguments every worker gets."""
    out = ["--config", config] if config else []
    for item in sets:
        out += ["--set", item]
    for flag, value in (("--resume-from", resume_from), ("--summary-json", summary_json)):
        out += [flag, value] if value else []
    return out


def warnings_for(cfg, spec: LaunchSpec) -> list[str]:
    notes = []
    if spec.max_restarts and not cfg.checkpoint.interval:
        notes.append("--max-restarts without checkpoint.interval: a restart begins again from step 0 "
                     "(set checkpoint.interval to resume from the newest checkpoint)")
    if spec.nnodes.max_nodes > 1 and cfg.checkpoint.resume == "auto" and not cfg.checkpoint.dir.startswith("s3://"):
        notes.append(f"checkpoints go to '{cfg.checkpoint.dir or cfg.metrics.run_dir + '/checkpoints'}': every "
                     "node must see the same folder (shared file system) for a restart to resume")
    return notes


def print_placement(layouts: dict[int, dict[str, str]], nproc: int, notes: list[str]) -> None:
    """Where each parallel dimension runs, for every allowed node count, and the notes (on stderr)."""
    for n, place in layouts.items():
        shown = ", ".join(f"{d}: {where}" for d, where in place.items()) or "one rank, no parallel groups"
        print(f"paratrain launch: {n} node(s) x {nproc}: {shown}", file=sys.stderr)
    for note in notes:
        print(f"paratrain launch: note: {note}", file=sys.stderr)
