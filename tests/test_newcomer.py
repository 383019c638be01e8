"""The newcomer pass of 1 December 2026 (docs/cli.md): inputs that printed a screenful, a traceback or a wrong
result; each is now one line naming the value and what is allowed (exit 2), or the right result. In-process,
small: the whole file is a few CPU-seconds."""

from __future__ import annotations

import pytest

from paratrain.cli import main


def _one_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside parse_args
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv, says", [
    (["plan", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "1", "--objective", "speed"],
     "paratrain plan: error: argument --objective: invalid choice: 'speed' (choose from 'time', 'cost')"),
    (["compare", "--model", "llama2-7b", "--train-tokens", "abc", "--targets", "p5.48xlarge:4"],
     "paratrain compare: error: argument --train-tokens: invalid float value: 'abc'"),
    (["serve", "estimate", "--model", "llama3-8b", "--hardware", "p5.48xlarge"],
     "paratrain serve estimate: error: the following arguments are required: --prompt-tokens"),
    (["train", "--bogus"], "paratrain train: error: unrecognized arguments: --bogus (`paratrain train --help`"),
    (["serve", "plan", "--model", "llama3-8b", "--bogus", "1"], "`paratrain serve plan --help` lists every"),
])
def test_argparse_errors_are_one_line_naming_the_command(capsys, argv, says):
    """argparse printed its usage (up to 30 lines) above the error; `unrecognized arguments` named no command."""
    assert says in _one_line(capsys, argv)


def _truncated_hf_folder(tmp_path):
    """A Hugging Face folder of the tiny Llama whose safetensors file was cut short (a failed copy)."""
    import json

    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from paratrain.model.config import load_model_config
    from paratrain.model.hf import expected_shapes, hf_config, hf_names

    cfg = load_model_config("tiny")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(cfg)))
    names = hf_names(cfg)
    save_file({names[k][0]: torch.zeros(s) for k, s in expected_shapes(cfg).items()}, str(folder / "model.safetensors"))
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.truncate(100_000)
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, cfg.vocab)}}  # the embedding's rows
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    return folder


def test_a_truncated_safetensors_file_is_one_line_before_any_data_work(capsys, tmp_path):
    """A cut-short .safetensors file ended in a torch traceback ('shape [4096, 128] is invalid for input of
    size 23966') in train, after the data was tokenized, and in generate."""
    folder = _truncated_hf_folder(tmp_path)
    (tmp_path / "corpus.txt").write_text("t1 t2 t3\n" * 50)
    prepared = tmp_path / "prepared"
    err = _one_line(capsys, ["train", "--set", f"model.hf_path='{folder}'", "--set",
                             f"data.source='{tmp_path / 'corpus.txt'}'", "--set", f"data.prepared_dir='{prepared}'",
                             "--set", f"metrics.run_dir='{tmp_path / 'run'}'", "--set", "checkpoint.lease_ttl_s=0"])
    assert "model.safetensors: truncated: 100,000 bytes, its header describes" in err and not prepared.exists()
    err = _one_line(capsys, ["generate", "--set", f"model.hf_path='{folder}'", "--prompt-ids", "1,1"])
    assert "truncated: 100,000 bytes" in err


def test_generate_with_a_mistyped_or_incomplete_checkpoint_is_one_line(capsys, tmp_path):
    """`generate --checkpoint nope` ended in DCP's AssertionError traceback ('metadata is None'); a directory whose
    only step folder lacks its manifest was 'not a checkpoint', which sent the user looking elsewhere."""
    err = _one_line(capsys, ["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt-ids", "1,2"])
    assert f"{tmp_path / 'nope'}: not a checkpoint: it holds no MANIFEST.json" in err
    (tmp_path / "ckpts" / "step_00000005").mkdir(parents=True)
    for argv in (["checkpoint", "verify", str(tmp_path / "ckpts")],
                 ["generate", "--checkpoint", str(tmp_path / "ckpts"), "--prompt-ids", "1,2"]):
        err = _one_line(capsys, argv)
        assert "no usable checkpoint: its 1 step_* folder(s) are not complete (step_00000005: no MANIFEST.json" in err


