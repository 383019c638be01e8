"""A run keeps the tokenizer it trained with (train.run_files): the shared data.prepared_dir prepared again with
other settings (another config on the same folder: the demo's capped stdlib vs a planned config's uncapped one)
used to change, silently, what `generate` decoded with, what `export` shipped, and the ids a resume fed in."""

from __future__ import annotations

import shutil

from test_checkpoint import main, reference, train_args
from tokenizers import Tokenizer

from paratrain.config import DataSection, load_config
from paratrain.infer.session import load_tokenizer
from paratrain.train.data import prepare
from paratrain.train.export import export_hf

__all__ = ["reference"]  # the module-scoped fixture of test_checkpoint, shared


def test_generate_export_and_resume_use_the_runs_own_tokenizer(reference, tmp_path, capsys):
    run, data = tmp_path / "r", tmp_path / "data"
    shutil.copytree(reference["tmp"] / "ref", run)
    shutil.copytree(reference["data"], data)
    kept = (run / "tokenizer.json").read_bytes()
    assert kept == (data / "tokenizer.json").read_bytes()  # train copied it at the start
    # another config prepares the same folder: a smaller corpus, so a newly trained, different tokenizer
    prepare(DataSection(source="stdlib", prepared_dir=str(data), max_source_bytes=200_000, vocab_size=384),
            log=lambda _m: None)
    assert (data / "tokenizer.json").read_bytes() != kept
    cfg = load_config(run / "config.toml", [f'metrics.run_dir="{run}"', f'data.prepared_dir="{data}"'])
    ours, shared = Tokenizer.from_file(str(run / "tokenizer.json")), Tokenizer.from_file(str(data / "tokenizer.json"))
    assert ours.to_str() != shared.to_str()
    assert load_tokenizer(cfg, "latest").to_str() == load_tokenizer(cfg, str(run / "checkpoints")).to_str() \
        == ours.to_str()
    summary = export_hf(str(run / "checkpoints"), cfg, tmp_path / "hf")
    hf = tmp_path / "hf"
    assert next(hf.glob("*.safetensors")).stat().st_mode == (hf / "config.json").stat().st_mode  # safetensors: 0600
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == kept and summary["tokenizer"] == str(run / "tokenizer.json")
    # resuming with those settings would feed the checkpoint other token ids: refused in one line
    args = train_args(tmp_path, data, "r", "data.max_source_bytes=200000", "train.steps=8")
    assert main(args) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(err) == 1 and "is not the one this run trained with" in err[0] and "allowed:" in err[0]
