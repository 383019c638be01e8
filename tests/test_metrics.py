"""Metrics that can be trusted: the peak MFU is measured against (probed once per machine and cached, raised
when a step proves it low, never silently clamped), records with timestamps, and optional experiment trackers
(Weights & Biases, MLflow) driven through stand-in modules, so the packages are not needed."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from paratrain.config import load_config
from paratrain.train import metrics
from paratrain.train.metrics import MetricsLogger, PeakFlops, Tracker, machine_peak_flops, tracker_modules


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "peak_flops.json"


def test_machine_peak_is_probed_once_and_cached(cache, monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(metrics, "measure_peak_flops", lambda device: calls.append(device) or 5e10)
    first = machine_peak_flops(torch.device("cpu"))
    second = machine_peak_flops(torch.device("cpu"))
    assert first.flops == second.flops == 5e10 and len(calls) == 1  # every later run divides by the same peak
    assert first.source == "probe" and str(cache) in second.label
    assert list(json.loads(cache.read_text()).values())[0]["flops"] == 5e10


def test_a_step_faster_than_the_probed_peak_raises_it_and_says_so(cache):
    peak = PeakFlops(1e11, "peak of this machine measured by a matmul probe", "probe", "host cpu")
    assert peak.observe(0.9e11) is None and peak.flops == 1e11
    note = peak.observe(1.2e11)
    assert "under-measured" in note and peak.flops == 1.2e11  # MFU of that step: exactly 1, never above
    assert json.loads(cache.read_text())["host cpu"]["flops"] == 1.2e11  # the next run starts from it


def test_a_step_faster_than_a_catalog_peak_is_reported_not_hidden():
    peak = PeakFlops(1e12, "bf16 peak of one GPU of p5.48xlarge", "catalog")
    note = peak.observe(2e12)
    assert "peak or the model's FLOP count is wrong" in note and peak.flops == 1e12  # no clamp
    assert peak.observe(3e12) is None  # said once


class FakeWandb:
    def __init__(self):
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return SimpleNamespace(log=lambda values, step: self.calls.append(("log", step, values)),
                               finish=lambda: self.calls.append(("finish",)))


class FakeMlflow:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):  # set_experiment, start_run, log_params, log_metrics, end_run
        return lambda *a, **k: self.calls.append((name, a, k))


def test_trackers_get_every_scalar_with_its_step(tmp_path):
    wandb, mlflow = FakeWandb(), FakeMlflow()
    config = load_config(None, []).model_dump()
    trackers = [Tracker("wandb", wandb, "proj", "run-a", tmp_path, config),
                Tracker("mlflow", mlflow, "exp", "run-a", tmp_path, config)]
    logger = MetricsLogger(tmp_path / "run", True, tensorboard=False, progress=False, trackers=trackers)
    logger.log(3, {"loss": 2.5, "mfu": 0.4, "note": "text is not a metric", "moe_tokens_per_expert": [7, 9]})
    logger.close()
    assert wandb.calls[0] == ("init", {"project": "proj", "name": "run-a", "dir": str(tmp_path), "config": config})
    scalars = {"loss": 2.5, "mfu": 0.4, "moe_tokens_per_expert/0": 7, "moe_tokens_per_expert/1": 9}
    assert ("log", 3, scalars) in wandb.calls and wandb.calls[-1] == ("finish",)
    names = [c[0] for c in mlflow.calls]
    assert names[:3] == ["set_experiment", "start_run", "log_params"] and names[-1] == "end_run"
    assert ("log_metrics", (scalars,), {"step": 3}) in mlflow.calls
    assert mlflow.calls[2][1][0]["train.steps"] == config["train"]["steps"]  # the config, flattened
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert record["step"] == 3 and record["time_unix_s"] > 1.7e9 and record["elapsed_s"] >= 0


def test_a_tracker_that_is_not_installed_fails_before_any_work(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = load_config(None, ['metrics.wandb_project="p"'])
    with pytest.raises(ValueError, match=r"metrics.wandb_project='p': the wandb package is not installed"):
        tracker_modules(cfg.metrics)
    assert tracker_modules(load_config(None, []).metrics) == {}
