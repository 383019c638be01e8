"""Data at scale: every source format prepared (and trained on), refusals in one line, fingerprints, resume,
workers, explicit caps, long lines, mixtures, and the model folder's tokenizer. All data is generated here."""

import json
import random
import struct

import numpy as np
import pytest

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.train.data import (
    BlendSampler,
    GlobalSampler,
    all_tokens,
    indexed,
    make_sampler,
    open_windows,
    prepare,
    read_meta,
)
from paratrain.train.data import pipeline as prep_mod
from paratrain.train.data import tokenize as T

WORDS = ("alpha beta gamma delta epsilon model token shard stream batch layer tensor rank mesh data "
         "loss step weight train value").split()
QUIET = dict(log=lambda *_: None, progress=False)


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) + "." for _ in range(n)]


def data_cfg(tmp_path, *sets):
    return load_config(None, [f'data.prepared_dir="{tmp_path / "out"}"', "data.vocab_size=300", *sets]).data


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A byte-level BPE tokenizer.json (vocab <= 300), like a user's existing tokenizer."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    T.train_bpe(sentences(400, 0), 300).save(str(path))
    return path


def write_formats(root, tok_path) -> dict:
    """One small file of every format; returns {name: (path, texts or token ids)}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    made = {}
    texts = sentences(40, 1)
    (root / "txt").mkdir()
    for i in range(3):
        (root / "txt" / f"doc{i}.txt").write_text("\n".join(texts[i * 10:(i + 1) * 10]))
    (root / "txt" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))  # left out, reported
    made["txt"] = (root / "txt", ["\n".join(texts[i * 10:(i + 1) * 10]) for i in range(3)])
    recs = [{"id": i, "text": t} for i, t in enumerate(sentences(30, 2))]
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    made["jsonl"] = (root / "a.jsonl", [r["text"] for r in recs])
    recs = [{"body": t} for t in sentences(20, 3)]
    (root / "b.json").write_text(json.dumps(recs))
    made["json"] = (root / "b.json", [r["body"] for r in recs])  # data.text_field = "body"
    table = pa.table({"text": sentences(30, 4), "n": list(range(30))})
    pq.write_table(table, root / "c.parquet")
    made["parquet"] = (root / "c.parquet", table.column("text").to_pylist())
    table = pa.table({"text": sentences(25, 5)})
    with pa.ipc.new_file(str(root / "d.arrow"), table.schema) as w:
        w.write_table(table)
    made["arrow"] = (root / "d.arrow", table.column("text").to_pylist())
    datasets = pytest.importorskip("datasets")
    texts = sentences(30, 6)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(root / "hf"))
    made["hf_disk"] = (root / "hf", texts)
    tok = T.load(tok_path.read_text())
    ids = np.array([i for t in sentences(40, 7) for i in tok.encode(t).ids], dtype=np.int32)
    np.save(root / "e.npy", ids)
    made["npy"] = (root / "e.npy", ids)
    docs = [np.array(tok.encode(t).ids, dtype=np.int32) for t in sentences(40, 8)]
    indexed.write_indexed(root / "f", docs, dtype=np.int32)
    made["megatron"] = (root / "f.bin", np.concatenate(docs))
    return made


@pytest.fixture(scope="module")
def formats(tmp_path_factory, tokenizer_file):
    return write_formats(tmp_path_factory.mktemp("formats"), tokenizer_file)


def expected_ids(tok_path, texts) -> list[int]:
    """What the prepared tokens must be: each document encoded whole, then the end-of-document token."""
    tok = T.load(tok_path.read_text())
    eos = T.eos_id(tok)
    return [i for t in texts for i in [*tok.encode(t).ids, eos]]


@pytest.mark.parametrize("name", ["txt", "jsonl", "json", "parquet", "arrow", "hf_disk", "npy", "megatron"])
def test_each_format_prepares_to_the_reference_tokens(tmp_path, formats, tokenizer_file, name):
    path, content = formats[name]
    sets = [f'data.source="{path}"', f'data.tokenizer="{tokenizer_file}"']
    if name == "json":
        sets.append('data.text_field="body"')
    meta = json.loads((prepare(data_cfg(tmp_path, *sets), **QUIET) / "meta.json").read_text())
    got = all_tokens(tmp_path / "out")
    want = np.asarray(content) if name in ("npy", "megatron") else np.array(expected_ids(tokenizer_file, content))
    assert got.tolist() == want.tolist()
    assert meta["train_tokens"] + meta["val_tokens"] == len(want)
    if name == "txt":
        assert meta["sources"][0]["skipped_files"] == {".png": 1} and meta["documents"] == 3
    if name in ("npy", "megatron"):  # used in place, not copied
        assert not list((tmp_path / "out").glob("src-*/shard-*"))


def test_every_format_trains_in_one_mixture(tmp_path, formats, tokenizer_file, capsys):
    """A data.mix of all eight formats (the token files share the text tokenizer) trains two steps; the
    realised proportions are reported and every source is drawn from."""
    mix = []
    for name, (path, _) in formats.items():
        extra = ', text_field="body"' if name == "json" else ""
        mix.append(f'{{source="{path}", weight={2.0 if name == "jsonl" else 1.0}{extra}}}')
    sets = [f"data.mix=[{', '.join(mix)}]", f'data.tokenizer="{tokenizer_file}"', f'data.prepared_dir="{tmp_path / "d"}"',
            "model.vocab=300", "model.layers=1", "train.steps=2", "train.seq_len=16", "train.global_batch=9",
            "train.microbatch=9", "train.eval_every=0", "train.progress=false", "metrics.tensorboard=false",
            f'metrics.run_dir="{tmp_path / "run"}"', "checkpoint.save_final=false", 'train.device="cpu"']
    assert main(["train", *[a for s in sets for a in ("--set", s)], "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)  # --json: stdout is the summary only; the logs are on stderr
    assert summary["steps"] == 2 and all(np.isfinite(summary["losses"]))
    assert "data mixture over the run: source 0: weight 0.111, realised 0.1111" in captured.err
    cfg = load_config(None, sets)
    windows = open_windows(cfg.data.prepared_dir, "train", 16)
    sampler = make_sampler(windows, 9, cfg.train.seed)
    drawn = np.concatenate([sampler.global_indices(t) for t in range(2)])
    sources = np.searchsorted(windows.offsets, drawn, side="right") - 1
    assert set(sources.tolist()) == set(range(8))  # 18 samples over 8 sources, jsonl twice the weight
    assert (sources == 1).sum() == 4

    def run(tag, steps, *extra):
        args = [a for s in [*sets, f"train.steps={steps}", f'metrics.run_dir="{tmp_path / tag}"', *extra]
                for a in ("--set", s)]
        capsys.readouterr()
        assert main(["train", *args, "--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["losses"]

    # the mixture's order across a resume: 2 steps + checkpoint, resumed to 3 == 3 steps straight
    straight = run("straight", 3)
    assert straight[:2] == summary["losses"]
    run("resumed", 2, "checkpoint.interval=2")
    assert run("resumed", 3, "checkpoint.interval=2") == straight[2:]  # one step trained, after the resume


def one_line_error(capsys, args) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_wrong_inputs_refused_in_one_line(tmp_path, capsys, tokenizer_file):
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "nofield.jsonl").write_text('{"id": 1, "body": "hi"}\n')
    (tmp_path / "table.jsonl").write_bytes(b"PAR1" + bytes(100))
    (tmp_path / "lone.bin").write_bytes(bytes(64))
    (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.zip").write_bytes(b"PK\x03\x04")
    cases = {
        "bin.txt": "extension .txt but binary data (NUL bytes), not text; allowed: UTF-8 text",
        "nofield.jsonl": "no text field 'text' (data.text_field) and no message list 'messages' (data.messages_field); "
                         "found fields ['body', 'id']; allowed: data.text_field = one of ['body']",
        "table.jsonl": "extension .jsonl but parquet, not text",
        "lone.bin": "a .bin without its .idx",
        "num.jsonl": "'text' holds int",
        "chat.jsonl": "has no chat template",
        "empty": "no file of a supported format (found 1 .zip)",
        "missing.txt": "no such file or folder",
    }
    for name, expected in cases.items():
        line = one_line_error(capsys, ["data", "prepare", "--set", f"data.source={tmp_path / name}",
                                       "--set", f"data.prepared_dir={tmp_path / 'out'}"])
        assert str(tmp_path / name) in line and expected in line, line
    assert not (tmp_path / "out" / "meta.json").exists()
    # a records file refused part-way names the record
    (tmp_path / "late.jsonl").write_text('{"text": "a"}\n{"other": "b"}\n')
    line = one_line_error(capsys, ["data", "prepare", "--set", f"data.source={tmp_path / 'late.jsonl'}",
                                   "--set", f"data.tokenizer={tokenizer_file}",
                                   "--set", f"data.prepared_dir={tmp_path / 'out2'}"])
    assert "record at line 2 has no 'text' field (found ['other'])" in line
    line = one_line_error(capsys, ["data", "prepare", "--set", f"data.mix=[{{source='{tmp_path / 'a'}'}}]",
                                   "--set", "data.source=x"])
    assert "data.source='x' and data.mix are both set" in line


def test_megatron_index_layout_is_megatrons(tmp_path):
    """The .idx bytes as Megatron-Core's _IndexWriter lays them out, parsed here independently of our reader."""
    docs = [np.array([5, 6, 7], dtype=np.uint16), np.array([8], dtype=np.uint16), np.array([9, 10], dtype=np.uint16)]
    indexed.write_indexed(tmp_path / "m", docs, dtype=np.uint16)
    raw = (tmp_path / "m.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 3, 4)
    assert np.frombuffer(raw, np.int32, 3, 34).tolist() == [3, 1, 2]
    assert np.frombuffer(raw, np.int64, 3, 46).tolist() == [0, 6, 8]  # byte pointers (uint16 = 2 bytes)
    assert np.frombuffer(raw, np.int64, 4, 70).tolist() == [0, 1, 2, 3] and len(raw) == 102
    ds = indexed.read_index(tmp_path / "m")
    assert ds.tokens().tolist() == [5, 6, 7, 8, 9, 10] and ds.num_documents == 3
    indexed.write_indexed(tmp_path / "corpus.v1", docs, dtype=np.uint16)  # a dotted name: corpus.v1.bin/.idx
    assert indexed.read_index(tmp_path / "corpus.v1.bin").tokens().tolist() == ds.tokens().tolist()
    (tmp_path / "m.bin").write_bytes((tmp_path / "m.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="10 bytes, but the index describes 12"):
        indexed.read_index(tmp_path / "m")


def test_changed_corpus_is_prepared_again(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("\n".join(sentences(50, 1)))
    cfg = data_cfg(tmp_path, f'data.source="{src}"')
    first = read_meta(prepare(cfg, **QUIET))
    assert read_meta(prepare(cfg, **QUIET))["fingerprint"] == first["fingerprint"]
    (src / "b.txt").write_text("\n".join(sentences(50, 2)))  # a file added to the folder
    second = read_meta(prepare(cfg, **QUIET))
    assert second["documents"] == 2 and second["train_tokens"] > first["train_tokens"]
    (src / "b.txt").write_text("\n".join(sentences(50, 3)))  # edited in place
    assert read_meta(prepare(cfg, **QUIET))["fingerprint"] != second["fingerprint"]


def test_interrupted_prepare_resumes_after_the_last_complete_shard(tmp_path, monkeypatch, tokenizer_file):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in sentences(600, 9)))
    monkeypatch.setattr(prep_mod, "CHUNK_CHARS", 2000)
    sets = [f'data.source="{src}"', f'data.tokenizer="{tokenizer_file}"', "data.shard_tokens=1500"]
    whole = all_tokens(prepare(data_cfg(tmp_path / "whole", *sets), **QUIET))
    real_close, calls = prep_mod._close_shard, []

    def crash_after_two(*args):
        real_close(*args)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill would, mid-way through the corpus

    monkeypatch.setattr(prep_mod, "_close_shard", crash_after_two)
    cfg = data_cfg(tmp_path, *sets)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, **QUIET)
    monkeypatch.setattr(prep_mod, "_close_shard", real_close)
    encoded = []
    real_encode = T.encode_items
    monkeypatch.setattr(T, "encode_items", lambda tok, items, *a: encoded.append(len(items)) or real_encode(tok, items, *a))
    logs = []
    out = prepare(cfg, log=logs.append, progress=False)
    assert any(line.startswith(f"resuming {src}: 2 complete shard(s)") for line in logs)
    assert all_tokens(out).tolist() == whole.tolist()
    index = json.loads(next(out.glob("src-*/index.json")).read_text())
    assert len(index["shards"]) > 3 and sum(encoded) < 600  # the first shards' records were not encoded again


def test_workers_give_the_same_shards(tmp_path, monkeypatch, tokenizer_file):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in sentences(300, 4)))
    monkeypatch.setattr(prep_mod, "CHUNK_CHARS", 3000)
    sets = [f'data.source="{src}"', f'data.tokenizer="{tokenizer_file}"']
    one = all_tokens(prepare(data_cfg(tmp_path / "one", *sets, "data.workers=1"), **QUIET))
    logs = []
    two = all_tokens(prepare(data_cfg(tmp_path / "two", *sets, "data.workers=2"), log=logs.append, progress=False))
    assert one.tolist() == two.tolist() and any("2 worker(s)" in line for line in logs)


