"""Data sources: which files a `data.source` names, the format of each (from its extension and its first
bytes), and their documents as a stream of text blocks. Anything unrecognised is refused with one line
naming the file, what was found and what is allowed, before any tokenization starts.

Torch-free on purpose: the tokenizer worker processes import this package, and they start faster without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ALLOWED = ("UTF-8 text (.txt, .md, .py, ...), JSONL/JSON records, Parquet, Arrow, a Hugging Face datasets "
           "save_to_disk folder, .npy token arrays or Megatron .bin/.idx")
# Plain text by extension in a folder (content is still checked: a binary .txt is refused).
TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".py", ".c", ".h", ".cc", ".cpp", ".hpp",
                 ".java", ".js", ".ts", ".go", ".rs", ".sh", ".html", ".xml", ".yaml", ".yml", ".toml")
# The embedded demo corpus: the suffixes and folders of the original stdlib reader, so `make demo` reads
# the same files (.json files of the stdlib are read as text, as before).
STDLIB_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".jsonl")
STDLIB_SKIP = ("site-packages", "test", "tests", "idlelib", "lib2to3")
TOKEN_FORMATS = ("npy", "megatron")
SNIFF_BYTES = 64 * 1024
BLOCK_BYTES = 1 << 20  # plain text is read in blocks of this size: a huge one-line file stays bounded
RECORD_BATCH = 256


@dataclass(frozen=True)
class SourceSpec:
    """One entry of data.source / data.mix."""

    source: str
    weight: float = 1.0
    text_field: str = "text"
    messages_field: str = "messages"
    split: str = "train"


@dataclass
class SourceFile:
    path: Path
    fmt: str  # text, jsonl, json, parquet, arrow, hf_disk, npy, megatron
    field: str | None = None  # the record field / column holding the text (or the message list)
    chat: bool = False  # field holds chat message lists, rendered with the tokenizer's chat template


@dataclass
class Source:
    spec: SourceSpec
    files: list[SourceFile]
    skipped: dict[str, int] = field(default_factory=dict)  # suffix -> files of other formats left out
    capped: bool = False  # data.max_source_bytes cut this source (set while it is read)

    @property
    def kind(self) -> str:
        return "tokens" if self.files[0].fmt in TOKEN_FORMATS else "text"

    @property
    def chat(self) -> bool:
        return any(f.chat for f in self.files)

    @property
    def key(self) -> str:
        """Folder name of this source's prepared shards: stable under reordering of data.mix."""
        s = self.spec
        return "src-" + hashlib.sha256(json.dumps([s.source, s.text_field, s.messages_field, s.split])
                                       .encode()).hexdigest()[:12]

    def formats(self) -> dict[str, int]:
        return dict(Counter(f.fmt for f in self.files))

    def content_fingerprint(self) -> str:
        """Every file's path, size, mtime and a hash of its first and last 64 KiB: a changed, added or removed
        file changes it; computing it reads at most 128 KiB per file."""
        h = hashlib.sha256()
        for f in self.files:
            for path in _fingerprinted_paths(f):
                st = path.stat()
                h.update(f"{path}|{st.st_size}|{st.st_mtime_ns}|".encode())
                with open(path, "rb") as fh:
                    h.update(fh.read(SNIFF_BYTES))
                    if st.st_size > 2 * SNIFF_BYTES:
                        fh.seek(-SNIFF_BYTES, os.SEEK_END)
                        h.update(fh.read())
            h.update(f"{f.fmt}|{f.field}|{f.chat}".encode())
        return h.hexdigest()

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for f in self.files for p in _fingerprinted_paths(f))


def _fingerprinted_paths(f: SourceFile) -> list[Path]:
    if f.fmt == "hf_disk":
        return sorted(p for p in f.path.rglob("*") if p.is_file())
    if f.fmt == "megatron":
        return [f.path, f.path.with_suffix(".idx")]
    return [f.path]


def refuse(path, what: str) -> ValueError:
    return ValueError(f"data.source '{path}': {what}; allowed: {ALLOWED}")


# ---------------------------------------------------------------------------------------------- listing


