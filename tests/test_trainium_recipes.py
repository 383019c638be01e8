"""Trainium recipes (TorchNeuron on trn2.48xlarge: Slurm/ParallelCluster and EKS): ranks per node from the hardware
catalog, the config valid and shared with the manifest, the manifest against the Kubernetes API schema, the sbatch
script and the manifest's command through `paratrain launch --dry-run`. Shell syntax and shellcheck of the new
files run in tests/test_multinode_recipes.py (it globs every recipe script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_multinode_recipes import (
    RECIPES,
    ROOT,
    builtin_objects,
    check_parallelcluster,
    launch_dry_run,
    manifest,
    official_schema_versions,
)

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.hardware.catalog import resolve_system
from paratrain.launch.torchrun import resolve_nproc

CONFIG = RECIPES / "llama3-8b-trn2.toml"
TRN2 = resolve_system("trn2.48xlarge")


def test_ranks_per_node_from_the_catalog():
    assert resolve_nproc("trn2.48xlarge") == TRN2.devices_per_node == 64  # 16 Trainium2 x 4 logical cores
    with pytest.raises(ValueError, match=r"--nproc-per-node='trn9': allowed: .* a catalog system"):
        resolve_nproc("trn9")


def test_trn2_config_runs_on_neuron_in_bf16_and_fits_every_node_count():
    cfg = load_config(CONFIG)
    assert (cfg.train.device, cfg.train.dtype, cfg.parallel.dp_kind) == ("neuron", "bf16", "fsdp")
    assert TRN2.devices_per_node % cfg.parallel.tp == 0 and cfg.parallel.tp <= TRN2.devices_per_chip  # TP in a chip
    assert cfg.checkpoint.dir.startswith("/fsx/") and cfg.metrics.hardware == "trn2.48xlarge"


def test_pytorchjob_trn2_passes_the_schemas_and_asks_for_the_catalog_ranks(capsys, monkeypatch):
    docs = manifest("pytorchjob-trn2.yaml")
    assert docs["ConfigMap"]["data"]["run.toml"] == CONFIG.read_text()
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extras) is not installed")
    for version in official_schema_versions(kv):
        for obj in builtin_objects("pytorchjob-trn2.yaml"):
            kv.validate(obj, version, strict=True)
    job, spec = docs["PyTorchJob"], docs["PyTorchJob"]["spec"]
    assert int(spec["nprocPerNode"]) == TRN2.devices_per_node
    container = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["aws.amazon.com/neuron"] == TRN2.chips_per_node
    elastic = spec["elasticPolicy"]
    env = {"PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
           "PET_NPROC_PER_NODE": spec["nprocPerNode"], "PET_RDZV_BACKEND": elastic["rdzvBackend"],
           "PET_RDZV_ENDPOINT": f"{job['metadata']['name']}-worker-0:29400",
           "PET_MAX_RESTARTS": str(elastic["maxRestarts"]), "PET_RDZV_ID": job["metadata"]["name"]}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = launch_dry_run(capsys, container["command"], CONFIG, "/etc/paratrain/run.toml")
    assert out["nproc_per_node"] == 64 and set(out["placement"]) == {"2", "3", "4"}
    assert all(p["tp"] == "intra-node" for p in out["placement"].values())


def test_sbatch_trainium_launches_catalog_ranks_on_every_node(capsys, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "args.json"
    stubs = {"scontrol": '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "trn-1\\ntrn-2\\n"\n',
             "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
             "fake-paratrain": f'#!/bin/bash\nenv > "{tmp_path}/env.txt"\n"{sys.executable}" -c \'import json, sys; '
                               f'json.dump(sys.argv[1:], open("{record}", "w"))\' "$@"\n'}
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "trn-[1-2]", "SLURM_JOB_ID": "77", "PARATRAIN": "fake-paratrain"}
    done = subprocess.run(["bash", str(RECIPES / "slurm" / "paratrain-trainium.sbatch")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    args = json.loads(record.read_text())
    assert args[args.index("--nproc-per-node") + 1] == "trn2.48xlarge"
    assert args[args.index("--rdzv-endpoint") + 1] == "trn-1:29400" and args[-2:] == ["--config",
                                                                                       "recipes/llama3-8b-trn2.toml"]
    node_env = (tmp_path / "env.txt").read_text()
    assert "FI_PROVIDER=efa" in node_env and "NEURON_LOGICAL_NC_CONFIG=2" in node_env  # the env file was sourced
    cwd = Path.cwd()
    os.chdir(ROOT)
    try:
        assert main(["launch", "--dry-run", "--json", *args[1:]]) == 0, capsys.readouterr().err
    finally:
        os.chdir(cwd)
    out = json.loads(capsys.readouterr().out)
    assert out["nproc_per_node"] == 64 and "--nproc-per-node" in out["command"]


def test_parallelcluster_trn2_has_efa_and_the_shared_mount_the_config_uses():
    check_parallelcluster("parallelcluster-trn2.yaml", "trn2.48xlarge", CONFIG)