def test_cap_is_explicit_exact_and_reported(tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text("\n".join(sentences(2000, 5)))  # one large file: the cap cuts inside it
    args = ["data", "prepare", "--set", f"data.source={big}", "--set", f"data.prepared_dir={tmp_path / 'o'}",
            "--set", "data.vocab_size=300", "--set", "data.max_source_bytes=5000"]
    assert main(args) == 0
    line = capsys.readouterr().out
    assert "data.max_source_bytes=5,000 (reached: corpus cut)" in line
    tok = T.load((tmp_path / "o" / "tokenizer.json").read_text())
    assert tok.decode(all_tokens(tmp_path / "o").tolist()) == big.read_text()[:5000]
    assert load_config(None, []).data.max_source_bytes is None  # no default cap


def test_long_line_without_whitespace_is_linear_and_exact(tmp_path):
    """A 2 MB line without whitespace (issue: did not finish in 600 s): long runs are cut every MAX_RUN
    characters, so training and encoding stay linear; the tokens still decode to the exact text."""
    rng = random.Random(0)
    line = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(2_000_000))
    (tmp_path / "line.txt").write_text(line)
    out = prepare(data_cfg(tmp_path, f'data.source="{tmp_path / "line.txt"}"'), **QUIET)
    tok = T.load((out / "tokenizer.json").read_text())
    ids = all_tokens(out).tolist()
    assert tok.decode(ids[:-1]) == line and ids[-1] == T.eos_id(tok)