def resolve_source(spec: SourceSpec) -> Source:
    """The files of one source with their formats and text fields; refuses what it cannot read."""
    if spec.source == "stdlib":
        return Source(spec, [SourceFile(p, "text") for p in _stdlib_files()])
    root = Path(spec.source).expanduser()
    if not root.exists():
        raise ValueError(f"data.source='{spec.source}': no such file or folder; allowed: 'stdlib', or a file or "
                         f"folder of {ALLOWED}")
    if root.is_dir() and _is_hf_dataset(root):
        files, skipped = [_hf_file(root, spec)], {}
    elif root.is_file():
        one = _classify(root, spec, explicit=True)
        files, skipped = ([one] if one else []), {}
    else:
        files, skipped = _walk(root, spec)
    if not files:
        others = ", ".join(f"{n} {s or '(no suffix)'}" for s, n in sorted(skipped.items())) or "nothing"
        raise ValueError(f"data.source='{spec.source}': no file of a supported format (found {others}); "
                         f"allowed: {ALLOWED}")
    kinds = {"tokens" if f.fmt in TOKEN_FORMATS else "text" for f in files}
    if len(kinds) > 1:
        first_tok = next(f for f in files if f.fmt in TOKEN_FORMATS)
        raise ValueError(f"data.source='{spec.source}': mixes pre-tokenized files ({first_tok.path.name}) with "
                         f"text; allowed: one kind per source (give each its own data.mix entry)")
    return Source(spec, files, skipped)


def _stdlib_files() -> list[Path]:
    """The stdlib's text files in Path order. The skipped folders are pruned while walking, not filtered after:
    the stdlib folder may hold a site-packages with ~25,000 files, and `train` lists this corpus on every run
    (rglob of everything took 1.2-1.4 CPU-s per run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP]
        here = Path(dirpath)
        found += [here / n for n in filenames if os.path.splitext(n)[1] in STDLIB_SUFFIXES and n not in STDLIB_SKIP]
    return sorted(p for p in found if p.is_file())


def _walk(root: Path, spec: SourceSpec) -> tuple[list[SourceFile], dict[str, int]]:
    """Files of a folder in a fixed (sorted) order; hidden entries left out; saved datasets taken whole;
    files of other formats (images, archives, ...) counted by suffix and reported, not read."""
    files: list[SourceFile] = []
    skipped: Counter = Counter()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        if here != root and _is_hf_dataset(here):
            files.append(_hf_file(here, spec))
            dirnames[:] = []
            continue
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            one = _classify(here / name, spec, explicit=False)
            if one is None:
                if not (name.endswith(".idx") and (here / name).with_suffix(".bin").is_file()):
                    skipped[Path(name).suffix.lower()] += 1
            else:
                files.append(one)
    return files, dict(skipped)


def sniff(head: bytes) -> str:
    """What the first bytes of a file are."""
    if not head:
        return "empty"
    for magic, kind in ((b"PAR1", "parquet"), (b"ARROW1", "arrow"), (b"\x93NUMPY", "npy"),
                        (b"MMIDIDX\x00\x00", "megatron index"), (b"\x1f\x8b", "gzip data"),
                        (b"PK\x03\x04", "a zip archive"), (b"\xff\xff\xff\xff", "arrow stream")):
        if head.startswith(magic):
            return kind
    if b"\x00" in head:
        return "binary data (NUL bytes)"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the end of the sniffed block
            return f"binary data (not UTF-8 at byte {exc.start})"
    return "text"


def _classify(path: Path, spec: SourceSpec, explicit: bool) -> SourceFile | None:
    suffix = path.suffix.lower()
    if suffix == ".idx":  # half of a Megatron pair: taken with its .bin
        return SourceFile(path.with_suffix(".bin"), "megatron") if explicit else None
    with open(path, "rb") as fh:
        head = fh.read(SNIFF_BYTES)
    found = sniff(head)
    if suffix == ".bin":
        if path.with_suffix(".idx").is_file():
            return SourceFile(path, "megatron")
        if explicit:
            raise refuse(path, f"a .bin without its .idx (found {found})")
        return None
    by_content = {"parquet": "parquet", "arrow": "arrow", "arrow stream": "arrow", "npy": "npy"}
    expected = {".parquet": "parquet", ".arrow": "arrow", ".npy": "npy", ".jsonl": "jsonl", ".ndjson": "jsonl",
                ".json": "json"}.get(suffix, "text" if suffix in TEXT_SUFFIXES else None)
    if expected in ("parquet", "arrow", "npy") or (expected is None and found in by_content):
        fmt = by_content.get(found)
        if fmt is None or (expected and fmt != expected):
            raise refuse(path, f"extension {suffix} but the content is {found}")
        return _with_field(SourceFile(path, fmt), spec)
    if expected is None and not explicit:
        return None
    if found != "text":
        what = "empty file" if found == "empty" else f"{found}, not text"
        raise refuse(path, what if expected is None else f"extension {suffix} but {what}")
    if expected in ("jsonl", "json"):
        return _with_field(SourceFile(path, "json" if head.lstrip()[:1] == b"[" else "jsonl"), spec)
    return SourceFile(path, "text")


def _is_hf_dataset(folder: Path) -> bool:
    """A `datasets` save_to_disk folder: a Dataset (state.json + dataset_info.json) or a DatasetDict."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _hf_file(folder: Path, spec: SourceSpec) -> SourceFile:
    return _with_field(SourceFile(folder, "hf_disk"), spec)


