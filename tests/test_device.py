"""paratrain.device: device and backend selection (cuda and neuron logic without the hardware: what torch
reports is injected as an `Accelerator` value), and the rule that no other module names a device or backend."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from paratrain import device as dev
from paratrain.config import load_config
from paratrain.device import Accelerator, backend_for, device_index, resolve_device_type

SRC = Path(dev.__file__).parent
NO_GPU = Accelerator()
EIGHT_GPUS = Accelerator("cuda", 8)
TRN2 = Accelerator("neuron", 64)  # trn2.48xlarge: 64 logical NeuronCores at LNC=2


# -- selection -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("acc, expected", [(NO_GPU, "cpu"), (EIGHT_GPUS, "cuda"), (TRN2, "neuron"),
                                           (Accelerator("xpu", 2), "xpu"), (Accelerator("cuda", 0), "cpu")])
def test_auto_takes_the_accelerator_torch_reports(acc, expected):
    assert resolve_device_type("auto", acc) == expected


@pytest.mark.parametrize("requested, acc", [("cpu", EIGHT_GPUS), ("cuda", EIGHT_GPUS), ("neuron", TRN2),
                                            ("cpu", NO_GPU), ("xpu", Accelerator("xpu", 1))])
def test_explicit_device_present(requested, acc):
    assert resolve_device_type(requested, acc) == requested


def test_cuda_requested_without_cuda_names_field_value_and_allowed():
    with pytest.raises(ValueError, match=r"train.device='cuda': not available here \(torch sees no accelerator\); "
                                         r"allowed here: auto, cpu$"):
        resolve_device_type("cuda", NO_GPU)


def test_neuron_requested_on_a_gpu_machine_says_what_is_missing():
    with pytest.raises(ValueError, match=r"8 cuda device\(s\).*TorchNeuron.*allowed here: auto, cpu, cuda$"):
        resolve_device_type("neuron", EIGHT_GPUS)


def test_unknown_device_type_is_told_apart_from_an_absent_one():
    with pytest.raises(ValueError, match="'cdua': not a device type this torch build knows"):
        resolve_device_type("cdua", EIGHT_GPUS, known=lambda name: False)
    with pytest.raises(ValueError, match="'xpu': not available here"):
        resolve_device_type("xpu", EIGHT_GPUS, known=lambda name: True)
    assert not dev.known_device_type("cdua") and dev.known_device_type("cuda")  # the real check, no hardware


def test_device_index_is_the_local_rank_within_the_devices_present():
    assert device_index("cpu", 5, NO_GPU) is None
    assert device_index("neuron", 63, TRN2) == 63
    with pytest.raises(ValueError, match=r"LOCAL_RANK=8 but torch sees 8 cuda device\(s\).*--nproc-per-node"):
        device_index("cuda", 8, EIGHT_GPUS)


def test_pick_device_on_this_machine():
    assert dev.pick_device("cpu", 3, NO_GPU) == torch.device("cpu")
    with pytest.raises(ValueError, match="train.device='cuda'"):
        dev.pick_device("cuda", 0, NO_GPU)
    expected = dev.available_accelerator() or "cpu"
    assert dev.pick_device("auto", 0).type == expected


@pytest.mark.parametrize("device_type, backend", [("cpu", "gloo"), ("cuda", "nccl"), ("neuron", "neuron")])
def test_backend_from_device(device_type, backend):
    assert backend_for(device_type, default_map={}) == backend


def test_other_backends_come_from_torch_default_map():
    assert backend_for("xpu", default_map={"xpu": "xccl"}) == "xccl"
    assert backend_for("xpu") == torch.distributed.Backend.default_device_backend_map["xpu"]  # torch's own map
    with pytest.raises(ValueError, match="train.device='tpu': no torch.distributed backend"):
        backend_for("tpu", default_map={"xpu": "xccl"})


def test_config_accepts_any_device_type_name_and_rejects_an_index(tmp_path):
    assert load_config(overrides=["train.device='neuron'"]).train.device == "neuron"  # checked at run start
    with pytest.raises(ValueError, match=r"train.device='cuda:0': allowed: auto, cpu, cuda, neuron or another"):
        load_config(overrides=["train.device='cuda:0'"])


# -- memory, synchronisation, autocast, RNG on the host ---------------------------------------------------------
def test_host_helpers():
    host = dev.host()
    assert dev.is_host(host) and dev.sync_fn(host) is None
    dev.synchronize(host)  # a no-op, must not touch torch.accelerator
    assert dev.peak_memory_bytes(host) > 2**20 and dev.memory_stats(host)["peak_bytes"] > 0
    assert dev.matmul_dtype(host) == torch.float32
    x = torch.ones(4, 4)
    with dev.autocast(host, torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16
    with dev.autocast(host, None):
        assert (x @ x).dtype == torch.float32


def test_accelerator_rng_state_is_keyed_by_device_type():
    assert dev.accelerator_rng_state(NO_GPU) == {}
    dev.set_accelerator_rng_state({"cuda": "ignored: no cuda here"}, NO_GPU)  # no error, nothing to restore


# -- the rule: only paratrain/device.py names devices and backends ---------------------------------------------
# Flagged: a string constant that IS a device type or backend name ("cuda", "cuda:0", "gloo", ...) and any
# `torch.cuda` / `torch.neuron` attribute. Allowed: prose that mentions them (docstrings, help and error text,
# comments: it explains what happens on which hardware), upper-case component names ("CPU" in the failure
# taxonomy of sim/failures.py), names that merely contain them (the attention impl
# "flash_cpu", environment variables like NCCL_SOCKET_IFNAME), and the hardware catalog's TOML data (chip
# descriptions, not code). Code that needs a device or backend asks paratrain.device.
DEVICE_WORDS = {"cpu", "cuda", "neuron", "gloo", "nccl", "xpu", "xccl", "mps"}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def device_string_uses(source: str) -> list[str]:
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value.split(":")[0] in DEVICE_WORDS:  # torch's names are lower case ("CPU" = a component)
                found.append(f"line {node.lineno}: {node.value!r}")
        elif (isinstance(node, ast.Attribute) and node.attr in ("cuda", "neuron")
              and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            found.append(f"line {node.lineno}: torch.{node.attr}")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


def test_scanner_flags_device_strings_and_lets_prose_pass():
    code = ('"""Runs on cuda."""\nimport torch\nx = torch.device("cuda:1")\nb = "nccl"\n'
            'torch.cuda.synchronize()\nhelp = "gloo over loopback"\nimpl = "flash_cpu"\n')
    assert device_string_uses(code) == ["line 3: 'cuda:1'", "line 4: 'nccl'", "line 5: torch.cuda"]


def test_only_the_device_module_names_devices_and_backends():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "device.py":
            continue
        if uses := device_string_uses(path.read_text()):
            offenders[str(path.relative_to(SRC))] = uses
    assert not offenders, f"device/backend strings outside paratrain/device.py (ask paratrain.device): {offenders}"