def test_segments_cut_where_the_ids_do_not_change(tokenizer_file):
    """Documents are encoded in segments; at the safe cuts the ids equal those of the whole document."""
    tok = T.load(tokenizer_file.read_text())
    code = "".join(f"def f{i}(x):\n    return x.alpha + {i}\n\n\nclass C{i}:\n    pass\n" for i in range(300))
    text = code + "".join(f"    self.beta_{i}(gamma)" for i in range(300))  # a tail without newlines
    parts = T.segments(text, limit=500)
    assert len(parts) > 20 and "".join(parts) == text and max(map(len, parts)) <= 500
    ids = [i for p in parts for i in tok.encode(p).ids]
    assert ids == tok.encode(text).ids


def test_blend_sampler_proportions_order_and_resume():
    s = BlendSampler([50, 20, 7], [0.5, 0.3, 0.2], global_batch=10, seed=3)
    g = np.concatenate([s.global_indices(t) for t in range(100)])  # 1000 samples
    src = np.searchsorted(s.offsets, g, side="right") - 1
    assert np.bincount(src).tolist() == [500, 300, 200]  # Megatron's rule: exact at every multiple of 10
    assert all(abs((src[:n] == 0).sum() - 0.5 * n) <= 1 for n in range(1, 1000))
    first = g[src == 2][:7] - s.offsets[2]
    assert sorted(first.tolist()) == list(range(7))  # source 2: each sample once per epoch, then repeats
    assert [r["samples"] for r in s.realised(1000)] == [500, 300, 200] and s.realised(1000)[2]["epochs"] == 200 / 7
    for dp in (1, 2, 5):  # the same global order whatever the data-parallel size
        assert (np.concatenate([s.rank_indices(4, r, dp) for r in range(dp)]) == s.global_indices(4)).all()
    b = BlendSampler([50, 20, 7], [0.5, 0.3, 0.2], 10, 3)
    s.step = 7
    b.load_state_dict(s.state_dict())
    assert (b.next_indices() == s.next_indices()).all()
    with pytest.raises(ValueError, match="weights"):
        BlendSampler([50, 20, 7], [0.4, 0.4, 0.2], 10, 3).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="num_samples"):
        GlobalSampler(77, 10, 3).load_state_dict(s.state_dict())


