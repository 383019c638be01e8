"""`paratrain simulate`: JSON report, plots, Daly check, and one-line errors for bad input."""

import json

import pytest

from paratrain.cli import main

LLAMA = ["simulate", "--devices", "16384", "--step-time", "10s", "--duration", "54d", "--checkpoint-gb", "6500",
         "--write-gbps", "2000", "--read-gbps", "2000", "--samples", "20"]


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report_has_every_output_with_intervals(capsys):
    report = run_json(capsys, LLAMA + ["--price-per-device-hour-usd", "2.5"])
    metrics = report["metrics"]
    for key in ("goodput", "effective_training_fraction", "wall_days", "lost_work_hours", "interruptions",
                "cost_usd"):
        lo, hi = metrics[key]["ci95"]
        assert lo <= metrics[key]["mean"] <= hi
    assert report["samples"] == 20
    assert report["inputs"]["checkpoint_interval_rule"] == "daly"
    assert 380 < metrics["interruptions"]["mean"] < 460
    causes = [row["cause"] for row in report["interruptions_by_cause"]]
    assert causes[0] == "Faulty GPU" and len(causes) == 18
    fleet = report["inputs"]["fleet_devices_paid"]
    assert metrics["cost_usd"]["mean"] == pytest.approx(54 * 24 * fleet * 2.5)
    assert report["analytic"]["daly_interval_s"] < report["analytic"]["young_interval_s"] * 1.1


def test_flags_override_toml(tmp_path, capsys):
    path = tmp_path / "sim.toml"
    path.write_text('devices = 4096\nstep_time_s = 5.0\nsteps = 100000\nspare_nodes = 3\n'
                    '[stragglers]\nrate_per_device_hour = 1e-5\n')
    report = run_json(capsys, ["simulate", "--config", str(path), "--samples", "5", "--spare-nodes", "7",
                               "--straggler-policy", "bounded_staleness", "--interval", "300steps"])
    assert report["inputs"]["spare_nodes"] == 7
    assert report["inputs"]["devices"] == 4096
    assert report["inputs"]["straggler_policy"] == "bounded_staleness"
    assert report["inputs"]["checkpoint_interval_s"] == 1500.0
    assert report["mode"] == "time_to_train"
    assert report["metrics"]["useful_compute_days"]["mean"] == pytest.approx(100000 * 5.0 / 86400)


