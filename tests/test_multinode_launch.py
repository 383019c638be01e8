"""`paratrain launch`: the torchrun command it builds, the placement of mesh groups on nodes, refusals."""

import json
import shlex
import sys

import pytest
import torch

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.launch.torchrun import (
    LaunchSpec,
    build_command,
    check_layout,
    groups_crossing_nodes,
    hybrid_shard_replicas,
    parse_nnodes,
    placement,
    rank_grid,
)


def dry_run(capsys, *argv) -> dict:
    assert main(["launch", "--dry-run", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def cli_error(capsys, *argv) -> str:
    assert main(["launch", "--dry-run", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_elastic_command_is_exact_torchrun_invocation(capsys):
    out = dry_run(capsys, "--nnodes", "1:4", "--nproc-per-node", "2", "--rdzv-endpoint", "node001:29400",
                  "--rdzv-id", "job42", "--max-restarts", "3", "--rdzv-conf", "join_timeout=900",
                  "--rdzv-conf", "last_call_timeout=5", "--local-addr", "10.0.0.5", "--ifname", "ens5",
                  "--", "--config", "configs/tiny.toml", "--set", "train.global_batch=24", "--set",
                  "train.microbatch=1", "--set", "checkpoint.interval=10")
    assert out["mode"] == "elastic"
    assert out["command"] == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:4", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node001:29400", "--rdzv-id", "job42", "--rdzv-conf",
        "join_timeout=900,last_call_timeout=5", "--nproc-per-node", "2", "--max-restarts", "3",
        "--local-addr", "10.0.0.5", "-m", "paratrain", "train", "--config", "configs/tiny.toml",
        "--set", "train.global_batch=24", "--set", "train.microbatch=1", "--set", "checkpoint.interval=10"]
    assert out["env"]["GLOO_SOCKET_IFNAME"] == "ens5" and out["env"]["NCCL_SOCKET_IFNAME"] == "ens5"
    # restarts need a fresh worker store per rendezvous round (pytorch/pytorch#135712)
    assert out["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert set(out["placement"]) == {"1", "2", "3", "4"}  # every node count of the range was checked
    # torchrun itself accepts the command line (its own parser; nothing is started)
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(out["command"][3:])
    assert parsed.nnodes == "1:4" and parsed.max_restarts == 3 and parsed.module
    assert parsed.training_script == "paratrain" and parsed.training_script_args[0] == "train"


def test_static_and_standalone_commands(capsys):
    out = dry_run(capsys, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.1.2.3", "--nproc-per-node",
                  "2")
    cmd = out["command"]
    assert out["mode"] == "static"
    assert cmd[cmd.index("--master-addr") + 1] == "10.1.2.3" and cmd[cmd.index("--master-port") + 1] == "29500"
    assert cmd[cmd.index("--node-rank") + 1] == "1" and "--rdzv-backend" not in cmd
    out = dry_run(capsys, "--nproc-per-node", "4")
    assert out["mode"] == "standalone" and "--standalone" in out["command"]
    # plain text dry run: one shell line that a user can paste
    assert main(["launch", "--dry-run", "--nproc-per-node", "2", "--ifname", "eth0"]) == 0
    line = capsys.readouterr().out.strip()
    assert shlex.split(line)[0] == "GLOO_SOCKET_IFNAME=eth0" and "torch.distributed.run" in line


def test_tp_group_across_hosts_is_refused(capsys):
    err = cli_error(capsys, "--nnodes", "2", "--nproc-per-node", "3", "--rdzv-endpoint", "n1", "--set",
                    "parallel.tp=2", "--set", "train.global_batch=12", "--set", "train.microbatch=1")
    assert "parallel.tp=2" in err and "--nproc-per-node=3" in err and "span hosts" in err
    err = cli_error(capsys, "--nnodes", "4", "--nproc-per-node", "2", "--rdzv-endpoint", "n1", "--set",
                    "parallel.tp=4")
    assert "parallel.tp=4" in err and "multiple of parallel.tp" in err


@pytest.mark.parametrize("argv, expected", [
    (["--nnodes", "2:1"], "--nnodes='2:1'"),
    (["--nnodes", "two"], "--nnodes='two'"),
    (["--nnodes", "2"], "needs --rdzv-endpoint"),
    (["--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "n1"], "--node-rank with --nnodes=1:2"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "n1"], "--node-rank=2: allowed: 0..1"),
    (["--nnodes", "2", "--rdzv-endpoint", "n1:99999"], "--rdzv-endpoint='n1:99999'"),
    (["--rdzv-conf", "join_timeout"], "--rdzv-conf='join_timeout'"),
    (["--nnodes", "1:3", "--rdzv-endpoint", "n1", "--set", "train.global_batch=4", "--set",
      "train.microbatch=1"], "with 3 node(s) x 1 = 3 ranks: train.global_batch=4 must be divisible"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "n1", "--hybrid-shard"], "--hybrid-shard with --nnodes=1:2"),
    (["--", "--steps", "3"], "arguments after --: --steps 3"),
    (["--monitor-interval-s", "-1"], "--monitor-interval-s=-1.0: allowed: seconds > 0"),
    (["--max-restarts", "-1"], "--max-restarts=-1: allowed: >= 0"),
    (["--nproc-per-node", "0"], "--nproc-per-node='0': allowed: a number >= 1"),
])
def test_bad_flags_one_line_error(capsys, argv, expected):
    assert expected in cli_error(capsys, *argv)


def test_json_without_dry_run_is_refused_before_anything_starts(capsys):
    assert main(["launch", "--json", "--nproc-per-node", "1"]) == 2
    assert "--json: allowed only with --dry-run" in capsys.readouterr().err


def test_placement_tp_inside_node_dp_and_pp_across():
    cfg = load_config(None, ["parallel.tp=2", "train.global_batch=8", "train.microbatch=1"])
    assert placement(cfg, nnodes=2, nproc_per_node=4) == {"dp": "across nodes", "tp": "intra-node"}
    cfg = load_config(None, ["parallel.tp=2", "parallel.pp=2", "train.global_batch=8", "train.microbatch=1"])
    assert placement(cfg, nnodes=2, nproc_per_node=4) == {"pp": "across nodes", "dp": "intra-node",
                                                         "tp": "intra-node"}
    # the grid really is node-contiguous: node 1 of 2 (4 per node) holds global ranks 4..7
    dims = {"pp": 1, "dp": 2, "cp": 1, "tp": 4}
    assert (rank_grid(dims)[0, 1, 0] == [4, 5, 6, 7]).all()
    assert groups_crossing_nodes(dims, "tp", 4) == 0 and groups_crossing_nodes(dims, "tp", 2) == 2


def test_placement_follows_the_rank_order():
    """Llama 3's [TP, CP, PP, DP] keeps the pipeline inside a node and sends DP across (the default: the reverse);
    --hybrid-shard refuses an order whose shard groups would interleave with the stages."""
    sets = ["parallel.tp=2", "parallel.pp=2", "train.global_batch=8", "train.microbatch=1"]
    cfg = load_config(None, [*sets, 'parallel.rank_order="tp-cp-pp-dp"'])
    assert placement(cfg, nnodes=2, nproc_per_node=4) == {"pp": "intra-node", "dp": "across nodes",
                                                         "tp": "intra-node"}
    with pytest.raises(ValueError, match="pp sits inside dp"):
        hybrid_shard_replicas(cfg, 2, 4)


def test_hybrid_shard_replicas_across_nodes_shards_inside(capsys):
    out = dry_run(capsys, "--nnodes", "4", "--nproc-per-node", "4", "--rdzv-endpoint", "n1", "--hybrid-shard",
                  "--set", "parallel.tp=2", "--set", "train.microbatch=2")
    assert "parallel.dp_replicate=4" in out["command"] and 'parallel.dp_kind="hsdp"' in out["command"]
    assert out["placement"]["4"] == {"dp_replicate": "across nodes", "dp_shard": "intra-node",
                                     "tp": "intra-node"}
    cfg = load_config(None, ["parallel.dp_kind=\"hsdp\"", "parallel.dp_replicate=3", "train.microbatch=1"])
    with pytest.raises(ValueError, match="dp_replicate=3 must divide the data-parallel size 4"):
        check_layout(cfg, parse_nnodes("2"), 2)


def test_restart_without_checkpoints_is_flagged(capsys):
    out = dry_run(capsys, "--nnodes", "2", "--rdzv-endpoint", "n1", "--max-restarts", "2")
    assert any("begins again from step 0" in w for w in out["warnings"])
    out = dry_run(capsys, "--nnodes", "2", "--rdzv-endpoint", "n1", "--max-restarts", "2", "--set",
                  "checkpoint.interval=5", "--set", 'checkpoint.dir="s3://bucket/run"')
    assert out["warnings"] == []


@pytest.mark.parametrize("overrides", [
    ["parallel.tp=2", "parallel.pp=2"],
    ["parallel.tp=2", 'parallel.dp_kind="hsdp"', "parallel.dp_replicate=2", "train.microbatch=1"],
    # Llama 3's [TP, CP, PP, DP] (Megatron's --use-tp-pp-dp-mapping): dp outermost, the pipeline inside it
    ["parallel.tp=2", "parallel.pp=2", 'parallel.rank_order="tp-cp-pp-dp"'],
    ["parallel.tp=2", "parallel.pp=2", 'parallel.dp_kind="hsdp"', "parallel.dp_replicate=2",
     'parallel.rank_order="tp-cp-pp-dp"'],
])
def test_rank_grid_matches_the_device_mesh_paratrain_builds(overrides):
    """The placement check assumes ranks sit on the mesh as paratrain's build_mesh puts them (8 ranks, fake
    process group: the mesh layout without any communication). Seen from rank 5, each dimension's group (and the
    dp x cp group FSDP shards over) is the one Megatron's RankGenerator gives for the order (config.ranks)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from paratrain.config.ranks import order_dims, rank_groups
    from paratrain.launch.torchrun import mesh_dims
    from paratrain.parallel.mesh import DistEnv, build_mesh

    cfg = load_config(None, overrides)
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        mesh = build_mesh(cfg.parallel, DistEnv(rank=5, world_size=8, local_rank=5, device=torch.device("cpu")))
        dims = mesh_dims(cfg, 8)
        assert mesh.mesh_dim_names == tuple(dims)
        assert torch.equal(mesh.mesh, torch.as_tensor(rank_grid(dims, cfg.parallel.rank_order)))
        sizes = {"tp": 2, "cp": 1, "pp": cfg.parallel.pp, "dp": 8 // (2 * cfg.parallel.pp)}
        mine = lambda group: next(g for g in rank_groups(order_dims(cfg.parallel.rank_order), sizes, group)  # noqa: E731
                                  if 5 in g)
        for d in ("tp", "pp", "dp"):
            assert mesh[d].mesh.flatten().tolist() == mine((d,))
        flat = "dp_shard_cp" if "dp_shard" in dims else "dp_cp"
        inner = mesh["dp_shard" if "dp_shard" in dims else "dp", "cp"]._flatten(flat)
        assert sorted(inner.mesh.flatten().tolist()) == sorted(mine(("dp", "cp")) if flat == "dp_cp" else
                                                              [r for r in mine(("dp",)) if r in mesh["dp_shard"].mesh])
    finally:
        dist.destroy_process_group()


def test_spec_without_cli():
    spec = LaunchSpec(nnodes=parse_nnodes("3"), nproc_per_node=8, rdzv_endpoint="head:1234", rdzv_id="r",
                      train_args=["--config", "x.toml"], python="python3")
    assert build_command(spec)[:4] == ["python3", "-m", "torch.distributed.run", "--nnodes"]
    assert build_command(spec)[-5:] == ["-m", "paratrain", "train", "--config", "x.toml"]


def test_kubeflow_pet_environment_gives_the_defaults(capsys, monkeypatch):
    """In a PyTorchJob pod the training operator sets PET_*; `paratrain launch -- --config x` then suffices."""
    for key, value in {"PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "2", "PET_RDZV_ENDPOINT": "job-worker-0:23456",
                       "PET_RDZV_ID": "job", "PET_RDZV_BACKEND": "c10d", "PET_MAX_RESTARTS": "5",
                       "PET_RDZV_CONF": "join_timeout=600,last_call_timeout=10"}.items():
        monkeypatch.setenv(key, value)
    out = dry_run(capsys, "--set", "train.global_batch=12", "--set", "train.microbatch=1")
    cmd = out["command"]
    assert cmd[cmd.index("--nnodes") + 1] == "1:3" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "job-worker-0:23456" and cmd[cmd.index("--rdzv-id") + 1] == "job"
    assert cmd[cmd.index("--max-restarts") + 1] == "5"
    assert cmd[cmd.index("--rdzv-conf") + 1] == "join_timeout=600,last_call_timeout=10"
    # an explicit flag still wins
    out = dry_run(capsys, "--nnodes", "2", "--set", "train.global_batch=12", "--set", "train.microbatch=1")
    assert out["command"][out["command"].index("--nnodes") + 1] == "2"