def write_hf_config(folder, vocab: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 128}))


def test_model_folder_tokenizer_is_default_and_mismatch_refused(tmp_path, capsys, tokenizer_file):
    hf = tmp_path / "hf"
    write_hf_config(hf, 4096)
    base = ["train", "--set", f"model.hf_path={hf}", "--set", f"data.prepared_dir={tmp_path / 'd'}",
            "--set", f"metrics.run_dir={tmp_path / 'r'}"]
    line = one_line_error(capsys, base)
    assert f"model.hf_path='{hf}' (data.tokenizer='auto' uses the model's own tokenizer): no tokenizer.json" in line
    line = one_line_error(capsys, base + ["--set", "data.tokenizer=train"])
    assert "data.tokenizer='train' with model.hf_path=" in line
    (hf / "tokenizer.json").write_text(tokenizer_file.read_text())  # 300 tokens for a 4096-row embedding
    line = one_line_error(capsys, base)
    assert "do not match the embedding of model.hf_path=" in line and "(4096 rows)" in line
    assert not (tmp_path / "d").exists()  # refused before any data work
    write_hf_config(hf, 300)
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}))
    chat = tmp_path / "chat.jsonl"
    msgs = [[{"role": "user", "content": s}, {"role": "assistant", "content": s[::-1]}] for s in sentences(20, 3)]
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in msgs))
    cfg = data_cfg(tmp_path, f'data.source="{chat}"')  # tokenizer 'auto' + hf_path: the folder's tokenizer
    meta = read_meta(prepare(cfg, hf_path=str(hf), **QUIET))
    assert meta["tokenizer"] == str(hf / "tokenizer.json")
    tok = T.load(tokenizer_file.read_text())
    eos = T.eos_id(tok)
    rendered = ["".join(f"<|endoftext|>{m['role']}: {m['content']}\n" for m in conv) for conv in msgs]
    want = [i for r in rendered for i in [*tok.encode(r, add_special_tokens=False).ids, eos]]
    assert all_tokens(tmp_path / "out").tolist() == want