@pytest.mark.parametrize("keep_bytes, says", [(100, "EOF: reading array header"), (5000, "mmap length")])
def test_a_truncated_npy_token_file_names_the_file(capsys, tmp_path, keep_bytes, says):
    """A cut-short .npy printed numpy's bare 'EOF: reading array header, expected 118 bytes got 90'."""
    import numpy as np

    np.save(tmp_path / "tok.npy", np.arange(10_000, dtype=np.int64) % 500)
    whole = (tmp_path / "tok.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(whole[:keep_bytes])
    err = _one_line(capsys, ["data", "prepare", "--set", f"data.source='{tmp_path / 'cut.npy'}'", "--set",
                             f"data.prepared_dir='{tmp_path / 'prepared'}'"])
    assert f"data.source '{tmp_path / 'cut.npy'}': not a complete .npy (" in err and says in err


MIXTRAL_SETS = ["model.preset='tiny-moe'", "model.layers=2", "model.hidden=32", "model.heads=4", "model.kv_heads=2",
                "model.ffn_hidden=24", "model.moe_ffn_hidden=24", "model.vocab=96", "model.num_experts=4",
                "model.shared_experts=0", "model.first_dense_layers=0"]


def test_moe_checkpoint_exports_as_mixtral_and_generates_from_it(capsys, tmp_path):
    """`paratrain export` of any MoE checkpoint failed after creating the folder ('router.weight has no Hugging
    Face counterpart'), and model.hf_path refused Mixtral folders; now a Mixtral-shaped run exports (transformers
    computes the same logits), generates from the folder as from its checkpoint, and what cannot map is one line."""
    import json

    transformers = pytest.importorskip("transformers")
    import torch

    from paratrain.config import dump_config, load_config
    from paratrain.model.llama import Llama
    from paratrain.train.checkpoint import CheckpointManager

    run, out = tmp_path / "run", tmp_path / "hf"
    sets = [*MIXTRAL_SETS, f"metrics.run_dir='{run}'"]
    cfg = load_config(None, sets)
    torch.manual_seed(0)
    model = Llama(cfg.model_shape())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    CheckpointManager(str(run / "checkpoints"), log=lambda _m: None).save(
        1, [model], torch.optim.AdamW(model.parameters()), {"step": 1})
    (run / "config.toml").write_text(dump_config(cfg))
    assert main(["export", "--checkpoint", str(run / "checkpoints"), "--hf-out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "MixtralForCausalLM"
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode  # not 0600
    hf = transformers.MixtralForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.eval()(tokens), rtol=0, atol=1e-5)
    gen = ["--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]
    assert main(["generate", "--set", f"model.hf_path='{out}'", *gen]) == 0
    from_hf = json.loads(capsys.readouterr().out)["tokens"]
    assert main(["generate", "--config", str(run / "config.toml"), "--checkpoint", "latest", *gen]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == from_hf
    err = _one_line(capsys, ["train", "--set", f"model.hf_path='{out}'", "--set", "checkpoint.lease_ttl_s=0"])
    assert "a mixture-of-experts folder (Mixtral, Qwen3-MoE) is read by `paratrain generate` only" in err
    # the README's tiny-moe (a shared expert, a dense first layer): neither architecture has them
    err = _one_line(capsys, ["export", "--checkpoint", str(run / "checkpoints"), "--hf-out", str(tmp_path / "no"),
                             "--set", "model.shared_experts=1"])
    assert "exports as Mixtral or Qwen3-MoE only, and model.shared_experts=1" in err and not (tmp_path / "no").exists()


def test_a_row_priced_at_spot_does_not_say_it_has_no_price(capsys):
    """compare --purchase spot priced trn2.48xlarge at its spot $23.06/node-h and still noted 'no public price
    for trn2.48xlarge: cost fields are null' (the planner's on-demand note); estimate said 'no public price'
    for a system `hardware list` shows a spot price for."""
    import json

    base = ["compare", "--model", "llama2-7b", "--train-tokens", "1e10", "--targets", "trn2.48xlarge:4",
            "--failures", "none", "--json"]
    assert main([*base, "--purchase", "spot"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["cost_usd"] > 0 and not any("price" in n for n in row["notes"]), row["notes"]
    assert main(base) == 0  # on-demand: none published
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["cost_usd"] is None
    assert "no on-demand price for trn2.48xlarge: cost fields are null (it has spot $" in " ".join(row["notes"])


def test_compare_table_spells_the_layout_out():
    """The layout column cut the recompute mode to 'non'/'ful' and left EP out (a MoE row looked dense)."""
    from paratrain.cost.tables import layout_label

    moe = {"tp": 4, "pp": 16, "dp": 16, "cp": 1, "ep": 8, "sp": True, "recompute": "none"}
    assert layout_label(moe) == "TP4PP16DP16EP8+SP/none"
    assert layout_label({"tp": 1, "pp": 1, "dp": 64, "cp": 2, "sp": False, "recompute": "full"}) == "TP1PP1DP64CP2/full"


@pytest.mark.parametrize("override, says", [
    ("train.stepz=10", "train.stepz=10: unknown key (did you mean steps?); allowed: steps, seq_len,"),
    ("modle.preset='tiny'", "modle: unknown section (did you mean model?); allowed: model, data, parallel,"),
    ("data.mix=[{source='x', wieght=2}]", "data.mix.0.wieght=2: unknown key (did you mean weight?); allowed: source"),
    ("=3", "--set '=3': expected section.key=value"),
])
def test_an_unknown_config_key_names_what_is_allowed(capsys, override, says):
    """pydantic's 'Extra inputs are not permitted' named nothing allowed; '--set =3' read as a key 'config'."""
    assert says in _one_line(capsys, ["config", "--set", override])


def test_each_data_setting_gets_its_own_default_prepared_folder():
    """data.prepared_dir defaulted to data/stdlib for any source: `data prepare --set data.source=my_texts/` (the
    README's line) overwrote the demo's folder, and the demo then tokenized its corpus again (a new tokenizer)."""
    from paratrain.config import DataSection, dump_config, load_config

    default = DataSection().prepared_dir
    assert default.startswith("data/stdlib-") and DataSection(vocab_size=4096).prepared_dir == default
    assert DataSection(source="my_texts/").prepared_dir.startswith("data/my_texts-")
    assert len({default, DataSection(max_source_bytes=8_000_000).prepared_dir,
                DataSection(source="my.jsonl").prepared_dir, DataSection(vocab_size=512).prepared_dir}) == 4
    assert DataSection(prepared_dir="data/mine").prepared_dir == "data/mine"  # named: kept
    cfg = load_config(None, ["data.source='a.jsonl'"])
    assert DataSection.model_validate(cfg.data.model_dump()).prepared_dir == cfg.data.prepared_dir
    assert f'prepared_dir = "{cfg.data.prepared_dir}"' in dump_config(cfg)  # the run's config.toml names it


def test_data_prepare_prints_its_summary_once(capsys, tmp_path):
    """The summary line came twice on a terminal: the pipeline's log (stderr) and the command's result (stdout)."""
    (tmp_path / "a.txt").write_text("hello world, " * 400)
    sets = ["--set", f"data.source='{tmp_path / 'a.txt'}'", "--set", f"data.prepared_dir='{tmp_path / 'p'}'",
            "--set", "data.vocab_size=300"]
    assert main(["data", "prepare", *sets]) == 0
    out, err = capsys.readouterr()
    assert out.count("train + ") == 1 and "train + " not in err


def test_etp_without_tp_says_what_would_work(capsys):
    """With tp=1 the message offered 'etp=1 (...) or etp=1 = tp': the same value twice, read as a contradiction."""
    err = _one_line(capsys, ["config", "--set", "model.preset='tiny-moe'", "--set", "parallel.etp=2"])
    assert "parallel.etp=2 with parallel.tp=1: allowed: etp=1" in err and "etp = tp with parallel.tp > 1" in err


@pytest.mark.parametrize("argv", [["config"], ["checkpoint", "list"], ["hardware", "show"], ["serve", "plan"]])
def test_every_subcommands_help_has_an_example(capsys, argv):
    """`paratrain checkpoint list --help`, `hardware show`, `serve plan` and `config` printed only their options:
    the examples were in the group's help (`paratrain serve --help`), config had none."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = capsys.readouterr().out
    assert f"  paratrain {argv[0]} " in text.split("options:")[0], text[:400]


def test_a_failures_table_in_a_simulate_config_is_named(capsys, tmp_path):
    """[failures] foo = 1 (a table where a file name belongs) said: failure model file "/dir/{'foo': 1}" does not
    exist."""
    (tmp_path / "sim.toml").write_text("[failures]\nfoo = 1\n")
    err = _one_line(capsys, ["simulate", "--config", str(tmp_path / "sim.toml"), "--devices", "64", "--step-time",
                             "10s", "--duration", "1d"])
    assert "failures = {'foo': 1}: allowed: failures = \"file.toml\"" in err


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_truncated_parquet_or_arrow_file_names_the_file(capsys, tmp_path, fmt):
    """A cut-short Parquet file printed pyarrow's 'Parquet magic bytes not found in footer' without the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": [f"hello world {i}" for i in range(2000)]})
    path = tmp_path / f"a.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        with pa.ipc.new_file(str(path), table.schema) as w:
            w.write_table(table)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    err = _one_line(capsys, ["data", "prepare", "--set", f"data.source='{path}'", "--set",
                             f"data.prepared_dir='{tmp_path / 'p'}'"])
    assert f"data.source '{path}': not a readable {fmt} file (" in err


def test_probe_on_a_missing_accelerator_is_one_line(capsys):
    """`probe --device cuda` on a CPU-only torch ended in 'AssertionError: Torch not compiled with CUDA enabled'."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the probe would run")
    err = _one_line(capsys, ["probe", "--device", "cuda", "--quick", "--out", "/nonexistent/x.toml"])
    assert "--device='cuda': not available here (torch sees no accelerator); allowed here: auto, cpu" in err


@pytest.mark.parametrize("root", ["s3:/bucket/run", "s3:bucket"])
def test_an_s3_url_with_a_slash_missing_is_refused(root, tmp_path, monkeypatch):
    """checkpoint.dir='s3:/bucket' (one slash) was taken as a local folder 's3:' under the working directory: the
    run 'saved to S3' on local disk, exit 0."""
    from paratrain.train.checkpoint import check_resume_source
    from paratrain.train.storage import Storage

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"checkpoint.dir='{root}': a URL with a slash missing"):
        Storage(root)
    with pytest.raises(ValueError, match=f"--resume-from='{root}': a URL with a slash missing"):
        check_resume_source("auto", root)
    assert Storage(f"./{root}").root == str(tmp_path / root)  # a folder with a colon, said so, still works
    assert Storage("s3://bucket/run").remote


def test_hardware_list_columns_stay_aligned_with_long_chip_names(capsys):
    """`h100-hbm2e-500w` (15 characters in 11- and 12-wide columns) shifted its rows of `hardware list`."""
    assert main(["hardware", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    systems = [ln for ln in out if ln.startswith(("system ", "dgx-h100 ", "grand-teton-h100 "))]
    chips = [ln for ln in out if ln.startswith(("chip ", "h100 ", "h100-hbm2e-500w "))]
    assert len(systems) == 3 and len(chips) == 3
    for rows, column in ((systems, "chips"), (chips, "BF16 TF")):
        end = rows[0].index(column) + len(column)  # right-aligned numbers end under their header
        assert all(ln[end - 1] != " " and ln[end] == " " for ln in rows[1:]), rows


@pytest.mark.parametrize("argv, flag", [
    (["plan", "--model", "llama2-7b", "--hardware", "p5.48xlarge", "--nodes", "1", "--write-config", "F/x.toml"],
     "--write-config"),
    (["compare", "--model", "llama2-7b", "--train-tokens", "1e10", "--targets", "p5.48xlarge:1", "--report", "F/r"],
     "--report"),
    (["train", "--summary-json", "F/a.json"], "--summary-json"),
    (["export", "--checkpoint", "nope", "--hf-out", "F/hf"], "--hf-out"),
    (["probe", "--quick", "--out", "F/local.toml"], "--out"),
    (["simulate", "--devices", "16", "--step-time", "10s", "--duration", "1d", "--plot", "F/plots"], "--plot"),
])
def test_an_output_that_cannot_be_written_is_refused_before_the_work(capsys, tmp_path, argv, flag):
    """An unwritable --write-config/--report/--summary-json/--hf-out/--out was a FileNotFoundError traceback after
    the work (probe: after its measurements; train: after the whole run, the summary lost)."""
    blocker = tmp_path / "F"
    blocker.write_text("a file where a folder is needed")
    argv = [a.replace("F/", f"{blocker}/") for a in argv]
    err = _one_line(capsys, argv)
    assert f"{flag} '{blocker}/" in err and f"cannot write there ({blocker} is a file)" in err
