"""Probe and calibration: the alpha-beta fit, the hardware file, and recovering known efficiency parameters."""

import dataclasses
import json

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
    path = tmp_path / "local.toml"
    path.write_text(hardware_toml(_probe(cores=8), "local", ranks=8))
    return path


def _probe(cores: int) -> ProbeResult:
    return ProbeResult(device="cpu", threads_per_rank=1, matmul_tflops_by_size={128: 0.05, 1024: 0.1},
                       memory_bw_gbytes_per_s=10.0, cores=cores,
                       fits={"all_reduce": {"latency_us": 100.0, "bw_gbytes_per_s": 1.0}})


def test_probe_file_for_more_ranks_than_cores_shares_them(tmp_path):
    """`paratrain probe --ranks 4` on 2 cores: 2 chips (cores) of 2 ranks each, half a core's rate per rank."""
    path = tmp_path / "shared.toml"
    path.write_text(hardware_toml(_probe(cores=2), "local", ranks=4))
    system = load_catalog([path]).system("local")
    assert (system.chips_per_node, system.devices_per_chip, system.devices_per_node) == (2, 2, 4)
    assert system.device_peak_flops == pytest.approx(0.05e12)


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
    # memory_bw_eff: a probed chip's bandwidth is measured, so the fit holds it at the probe's value (1.0)
    truth = {"matmul_eff_max": 0.55, "kernel_overhead_s": 3e-4, "memory_bw_eff": 1.0, "link_bw_scale": 0.3,
             "link_latency_scale": 2.0, "collective_overhead_s": 2e-3, "dp_overlap": 0.2}
    true_system = apply_parameters(system, truth)
    runs = synthetic_runs(true_system, noise=0.05)
    train, test = runs[0::2], runs[1::2]
    before, _ = mape(system, test)
    fitted, report = fit(system, train)
    after, _ = mape(fitted, test)
    # held-out layouts: far better than the probe's values, and no worse than fitting every parameter (what
    # calibrate did before it chose the identified ones; 14.1% here since the planner's Options.dp_overlap)
    from paratrain.calibrate.fit import _free_and_fixed, _least_squares, current_parameters

    names, fixed = _free_and_fixed(system, None)
    everything, _ = _least_squares(system, train, names, {**current_parameters(system), **fixed})
    all_fitted, _ = mape(apply_parameters(system, everything), test)
    assert after < before / 4 and after <= all_fitted * 1.02, (before, after, all_fitted, report)
    assert report["parameters"]["memory_bw_eff"] == 1.0 and "memory_bw_eff" in report["fixed"]
    assert len(report["fitted"]) <= len(train) - 1
    # write-back round trip: the new file predicts like the fitted system; the input is unchanged
    text = local_file.read_text()
    out = write_back(local_file, "local", report["parameters"], "test", out=tmp_path / "fitted.toml")
    assert local_file.read_text() == text
    reloaded = load_catalog([out]).system("local")
    for m in test:
        assert predict(reloaded, m).step_time_s == pytest.approx(predict(fitted, m).step_time_s, rel=1e-6)
    assert dataclasses.asdict(reloaded.efficiency)["dp_overlap"] == pytest.approx(report["parameters"]["dp_overlap"])


def test_a_fit_checks_each_layout_once_and_predicts_as_estimate_does(local_file):
    """The fit validates each run's layout once (checked_layouts, plan.api.check_layout) and times it with
    estimate_checked for every parameter set: the same Estimate, field for field, as plan.api.estimate."""
    from paratrain.calibrate.fit import checked_layouts, sized_for
    from paratrain.plan.api import Layout, estimate
    from paratrain.plan.options import Options

    system = apply_parameters(load_catalog([local_file]).system("local"), {
        "matmul_eff_max": 0.4, "kernel_overhead_s": 1e-4, "memory_bw_eff": 1.0, "link_bw_scale": 0.5,
        "link_latency_scale": 3.0, "collective_overhead_s": 1e-3, "dp_overlap": 0.5})
    runs = synthetic_runs(system, noise=0.0)
    for m, checked in zip(runs, checked_layouts(system, runs), strict=True):
        sized = sized_for(system, m.world_size)
        plain = estimate(m.model, sized, 1, m.seq, m.global_batch, Layout(**m.layout), Options.for_system(sized))
        assert predict(system, m, checked) == predict(system, m) == plain, m.name