def test_llama3_recipe_data_settings_prepare(tmp_path, tokenizer_file):
    """recipes/llama3-8b.toml's [data]: a tokenizer folder and a Parquet + JSONL mixture, no cap; the same
    settings with the paths moved under tmp_path prepare (the tokenizer is a small stand-in for Llama 3's)."""
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    recipe = load_config(Path(__file__).resolve().parents[1] / "recipes" / "llama3-8b.toml").data
    assert recipe.max_source_bytes is None and [m.source for m in recipe.mix] == ["/fsx/corpus/fineweb",
                                                                                   "/fsx/corpus/the-stack"]
    assert Path(recipe.tokenizer).name == "Meta-Llama-3-8B"  # a model folder: its tokenizer.json
    moved = lambda p: str(tmp_path / Path(p).relative_to("/fsx"))  # noqa: E731
    (tmp_path / "corpus" / "fineweb").mkdir(parents=True)
    (tmp_path / "corpus" / "the-stack").mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": sentences(20, i), "url": ["u"] * 20}),
                       tmp_path / "corpus" / "fineweb" / f"{i:03d}.parquet")
    (tmp_path / "corpus" / "the-stack" / "a.jsonl").write_text(
        "".join(json.dumps({"content": f"def f{i}():\n    return {i}\n", "lang": "py"}) + "\n" for i in range(30)))
    (tmp_path / "models" / "Meta-Llama-3-8B").mkdir(parents=True)
    (tmp_path / "models" / "Meta-Llama-3-8B" / "tokenizer.json").write_text(tokenizer_file.read_text())
    cfg = recipe.model_copy(update={"tokenizer": moved(recipe.tokenizer), "prepared_dir": str(tmp_path / "out"),
                                    "workers": 1, "mix": [m.model_copy(update={"source": moved(m.source)})
                                                          for m in recipe.mix]})
    meta = read_meta(prepare(cfg, **QUIET))
    assert [s["formats"] for s in meta["sources"]] == [{"parquet": 2}, {"jsonl": 1}]
    assert [round(s["weight"], 2) for s in meta["sources"]] == [0.85, 0.15] and meta["documents"] == 70
    shards = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("src-*/shard-*.bin")}
    reweighted = cfg.model_copy(update={"mix": [m.model_copy(update={"weight": 1.0}) for m in cfg.mix]})
    meta = read_meta(prepare(reweighted, **QUIET))  # new weights: meta only, no source tokenized again
    assert [s["weight"] for s in meta["sources"]] == [0.5, 0.5]
    assert {p: p.stat().st_mtime_ns for p in shards} == shards and len(shards) == 2
