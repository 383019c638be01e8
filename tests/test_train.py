"""Single-device training: config errors, data pipeline, determinism, gradient accumulation, loop end to end."""

import json

import numpy as np
import pytest
from parity import assert_matches_reference, make_config, reference

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.train.data import GlobalSampler, TokenWindows, all_tokens, prepare
from paratrain.train.loop import lr_lambda


def test_config_errors_name_key_value_and_allowed():
    with pytest.raises(ValueError, match=r"train.dtype='fp16'.*'fp32' or 'bf16'"):
        load_config(None, ["train.dtype=\"fp16\""])
    with pytest.raises(ValueError, match="parallel.sp=true needs parallel.tp > 1"):
        load_config(None, ["parallel.sp=true"])
    with pytest.raises(ValueError, match="train.stepz"):
        load_config(None, ["train.stepz=3"])
    with pytest.raises(ValueError, match="train.seq_len=9999 exceeds"):
        load_config(None, ["train.seq_len=9999"])


def test_cli_reports_bad_config_in_one_line(capsys):
    assert main(["train", "--set", "optim.lr=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optim.lr=-1" in err[0] and "greater than 0" in err[0]


def test_sampler_global_order_independent_of_dp_size():
    s = GlobalSampler(num_samples=50, global_batch=8, seed=3)
    for step in range(10):  # crosses epoch boundaries (50 samples / 8 per step)
        whole = s.global_indices(step)
        for dp in (1, 2, 4, 8):
            parts = np.concatenate([s.rank_indices(step, r, dp) for r in range(dp)])
            assert (parts == whole).all()
    epoch0 = np.concatenate([s.global_indices(t) for t in range(7)])[:50]
    assert sorted(epoch0) == list(range(50))  # each sample once per epoch


def test_sampler_state_roundtrip_and_mismatch():
    a = GlobalSampler(100, 4, 1)
    a.next_indices()
    a.next_indices()
    b = GlobalSampler(100, 4, 1)
    b.load_state_dict(a.state_dict())
    assert (a.next_indices() == b.next_indices()).all()
    with pytest.raises(ValueError, match="global_batch"):
        GlobalSampler(100, 8, 1).load_state_dict(a.state_dict())


def test_prepare_custom_text_and_windows(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello world, " * 2000)
    cfg = load_config(None, [f'data.source="{tmp_path / "src"}"', f'data.prepared_dir="{tmp_path / "out"}"',
                             "data.vocab_size=300"]).data
    out = prepare(cfg, log=lambda *_: None)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] <= 300 and meta["train_tokens"] > 100
    w = TokenWindows(out, "train", 16)
    x, y = w.batch(np.array([0, 1]))
    assert x.shape == (2, 16) and (x[:, 1:] == y[:, :-1]).all()
    shard = next(out.glob("src-*/shard-00000.bin"))
    mtime = shard.stat().st_mtime_ns
    prepare(cfg, log=lambda *_: None)  # idempotent: same content and settings, no rewrite
    assert shard.stat().st_mtime_ns == mtime


def test_lr_schedule_warmup_then_cosine_to_min():
    opt = load_config(None, ["optim.warmup_steps=10", "optim.lr=1.0", "optim.min_lr=0.1"]).optim
    f = lr_lambda(opt, 110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)


def test_gradient_accumulation_equals_one_big_batch():
    one = reference(make_config(["train.microbatch=8"]))
    accumulated = reference(make_config(["train.microbatch=2"]))
    assert_matches_reference(one, accumulated, rtol=1e-5, grad_rtol=1e-5)


def test_same_seed_same_losses_and_training_learns(tmp_path, capsys):
    def run(tag):
        args = ["train", "--set", "train.steps=12", "--set", "optim.warmup_steps=2", "--set", "train.eval_every=6",
                "--set", "train.eval_batches=2", "--set", "train.progress=false",
                "--set", f'metrics.run_dir="{tmp_path / tag}"', "--set", "data.max_source_bytes=400000",
                "--set", f'data.prepared_dir="{tmp_path / "data"}"', "--set", "data.vocab_size=512",
                "--set", "model.vocab=512", "--set", "train.global_batch=8", "--set", "train.microbatch=4",
                "--set", "train.seq_len=64", "--set", "checkpoint.save_final=false", "--json"]
        capsys.readouterr()
        assert main(args) == 0
        captured = capsys.readouterr()
        assert "model       tiny:" in captured.err and "resume      no: a fresh start" in captured.err  # banner
        return json.loads(captured.out)  # --json: stdout is the summary and nothing else (logs on stderr)

    a, b = run("a"), run("b")
    assert a["losses"] == b["losses"] and len(a["losses"]) == 12
    assert a["last_loss"] < a["first_loss"] * 0.9  # 12 steps; the demo shows the 30% drop
    assert "matmul probe" in a["peak_label"]  # no metrics.hardware: MFU against this machine's measured peak
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["loss"] for r in steps] == a["losses"]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_bytes"} <= steps[-1].keys()
    assert 0 < steps[-1]["mfu"] < 1 and steps[-1]["memory_bytes"] > 0
    # the lr logged for a step is the one that step used: warm-up 1/2 then 2/2 of optim.lr (3e-3)
    assert [r["lr"] for r in steps[:2]] == pytest.approx([1.5e-3, 3e-3])
    times = [r["time_unix_s"] for r in records]
    assert times == sorted(times) and all(r["elapsed_s"] >= 0 for r in records)
    assert a["tokens_per_s_note"] == "excludes 2 warm-up step(s)" and a["tokens_per_s"] > 0
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [6, 12] and all(0 < r["val_loss"] < 10 for r in evals)
    assert list((tmp_path / "a" / "tensorboard").glob("events.out.tfevents.*"))


def test_data_prepare_cli_and_existing_tokenizer(tmp_path, capsys):
    """`paratrain data prepare` (text and --json), then a second corpus prepared with the first's tokenizer.json
    gives the same token ids for the same text."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("def main():\n    return sum(range(10))\n" * 500)
    first = ["data", "prepare", "--set", f"data.source={tmp_path / 'src'}", "--set",
             f"data.prepared_dir={tmp_path / 'one'}", "--set", "data.vocab_size=300"]
    assert main(first) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(str(tmp_path / "one")) and "train" in line and "vocab" in line
    assert main(first + ["--json"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["vocab_size"] <= 300 and meta["dtype"] == "uint16"
    second = ["data", "prepare", "--json", "--set", f"data.source={tmp_path / 'src'}", "--set",
              f"data.prepared_dir={tmp_path / 'two'}", "--set", f"data.tokenizer={tmp_path / 'one' / 'tokenizer.json'}"]
    assert main(second) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == meta["vocab_size"]
    one, two = all_tokens(tmp_path / "one"), all_tokens(tmp_path / "two")
    assert len(one) > 100 and (one == two).all()
    assert main(["data", "prepare", "--set", f"data.tokenizer={tmp_path / 'missing.json'}"]) == 2
    assert "data.tokenizer=" in capsys.readouterr().err
    too_small = ["train", *first[2:], "--set", "model.vocab=128", "--set", "train.seq_len=32",
                 "--set", f"metrics.run_dir={tmp_path / 'run'}"]
    assert main(too_small) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.vocab=128 is smaller than the tokenizer's {meta['vocab_size']} tokens" in err[0]


def test_compiled_blocks_match_eager(monkeypatch):
    """train.compile compiles attention and MLP; numerics stay those of eager mode (fp32)."""
    # Inductor picks the vector ISA from /proc/cpuinfo either way; by default it also compiles a probe per ISA
    # with ATen's vector headers (3 of its 12 g++ runs, ~7 of ~35 CPU-s on a cold cache). vec_isa_ok=True skips
    # only the probes: the same ISA, the same kernels (same cache keys, checked), and on a machine whose compiler
    # could not build that ISA the test fails in the kernels' compile instead of in the probe.
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", True)
    eager = reference(make_config(["model.layers=2"]), steps=2)
    compiled = reference(make_config(["model.layers=2", "train.compile=true"]), steps=2)
    assert_matches_reference(eager, compiled, rtol=1e-5, grad_rtol=1e-5)


def test_compile_wraps_attention_and_mlp_only():
    from paratrain.model.config import PRESETS
    from paratrain.model.llama import Llama
    from paratrain.parallel.compile import apply_compile

    model = apply_compile(Llama(PRESETS["tiny"]), True)
    compiled = {type(m).__name__ for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == {"Attention", "FeedForward"}


def test_override_values_read_as_toml_reads_them():
    """`--set` values: the common forms (true/false, decimal ints, plain "strings") skip the TOML parser and give
    exactly what tomllib gives; every other form goes to tomllib, and a value that is no TOML is a bare string."""
    import tomllib

    from paratrain.config.load import parse_override

    def toml(raw):
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            return raw

    for raw in ["true", "false", "True", " true", "0", "-0", "+7", "007", "00", "1_000", "0x1f", "12" * 15, "1e-3",
                "5.0", "inf", '"fsdp"', '""', '"runs/a b#c"', '"é"', '"a\\"b"', '"tab\there"', '"x"y"', "'lit'",
                "[1, 2]", '"a" # note', "fsdp", "-", "+", ""]:
        value = parse_override(f"train.x={raw}")[1]
        assert (type(value), value) == (type(toml(raw)), toml(raw)), raw


def test_config_reference_doc_is_current():
    """docs/config.md is generated from the schema; regenerate with `paratrain config --reference`."""
    from pathlib import Path

    from paratrain.config import reference_markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert doc.read_text().strip() == reference_markdown().strip()


def test_existing_tokenizer_separates_documents_with_its_own_eos(tmp_path):
    """A Llama-2-style tokenizer.json (end of document '</s>'): documents are joined with its id."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world"] * 50, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "src").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "src" / name).write_text("hello world " * 400)
    cfg = load_config(None, [f"data.source={tmp_path / 'src'}", f"data.prepared_dir={tmp_path / 'out'}",
                             f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.val_fraction=0.01"]).data
    meta = json.loads((prepare(cfg, log=lambda *_: None) / "meta.json").read_text())
    assert meta["eos_id"] == tok.token_to_id("</s>") and meta["documents"] == 2
    tokens = all_tokens(tmp_path / "out")
    assert (tokens == meta["eos_id"]).sum() == 2 and tokens[-1] == meta["eos_id"]  # after each document


def test_sigusr2_prints_every_threads_stack_and_the_run_goes_on(tmp_path):
    """`kill -USR2 <rank pid>` (train.watchdog.stack_dumps_on_signal, installed by `paratrain train`): where a
    hung rank is, without a debugger; the handler is gone again when the run ends."""
    import os
    import signal
    import time

    from paratrain.train.watchdog import stack_dumps_on_signal

    before = signal.getsignal(signal.SIGUSR2)
    with (tmp_path / "dump.txt").open("w") as fh, stack_dumps_on_signal(file=fh):
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)  # the process goes on after the dump
    dump = (tmp_path / "dump.txt").read_text()
    assert "Current thread" in dump and "test_sigusr2_prints_every_threads_stack" in dump, dump
    assert signal.getsignal(signal.SIGUSR2) == before


def test_stack_dumps_fall_back_to_the_process_stderr_when_stderr_is_captured(monkeypatch):
    """A caller that captured sys.stderr in a StringIO (capsys, a notebook) still trains: the dumps go to the
    process's own stderr."""
    import io
    import signal

    from paratrain.train.watchdog import stack_dumps_on_signal

    monkeypatch.setattr("sys.stderr", io.StringIO())
    before = signal.getsignal(signal.SIGUSR2)
    with stack_dumps_on_signal():
        pass
    assert signal.getsignal(signal.SIGUSR2) == before
