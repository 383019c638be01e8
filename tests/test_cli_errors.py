"""Inputs that used to end in a traceback or be silently reinterpreted: each is one line naming the value
and what is allowed, before any work (exit code 2)."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main


def _error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


PLAN = ["estimate", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "16", "--seq", "131072",
        "--global-batch", "64", "--tp", "8", "--cp", "4"]


def test_a_sequence_beyond_the_models_maximum_is_refused_unless_extended(capsys):
    err = _error(capsys, PLAN)
    assert "--seq 131072 exceeds llama2-7b's max_seq = 4096" in err and "--max-seq 131072" in err
    assert main([*PLAN, "--max-seq", "131072", "--json"]) == 0  # the user says the context is extended
    est = json.loads(capsys.readouterr().out)
    assert 0 < est["mfu"] <= 1 and est["attention_flops_convention"] == "causal"


def test_compare_targets_need_a_node_count(capsys):
    err = _error(capsys, ["compare", "--model", "llama2-7b", "--steps", "10", "--targets", "trn1.32xlarge"])
    assert "--targets item 'trn1.32xlarge': give the node count, SYSTEM:NODES" in err


def test_config_refuses_the_metrics_hardware_train_would_refuse(capsys):
    err = _error(capsys, ["config", "--set", 'metrics.hardware="nope9"'])
    assert "metrics.hardware='nope9'" in err and "unknown system" in err


def test_a_bad_tokenizer_json_is_one_line(tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": ')
    err = _error(capsys, ["data", "prepare", "--set", f'data.tokenizer="{bad}"', "--set",
                          f'data.prepared_dir="{tmp_path / "d"}"'])
    assert "not a valid tokenizer.json" in err


@pytest.mark.parametrize("world, sets, message", [
    ("3", ["parallel.tp=2"], "world size 3 is not a multiple of pp*cp*tp = 1*1*2 = 2"),  # dp=-1 already
    ("4", ["parallel.tp=2", "parallel.dp=3"], "(set parallel.dp=-1 to infer dp)"),  # an explicit dp: the hint
])
def test_the_layout_hint_fits_the_config(monkeypatch, capsys, world, sets, message):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    err = _error(capsys, ["train", *[a for s in sets for a in ("--set", s)]])
    assert message in err
    assert ("set parallel.dp=-1" in err) == ("parallel.dp=3" in sets)