# ---------------------------------------------------------------------------------------------- fields


def _with_field(f: SourceFile, spec: SourceSpec) -> SourceFile:
    if f.fmt in TOKEN_FORMATS:
        return f
    columns = _columns(f, spec)
    tf, mf = spec.text_field, spec.messages_field
    if columns.get(tf) == "text":
        f.field = tf
    elif columns.get(mf) == "list":
        f.field, f.chat = mf, True
    else:
        texts = [k for k, v in columns.items() if v == "text"]
        held = f"; '{tf}' holds {columns[tf]}" if tf in columns else ""
        raise ValueError(f"data.source '{f.path}': no text field '{tf}' (data.text_field) and no message list "
                         f"'{mf}' (data.messages_field){held}; found fields {sorted(columns)}; allowed: "
                         f"data.text_field = one of {texts or 'the text fields (there are none)'}")
    return f


def _kind(value) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def _arrow_kind(t) -> str:
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list"
    return str(t)


def _columns(f: SourceFile, spec: SourceSpec) -> dict[str, str]:
    """Field name -> 'text', 'list' or another type name, from the first record or the schema."""
    if f.fmt in ("jsonl", "json"):
        first = next(_json_records(f.path, f.fmt, limit=1), None)
        if first is None:
            raise refuse(f.path, "no records")
        if not isinstance(first[1], dict):
            raise refuse(f.path, f"record {first[0]} is a JSON {type(first[1]).__name__}, not an object")
        return {k: _kind(v) for k, v in first[1].items()}
    if f.fmt == "hf_disk":
        ds = _hf_dataset(f.path, spec)
        return {k: _arrow_kind(t) for k, t in zip(ds.data.schema.names, ds.data.schema.types, strict=True)}
    schema = _arrow_schema(f)
    return {k: _arrow_kind(t) for k, t in zip(schema.names, schema.types, strict=True)}


def _arrow_schema(f: SourceFile):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if f.fmt == "parquet":
            return pq.ParquetFile(f.path).schema_arrow
        return _open_arrow(f.path).schema
    except (pa.ArrowException, OSError) as exc:  # a cut-short copy: pyarrow's message names no file
        raise refuse(f.path, f"not a readable {f.fmt} file ({exc})") from None


def _open_arrow(path: Path):
    import pyarrow as pa

    try:
        return pa.ipc.open_file(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.memory_map(str(path)))  # what `datasets` writes


def _hf_dataset(folder: Path, spec: SourceSpec):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.source '{folder}' is a Hugging Face dataset folder: needs the `datasets` "
                         f"package (pip install 'paratrain[data]')") from None
    ds = datasets.load_from_disk(str(folder))
    if isinstance(ds, datasets.DatasetDict):
        if spec.split not in ds:
            raise ValueError(f"data.source '{folder}': no split '{spec.split}' (data.split); allowed: "
                             f"{', '.join(ds)}")
        ds = ds[spec.split]
    return ds