def test_plots_are_written(tmp_path, capsys):
    argv = ["simulate", "--devices", "1024", "--step-time", "5s", "--duration", "10d", "--samples", "4",
            "--plot", str(tmp_path / "plots")]
    report = run_json(capsys, argv)
    for key in ("goodput_vs_interval", "goodput_vs_cluster_size", "goodput_vs_spares"):
        data = (tmp_path / "plots" / f"{key}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    sizes = [p["devices"] for p in report["plots"]["cluster_sweep"]]
    assert 1024 in sizes and max(sizes) >= 1_000_000


def test_daly_check_reproduces_the_published_examples(capsys):
    """The numbers --daly-check computes (not the published ones it prints beside them): Daly's formula within
    rounding of his published optima, the simulated optimum within 10% of Daly, the simulated goodput at that
    interval within its CI of Daly's model."""
    rows = run_json(capsys, ["simulate", "--daly-check"])
    assert [round(r["mtbf_s"] / 60) for r in rows] == [24 * 60, 6 * 60, 15]
    for row, published_min, rounding_min in zip(rows, (117, 57, 9.1), (0.5, 0.5, 0.05), strict=True):
        assert row["daly_s"] / 60 == pytest.approx(published_min, abs=rounding_min)
        assert abs(row["simulated_s"] / row["daly_s"] - 1) <= 0.10
        assert row["simulated_vs_daly"] == pytest.approx(row["simulated_s"] / row["daly_s"] - 1)
        lo, hi = row["simulated_goodput_near_optimum"]["ci95"]
        assert lo - 0.01 <= row["daly_goodput_near_optimum"] <= hi + 0.01
    assert main(["simulate", "--daly-check", "--samples", "10"]) == 0
    out = capsys.readouterr().out
    assert "117.0m" in out and "sim/Daly" in out


def test_text_report(capsys):
    assert main(LLAMA) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "Faulty GPU" in out and "Young" in out


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--step-time", "10s", "--steps", "10"], "--devices"),
    (["simulate", "--devices", "64", "--step-time", "10s"], "--steps"),
    (["simulate", "--devices", "64", "--step-time", "ten", "--steps", "10"], "step-time"),
    (["simulate", "--devices", "64", "--step-time", "1s", "--steps", "10", "--interval", "often"], "checkpoint_interval"),
    (["simulate", "--devices", "60", "--step-time", "1s", "--steps", "10"], "devices=60"),
    (["simulate", "--devices", "64", "--step-time", "1s", "--steps", "10", "--async-fraction", "1.5"], "async_fraction"),
    (["simulate", "--devices", "64", "--step-time", "1s", "--steps", "10", "--failures-file", "/nonexistent.toml"],
     "does not exist"),
    # the flag the user typed is named, beside the field name a TOML config uses
    (["simulate", "--devices", "64", "--step-time", "0", "--steps", "10"], "step_time_s=0.0 is not allowed: must be > 0 (flag --step-time)"),
    (["simulate", "--devices", "64", "--step-time", "1s", "--steps", "10", "--straggler-slowdown", "0.5"],
     "straggler_slowdown_median=0.5 is not allowed: must be > 1 (a factor) (flag --straggler-slowdown)"),
    (["simulate", "--devices", "64", "--step-time", "1s", "--steps", "10", "--straggler-duration", "xx"],
     "--straggler-duration='xx' is not a duration"),
    (["simulate", "--devices", "64", "--step-time", "1s", "--steps", "10", "--repair", "1x"], "--repair='1x'"),
])
def test_bad_input_is_one_line_naming_the_field(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_catalog_and_planner_fill_the_inputs(capsys):
    from paratrain.hardware import catalog
    from paratrain.model.config import PRESETS
    from paratrain.sim.catalog import CHECKPOINT_BYTES_PER_PARAM

    system = catalog.resolve_system("p5.48xlarge")
    report = run_json(capsys, ["simulate", "--hardware", "p5.48xlarge", "--model", "llama3-8b", "--devices", "256",
                               "--steps", "1000", "--samples", "4"])
    inputs = report["inputs"]
    assert inputs["devices_per_node"] == system.chips_per_node
    assert inputs["price_per_device_hour_usd"] == pytest.approx(
        system.prices.on_demand_usd_per_hour / system.chips_per_node)
    assert inputs["checkpoint_bytes"] == PRESETS["llama3-8b"].num_params() * CHECKPOINT_BYTES_PER_PARAM
    assert any("(on-demand, us-east-1, 2026-11-30)" in note for note in inputs["notes"])
    assert 0 < inputs["step_time_s"] < 60
    assert any("planner" in note for note in inputs["notes"])
    # Flags still win over the catalog.
    report = run_json(capsys, ["simulate", "--hardware", "p5.48xlarge", "--devices", "256", "--step-time", "2s",
                               "--steps", "1000", "--samples", "4", "--price-per-device-hour-usd", "1.0"])
    assert report["inputs"]["price_per_device_hour_usd"] == 1.0
    assert report["inputs"]["step_time_s"] == 2.0


def test_ultraservers_from_the_catalog_are_replaced_as_a_whole(capsys):
    """A Trn2 UltraServer (4 trn2.48xlarge joined by NeuronLink) is 4 hosts of 16 chips replaced as one unit;
    a Trn3 Gen2 UltraServer (no instance tier in the catalog) is one 144-chip unit."""
    base = ["--step-time", "6s", "--duration", "10d", "--samples", "4"]
    trn2 = run_json(capsys, ["simulate", "--hardware", "trn2-ultraserver", "--devices", "4096", *base])["inputs"]
    assert (trn2["devices_per_node"], trn2["nodes_per_domain"], trn2["nodes"]) == (16, 4, 256)
    assert trn2["spare_nodes"] == 4  # 1% of 64 UltraServers, rounded up to one whole UltraServer
    assert any("replacement unit" in note and "4 instances" in note for note in trn2["notes"])
    trn3 = run_json(capsys, ["simulate", "--hardware", "trn3-ultraserver", "--devices", "14400", *base])["inputs"]
    assert (trn3["devices_per_node"], trn3["nodes_per_domain"], trn3["nodes"]) == (144, 1, 100)
    p5 = run_json(capsys, ["simulate", "--hardware", "p5.48xlarge", "--devices", "64", *base])["inputs"]
    assert (p5["devices_per_node"], p5["nodes_per_domain"]) == (8, 1)
    assert main(["simulate", "--hardware", "trn2-ultraserver", "--devices", "4080", *base]) == 2
    err = capsys.readouterr().err.strip()
    assert "--devices=4080" in err and "multiple of 64" in err and "\n" not in err


def test_hardware_price_follows_the_purchase_option(capsys):
    from paratrain.hardware import catalog

    base = ["simulate", "--devices", "256", "--step-time", "2s", "--steps", "100", "--samples", "2"]
    report = run_json(capsys, [*base, "--hardware", "p5.48xlarge", "--purchase", "capacity-block"])
    assert report["inputs"]["price_per_device_hour_usd"] == pytest.approx(39.33 / 8)
    assert any("(capacity-block, us-east-1, 2024-12)" in note for note in report["inputs"]["notes"])
    # trn2.48xlarge: only a spot price is published; on demand there is none, and the note says so
    report = run_json(capsys, [*base, "--hardware", "trn2.48xlarge"])
    assert report["inputs"]["price_per_device_hour_usd"] is None
    assert any("no on-demand price for trn2.48xlarge" in note for note in report["inputs"]["notes"])
    report = run_json(capsys, [*base, "--hardware", "trn2.48xlarge", "--purchase", "spot"])
    spot = catalog.resolve_system("trn2.48xlarge").prices.quote("spot").usd_per_node_hour
    assert report["inputs"]["price_per_device_hour_usd"] == pytest.approx(spot / 16)
