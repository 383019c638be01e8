"""The README's plan -> train -> measure -> calibrate loop, exactly as a newcomer runs it (small settings):
probe this machine, plan with the probed file and --write-config, train the planned config, calibrate, run a
second layout (the one calibrate proposes), calibrate again. Every step's outcome is checked: the probed
file loads, the planned run gets a fresh run dir, training it again trains nothing and writes no summary,
calibration never overwrites its input, fits only what one run identifies, and reports a leave-one-out error
once there are two runs. Multi-rank steps run on the gloo pool (the same CLI entry point torchrun runs)."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import shlex

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.hardware.catalog import load_catalog
from paratrain.train.data import prepare

# what "small settings" means here: a small corpus and vocabulary, 4 steps, no eval, no TensorBoard
SMALL = ["data.max_source_bytes=200000", "data.vocab_size=512", "model.vocab=512", "train.eval_every=0",
         "train.progress=false", "metrics.tensorboard=false", "optim.warmup_steps=1", "train.steps=4"]


def _cli_in(cwd: str, argv: list[str]) -> tuple[int, str]:
    """`paratrain ARGV` run from `cwd` (each pool rank is a process of its own, as under torchrun): exit code
    and what it printed on stderr."""
    before, err = os.getcwd(), io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return main(argv), err.getvalue()
    finally:
        os.chdir(before)


def _train(dist_run, tmp_path, world: int, argv: list[str]) -> str:
    """Train on `world` ranks; rank 0's stderr."""
    results = [_cli_in(str(tmp_path), argv)] if world == 1 else dist_run(world, _cli_in, str(tmp_path), argv)
    assert [code for code, _ in results] == [0] * world, results
    return results[0][1]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def test_the_readme_loop_as_written(dist_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = [f'data.prepared_dir="{tmp_path / "data"}"']
    # paratrain probe --out runs/hardware/local.toml --ranks 4 --groups 2,4,8   (here: 2 ranks, quick)
    hw = tmp_path / "runs" / "hardware" / "local.toml"
    assert main(["probe", "--quick", "--groups", "2", "--ranks", "2", "--out", "runs/hardware/local.toml",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    system = load_catalog([hw]).system("local")
    assert printed["hardware_file"] == "runs/hardware/local.toml" and hw.with_suffix(".probe.json").is_file()
    assert system.chip.status == "measured" and system.devices_per_node == 2 and system.device_peak_flops > 0
    probed = hw.read_bytes()

    # paratrain plan --model small --hardware runs/hardware/local.toml ... --write-config runs/planned.toml
    assert main(["plan", "--model", "tiny", "--hardware", "runs/hardware/local.toml", "--nodes", "1", "--seq",
                 "64", "--global-batch", "8", "--write-config", "runs/planned.toml"]) == 0
    assert "wrote runs/planned.toml" in capsys.readouterr().out
    planned = load_config("runs/planned.toml", [])
    run_dir = planned.metrics.run_dir
    assert run_dir.startswith("runs/tiny-") and not (tmp_path / run_dir).exists()  # a fresh folder for this run
    assert planned.metrics.hardware == str(hw.resolve())
    world = planned.parallel.tp * planned.parallel.pp * planned.parallel.cp * planned.parallel.dp
    assert world in (1, 2)

    # torchrun --nproc-per-node N -m paratrain train --config runs/planned.toml --summary-json runs/a.json
    prepare(load_config(None, [*SMALL, *data]).data, log=lambda *_: None)  # once, before the ranks start
    _train(dist_run, tmp_path, world, ["train", "--config", "runs/planned.toml", *_sets([*SMALL, *data]),
                                       "--summary-json", "runs/a.json"])
    a = json.loads((tmp_path / "runs" / "a.json").read_text())
    assert a["steps"] == 4 and a["step_time_s_median"] > 0 and a["predicted"]["system"] == "local"
    assert (tmp_path / run_dir / "metrics.jsonl").is_file()

    # the same command again resumes the finished run: one line, no summary of a run that did not run
    err = _train(dist_run, tmp_path, world, ["train", "--config", "runs/planned.toml", *_sets([*SMALL, *data]),
                                             "--summary-json", "runs/again.json"])
    assert not (tmp_path / "runs" / "again.json").exists()
    assert "nothing left to train: the checkpoint is at step 4, train.steps=4" in err

    # paratrain calibrate --hardware runs/hardware/local.toml runs/*.json
    assert main(["calibrate", "--hardware", "runs/hardware/local.toml", *sorted(glob.glob("runs/*.json")),
                 "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert hw.read_bytes() == probed  # the probed file is never overwritten
    assert first["written"] == "runs/hardware/local.calibrated.toml"
    assert len(first["fitted"]) == 1 and first["mape_leave_one_out"] is None  # one run: one parameter, no check
    assert first["suggested_runs"], "calibrate proposes the next run"

    # a second layout: the run calibrate proposes, as printed
    command = shlex.split(first["suggested_runs"][0]["command"])
    second_world = first["suggested_runs"][0]["world_size"]
    argv = command[command.index("train"):]
    config = argv[argv.index("--config") + 1]
    assert config == first["suggested_runs"][0]["config"] and config.startswith("runs/next/")
    assert load_config(config, []).data == load_config(f"{run_dir}/config.toml", []).data  # the first run's data
    _train(dist_run, tmp_path, second_world, argv)
    second = json.loads((tmp_path / argv[argv.index("--summary-json") + 1]).read_text())
    assert second["steps"] == 4 and second["planner_layout"] != a["planner_layout"]

    # paratrain calibrate again, on both runs: a leave-one-out error, still without touching the input
    assert main(["calibrate", "--hardware", "runs/hardware/local.toml", *sorted(glob.glob("runs/*.json")),
                 "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert hw.read_bytes() == probed and again["runs"] == 2
    assert len(again["leave_one_out_rows"]) == 2 and again["mape_leave_one_out"] is not None
    assert len(again["fitted"]) == 1  # two runs: one parameter, and one run's worth of residual to check it
    calibrated = load_catalog([tmp_path / again["written"]]).system("local")
    assert calibrated.chip.efficiency.matmul_eff_max > 0