# ---------------------------------------------------------------------------------------------- reading


def _json_records(path: Path, fmt: str, limit: int | None = None) -> Iterator[tuple[int, object]]:
    """(record number, parsed record). JSONL is streamed line by line; a .json array is loaded whole
    (use JSONL for large data)."""
    if fmt == "json":
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise refuse(path, f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, list):
            raise refuse(path, f"a JSON {type(data).__name__}; a .json file must hold a list of records")
        yield from enumerate(data[:limit] if limit else data, start=1)
        return
    n = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise refuse(path, f"line {lineno} is not valid JSON ({exc.msg})") from None
            n += 1
            if limit and n >= limit:
                return


def _record_values(f: SourceFile, spec: SourceSpec) -> Iterator[tuple[str, object]]:
    """(where, value of the text field) for every record of a records file, streamed."""
    if f.fmt in ("jsonl", "json"):
        for n, rec in _json_records(f.path, f.fmt):
            if not isinstance(rec, dict) or f.field not in rec:
                keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise refuse(f.path, f"record at line {n} has no '{f.field}' field (found {keys})")
            yield f"line {n}", rec[f.field]
        return
    if f.fmt == "hf_disk":
        batches = (b[f.field] for b in _hf_dataset(f.path, spec).select_columns([f.field]).iter(RECORD_BATCH))
    elif f.fmt == "parquet":
        import pyarrow.parquet as pq

        batches = (b.column(0).to_pylist()
                   for b in pq.ParquetFile(f.path).iter_batches(batch_size=RECORD_BATCH, columns=[f.field]))
    else:
        reader = _open_arrow(f.path)
        it = (reader.get_batch(i) for i in range(reader.num_record_batches)) if hasattr(reader, "get_batch") \
            else iter(reader)
        batches = (b.column(f.field).to_pylist() for b in it)
    row = 0
    for values in batches:
        for v in values:
            row += 1
            yield f"row {row}", v


@dataclass
class Block:
    """A piece of a document's text. `special`: the text already holds special tokens (a rendered chat)."""

    text: str
    doc_end: bool
    special: bool = False


class ByteBudget:
    """data.max_source_bytes: an explicit cap on the UTF-8 bytes of text read; None = no cap."""

    def __init__(self, cap: int | None):
        self.cap, self.used, self.hit = cap, 0, False

    def take(self, text: str) -> str | None:
        """`text`, cut where the cap falls (on a character boundary); None once the cap is reached."""
        if self.cap is None:
            return text
        room = self.cap - self.used
        if room <= 0:
            self.hit = True
            return None
        raw = text.encode("utf-8")
        if len(raw) > room:
            raw, self.hit = raw[:room], True
            text = raw.decode("utf-8", errors="ignore")
        self.used += len(raw)
        return text


def text_blocks(src: Source, budget: ByteBudget, render_chat=None) -> Iterator[Block]:
    """The documents of a text source, in order, as blocks: a plain text file is one document read in
    1 MiB blocks; every record of a records file is one document. Stops at the byte budget."""
    for f in src.files:
        if f.fmt == "text":
            yield from _file_blocks(f.path, budget)
        else:
            for where, value in _record_values(f, src.spec):
                if f.chat:
                    text = render_chat(value, f"{f.path} {where}")
                elif isinstance(value, str):
                    text = value
                else:
                    raise refuse(f.path, f"{where}: field '{f.field}' is a {type(value).__name__}, not text")
                cut = budget.take(text)
                if cut is None:
                    return
                yield Block(cut, True, f.chat)
        if budget.hit:
            return


def _file_blocks(path: Path, budget: ByteBudget) -> Iterator[Block]:
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    started = False
    with open(path, "rb") as fh:
        while True:
            raw = fh.read(BLOCK_BYTES)
            text = decoder.decode(raw, final=not raw)
            cut = budget.take(text)
            if cut is None:  # the cap fell exactly at the end of the previous block
                if started:
                    yield Block("", True)
                return
            started = True
            last = not raw or budget.hit
            if cut or last:
                yield Block(cut, last)
            if last:
                return