def test_link_fit_inverts_the_planners_collective_model(local_file):
    """Collective times generated by the planner's own formula (plan.collectives.collective_time_s) on the probed
    system sized for 2, 4 and 8 ranks on 2 cores (time-sharing beyond 2) are fitted back to the link's
    latency, time-sharing step and bandwidth: the probe and the planner speak the same model."""
    from paratrain.calibrate.fit import sized_for
    from paratrain.calibrate.probe import fit_link
    from paratrain.plan.collectives import collective_time_s

    system = load_catalog([local_file]).system("local")
    system = dataclasses.replace(system, chips_per_node=2)
    link = dataclasses.replace(system.tiers[0].interconnect, latency_us=60.0, timeshare_step_us=150.0,
                               bw_gbytes_per_s=0.9, bw_eff=1.0)
    system = dataclasses.replace(system, tiers=tuple(dataclasses.replace(t, interconnect=link)
                                                     for t in system.tiers))
    names = {"all_reduce": "allreduce", "reduce_scatter": "reducescatter", "all_gather": "allgather"}
    rows = [{"kind": kind, "group": n, "bytes": b,
             "time_s": float(collective_time_s(sized_for(system, n), names[kind], b, n, 1.0))}
            for kind in names for n in (2, 4, 8) for b in (2**12, 2**16, 2**20, 2**24)]
    f = fit_link(rows, cores=2)
    assert f["latency_us"] == pytest.approx(60.0, rel=1e-6)
    assert f["timeshare_step_us"] == pytest.approx(150.0, rel=1e-6)
    assert f["bw_gbytes_per_s"] == pytest.approx(0.9, rel=1e-6)


# ---- the commands, as users run them ---------------------------------------------------------------------
def _summary(m: Measurement) -> dict:
    """What `paratrain train --summary-json` records for calibration (see train.loop.measured_for_planner)."""
    return {"model_shape": m.model.model_dump(), "seq_len": m.seq, "global_batch": m.global_batch,
            "planner_layout": m.layout, "world_size": m.world_size, "step_time_s_median": m.step_time_s}


# `paratrain probe` as users run it: tests/test_readme_loop.py (probe -> plan -> train -> calibrate)


TRUTH = {"matmul_eff_max": 0.5, "kernel_overhead_s": 1e-4, "memory_bw_eff": 1.0, "link_bw_scale": 0.5,
         "link_latency_scale": 3.0, "collective_overhead_s": 1e-3, "dp_overlap": 0.0}


def _summaries(system, tmp_path, picks) -> list[str]:
    paths = []
    for i, m in enumerate(synthetic_runs(apply_parameters(system, TRUTH), noise=0.03)):
        if i in picks:
            path = tmp_path / f"{m.name}.json"
            path.write_text(json.dumps(_summary(m)))
            paths.append(str(path))
    return paths


def test_calibrate_command_writes_a_new_file_and_reports_leave_one_out(local_file, tmp_path, capsys):
    """Four runs (DP, TP, PP, TP+FSDP on 1-4 ranks): at most three parameters fitted, each held one with its
    reason, a leave-one-out error per run, the input file untouched and a new calibrated file beside it."""
    from paratrain.cli import main

    system = load_catalog([local_file]).system("local")
    paths = _summaries(system, tmp_path, {0, 1, 3, 4})
    before = local_file.read_text()
    assert main(["calibrate", "--hardware", str(local_file), "--json", *paths]) == 0
    report = json.loads(capsys.readouterr().out)
    assert local_file.read_text() == before  # never overwritten without --in-place
    written = local_file.with_name("local.calibrated.toml")
    assert report["written"] == str(written) and written.is_file()
    assert 1 <= len(report["fitted"]) <= 3 and set(report["fitted"]).isdisjoint(report["held"])
    assert set(report["fitted"]) | set(report["held"]) | set(report["fixed"]) == set(report["parameters"])
    assert all(report["held"].values())  # every held parameter says why
    loo = report["leave_one_out_rows"]
    assert len(loo) == 4 and report["mape_leave_one_out"] == pytest.approx(np.mean([abs(r["error"]) for r in loo]))
    assert report["mape_leave_one_out"] < report["mape_before"]
    reloaded = load_catalog([written]).system("local")
    assert reloaded.chip.efficiency.kernel_overhead_s == pytest.approx(report["parameters"]["kernel_overhead_s"])
    # --in-place rewrites the input; --out onto the input itself is refused
    assert main(["calibrate", "--hardware", str(local_file), "--out", str(local_file), *paths]) == 2
    assert "is the --hardware file itself" in capsys.readouterr().err


