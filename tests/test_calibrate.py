"""Probe and calibration: the alpha-beta fit, the hardware file, and recovering known efficiency parameters."""

import dataclasses

import numpy as np
import pytest

from paratrain.calibrate.fit import Measurement, apply_parameters, fit, mape, predict, write_back
from paratrain.calibrate.probe import ProbeResult, fit_alpha_beta, hardware_toml, ring_volume_factor
from paratrain.hardware.catalog import load_catalog
from paratrain.model.config import PRESETS


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    lat, bw = 50e-6, 2e9
    rows = [{"kind": "all_reduce", "group": g, "bytes": b,
             "time_s": lat + ring_volume_factor("all_reduce", g) * b / bw}
            for g in (2, 4, 8) for b in (2**12, 2**16, 2**20, 2**24)]
    f = fit_alpha_beta(rows, "all_reduce")
    assert f["latency_us"] == pytest.approx(50, rel=1e-3) and f["bw_gbytes_per_s"] == pytest.approx(2, rel=1e-3)


@pytest.fixture
def local_file(tmp_path):
    res = ProbeResult(device="cpu", threads_per_rank=1, matmul_tflops_by_size={128: 0.05, 1024: 0.1},
                      memory_bw_gbytes_per_s=10.0,
                      fits={"all_reduce": {"latency_us": 100.0, "bw_gbytes_per_s": 1.0}})
    path = tmp_path / "local.toml"
    path.write_text(hardware_toml(res, "local", ranks=8))
    return path


def test_probe_file_loads_as_a_catalog_system(local_file):
    system = load_catalog([local_file]).system("local")
    assert system.device_peak_flops == pytest.approx(0.1e12)
    assert system.tiers[0].interconnect.latency_us == pytest.approx(100.0)
    # small matmuls slower than large ones: a positive per-kernel overhead was derived
    assert system.chip.efficiency.kernel_overhead_s > 0


LAYOUTS = [  # (preset, world, layout) on this machine's scale: DP, TP, PP and mixed
    ("tiny", 1, {"microbatch": 4}),
    ("tiny", 2, {"microbatch": 4, "dp_kind": "ddp", "zero_stage": 0}),
    ("tiny", 2, {"tp": 2, "microbatch": 4}),
    ("tiny", 2, {"pp": 2, "microbatch": 2}),
    ("tiny", 4, {"tp": 2, "microbatch": 2, "dp_kind": "fsdp", "zero_stage": 3}),
    ("tiny", 4, {"tp": 4, "sp": True, "microbatch": 4}),
    ("small", 1, {"microbatch": 4}),
    ("small", 2, {"tp": 2, "microbatch": 4}),
    ("small", 4, {"microbatch": 2, "dp_kind": "ddp", "zero_stage": 0}),
    ("small", 4, {"pp": 2, "tp": 2, "microbatch": 2}),
    ("small", 8, {"tp": 2, "microbatch": 2, "dp_kind": "ddp", "zero_stage": 0}),
    ("small", 8, {"pp": 2, "tp": 4, "microbatch": 2}),
]


def synthetic_runs(system, noise: float, seed: int = 0) -> list[Measurement]:
    rng = np.random.default_rng(seed)
    runs = []
    for i, (preset, world, layout) in enumerate(LAYOUTS):
        m = Measurement(PRESETS[preset], 128, 16, layout, world, 1.0, name=f"run{i}")
        m.step_time_s = predict(system, m).step_time_s * float(np.exp(rng.normal(0, noise)))
        runs.append(m)
    return runs


def test_fit_recovers_known_parameters_and_predicts_held_out_layouts(local_file, tmp_path):
    system = load_catalog([local_file]).system("local")
    truth = {"matmul_eff_max": 0.55, "kernel_overhead_s": 3e-4, "memory_bw_eff": 0.4, "link_bw_scale": 0.3,
             "link_latency_scale": 2.0, "dp_overlap": 0.2}
    true_system = apply_parameters(system, truth)
    runs = synthetic_runs(true_system, noise=0.05)
    train, test = runs[0::2], runs[1::2]
    before, _ = mape(system, test)
    fitted, report = fit(system, train)
    after, _ = mape(fitted, test)
    assert after < 0.12 and after < before / 2, (before, after, report)
    # write-back round trip: the file now predicts like the fitted system
    write_back(local_file, "local", report["parameters"], "test")
    reloaded = load_catalog([local_file]).system("local")
    for m in test:
        assert predict(reloaded, m).step_time_s == pytest.approx(predict(fitted, m).step_time_s, rel=1e-6)
    assert dataclasses.asdict(reloaded.efficiency)["dp_overlap"] == pytest.approx(report["parameters"]["dp_overlap"])
