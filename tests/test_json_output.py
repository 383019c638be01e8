"""`--json` prints only JSON on stdout, for every subcommand that has the flag (logs, progress and notes go
to stderr). The subcommands are found by walking the CLI parser, so a new one with --json fails here until it
is listed: run here (cheap arguments) or named with the test that parses its stdout strictly."""

from __future__ import annotations

import argparse
import json

import pytest

from paratrain.cli import build_parser, main

P5 = "p5.48xlarge"
SMALL_TRAIN = ["train.steps=2", "optim.warmup_steps=1", "train.eval_every=0", "train.progress=true", "train.log_every=1",
               "metrics.tensorboard=false", "data.max_source_bytes=100000", "data.vocab_size=384", "model.vocab=384",
               "model.layers=1", "train.global_batch=4", "train.microbatch=2", "train.seq_len=32"]

# command -> arguments (besides --json); {tmp} is the test's folder. `train` runs first: the checkpoint
# commands read what it saved.
RUN_HERE = {
    "train": ["train", *[a for s in SMALL_TRAIN for a in ("--set", s)], "--set", 'metrics.run_dir="{tmp}/run"',
              "--set", 'data.prepared_dir="{tmp}/data"'],
    "checkpoint list": ["checkpoint", "list", "{tmp}/run/checkpoints"],
    "checkpoint verify": ["checkpoint", "verify", "{tmp}/run/checkpoints"],
    "export": ["export", "--checkpoint", "{tmp}/run/checkpoints", "--hf-out", "{tmp}/hf"],
    "hardware list": ["hardware", "list"],
    "hardware show": ["hardware", "show", "trn1.32xlarge"],
    "estimate": ["estimate", "--model", "llama2-7b", "--hardware", "trn1.32xlarge", "--nodes", "4", "--seq", "4096",
                 "--global-batch", "256", "--tp", "8"],
    "plan": ["plan", "--model", "llama2-7b", "--hardware", "trn1.32xlarge", "--nodes", "4", "--seq", "4096",
             "--global-batch", "256", "--top", "2"],
    "serve estimate": ["serve", "estimate", "--model", "llama3-8b", "--hardware", P5, "--batch", "8", "--prompt-tokens",
                       "512", "--output-tokens", "128"],
    "serve plan": ["serve", "plan", "--model", "llama3-8b", "--hardware", P5, "--rate", "5", "--prompt-tokens", "512",
                   "--output-tokens", "128"],
    "serve recommend": ["serve", "recommend", "chat", "--model", "llama3-8b", "--systems", P5],
    "serve simulate": ["serve", "simulate", "--model", "llama3-8b", "--hardware", P5, "--rate", "2", "--prompt-tokens",
                       "256", "--output-tokens", "32"],
    "compare": ["compare", "--model", "llama2-7b", "--steps", "100", "--targets", "p4d.24xlarge:2",
                "--failures", "none"],
    "recommend": ["recommend", "experiment", "--systems", "p4d.24xlarge", "--failures", "none"],
    "simulate": ["simulate", "--devices", "64", "--step-time", "1s", "--steps", "1000", "--samples", "2"],
    "launch": ["launch", "--dry-run", "--nproc-per-node", "2"],
}
# command -> the test that runs it with --json and parses its whole stdout as JSON
ELSEWHERE = {
    "data prepare": "test_train.py::test_data_prepare_cli_and_existing_tokenizer",
    "verify": "test_verify.py::test_cli_compares_two_layouts",
    "generate": "test_generate.py::test_generate_cli_from_hf_folder_and_checkpoint",
    "probe": "test_readme_loop.py::test_the_readme_loop_as_written",
    "calibrate": "test_readme_loop.py::test_the_readme_loop_as_written, test_calibrate.py",
}


def json_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += json_commands(sub, (*path, name))
    if path and any("--json" in a.option_strings for a in parser._actions):
        out.append(" ".join(path))
    return out


def test_every_json_command_is_checked():
    found = set(json_commands(build_parser()))
    assert found == set(RUN_HERE) | set(ELSEWHERE), (sorted(found - set(RUN_HERE) - set(ELSEWHERE)),
                                                     sorted(set(RUN_HERE) | set(ELSEWHERE) - found))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("json")


@pytest.mark.parametrize("command", list(RUN_HERE))
def test_json_stdout_is_json_only(command, tmp, capsys):
    argv = [a.replace("{tmp}", str(tmp)) for a in RUN_HERE[command]] + ["--json"]
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    json.loads(captured.out)  # the whole of stdout: one JSON document
    if command == "train":  # its logs went to stderr: the banner, and (not a terminal: no bar) a step line
        assert "model       " in captured.err and "step      2 loss" in captured.err


def test_resuming_a_run_dir_with_another_model_is_one_line(tmp, capsys):
    """The run dir of `train` above, resumed with a different model shape: one line (was a DCP traceback)."""
    argv = [a.replace("{tmp}", str(tmp)) for a in RUN_HERE["train"]]
    if not (tmp / "run" / "checkpoints").is_dir():  # run alone (-k): make the run first
        assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--set", "model.hidden=64", "--set", "train.steps=3"]) == 2
    # the progress bar drawn before the refusal is cleared ("\r" ... "\r"): not a line of the message
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("train: ")]
    assert len(err) == 1 and "cannot resume from" in err[0] and "of another shape" in err[0], err
    assert "a new metrics.run_dir" in err[0]