def test_calibrate_one_run_fits_one_parameter_and_suggests_runs(local_file, tmp_path, capsys):
    """One single-rank run identifies one compute parameter: no link parameter moves (no run communicates),
    no leave-one-out error is claimed, and the next runs proposed are multi-rank layouts."""
    from paratrain.cli import main

    system = load_catalog([local_file]).system("local")
    paths = _summaries(system, tmp_path, {0})
    assert main(["calibrate", "--hardware", str(local_file), "--dry-run", "--json", *paths]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["fitted"]) == 1 and report["fitted"][0] in ("matmul_eff_max", "kernel_overhead_s")
    assert "no run's step time depends on it" in report["held"]["link_bw_scale"]
    assert report["mape_leave_one_out"] is None and report["leave_one_out_rows"] == []
    assert "written" not in report and not local_file.with_name("local.calibrated.toml").exists()
    assert main(["calibrate", "--hardware", str(local_file), "--suggest", "2", *paths]) == 0
    text = capsys.readouterr().out
    assert "more run(s) would identify" in text and text.count("torchrun --nproc-per-node") == 2
    assert not local_file.with_name("local.calibrated.toml").exists()  # --suggest writes nothing


def test_calibrate_command_refuses_bad_input(local_file, tmp_path, capsys):
    from paratrain.cli import main

    assert main(["calibrate", "--hardware", str(local_file), str(tmp_path / "missing.json")]) == 2
    assert "missing.json': no such file" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"seq_len": 128}))
    assert main(["calibrate", "--hardware", str(local_file), str(broken)]) == 2
    assert "missing 'model_shape'" in capsys.readouterr().err
    assert main(["calibrate", "--hardware", str(local_file), "--holdout", "1.5", str(broken)]) == 2
    assert "--holdout = 1.5" in capsys.readouterr().err
    # a run that trained nothing (it resumed a finished run): one line, not a fitting error
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**_summary(Measurement(PRESETS["tiny"], 128, 16, {}, 1, 1.0)), "steps": 0,
                                 "step_time_s_median": float("nan")}))
    assert main(["calibrate", "--hardware", str(local_file), str(empty)]) == 2
    assert "no measured step time" in capsys.readouterr().err


def test_plan_on_a_probed_file_writes_a_config_that_predicts_against_it(tmp_path, monkeypatch):
    """plan -> train: the written config names the hardware file itself (not just its system name, which only
    resolves inside the catalog), so the run prints the prediction of the same entry; and a fresh run dir named
    after the layout, so training the plan never resumes an earlier run."""
    from paratrain.cli import main
    from paratrain.config import load_config

    monkeypatch.chdir(tmp_path)

    hw = tmp_path / "shared.toml"
    hw.write_text(hardware_toml(_probe(cores=2), "local", ranks=4))
    out = tmp_path / "planned.toml"
    assert main(["plan", "--model", "tiny", "--hardware", str(hw), "--nodes", "1", "--seq", "128",
                 "--global-batch", "16", "--write-config", str(out)]) == 0
    cfg = load_config(str(out), [])
    assert cfg.metrics.hardware == str(hw.resolve())
    assert cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp * cfg.parallel.dp == 4  # the 4 ranks of the file
    run_dir = cfg.metrics.run_dir
    assert run_dir.startswith("runs/tiny-") and f"mb{cfg.train.microbatch}" in run_dir
    (tmp_path / run_dir).mkdir(parents=True)  # that run happened: the next plan gets a new folder
    assert main(["plan", "--model", "tiny", "--hardware", str(hw), "--nodes", "1", "--seq", "128",
                 "--global-batch", "16", "--write-config", str(out), "--json"]) == 0
    assert load_config(str(out), []).metrics.run_dir == f"{run_dir}-2"


def test_the_planners_one_layout_select_is_numpys():
    """plan.numeric.select (the planner's np.select, on Python scalars for one layout): the same value, dtype and
    type as np.select for 0-d conditions and mixed Python / numpy choices; arrays go to np.select itself."""
    import random

    from paratrain.plan.numeric import select

    rng = random.Random(0)
    values = [0, 2, 2.5, -3.0, np.float64(1.5), np.float32(2.5), np.int64(3), np.asarray(4.0), np.asarray(5), True,
              np.inf, np.asarray(2.0, dtype=np.float32)]
    conds = [True, False, np.bool_(True), np.bool_(False), np.asarray(True), np.asarray(False)]
    for _ in range(3000):
        k = rng.randint(1, 5)
        cl, ch, d = [rng.choice(conds) for _ in range(k)], [rng.choice(values) for _ in range(k)], rng.choice(values)
        got, want = select(cl, ch, d), np.select(cl, ch, d)
        assert (type(got), got.dtype, got.shape) == (type(want), want.dtype, want.shape) and got == want, (cl, ch, d)
    x = np.arange(4)
    assert np.array_equal(select([x > 1, x == 0], [x * 2, x - 1], -1), np.select([x > 1, x == 0], [x * 2, x - 1], -1))
