"""`paratrain data prepare`: sources -> tokenizer -> memory-mapped token shards with an index.

Streaming end to end: documents are read in blocks, cut into segments (tokenize.segments), grouped into
chunks of about CHUNK_CHARS characters and encoded by `workers` processes with a bounded number of chunks
in flight, so memory does not grow with the corpus. Output per source (<prepared_dir>/src-<hash>/):
shard-NNNNN.bin token files of about data.shard_tokens tokens each, and index.json (shards, token counts,
the train/val split, the content fingerprint). A shard is renamed into place when complete and
progress.json records how many chunks it covers, so an interrupted prepare resumes after the last
complete shard. Pre-tokenized sources (.npy, Megatron .bin/.idx) are not copied: their index points at
the files themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from paratrain.train.data import sources as S
from paratrain.train.data import tokenize as T

FORMAT_VERSION = 2  # bump when the token output of the same input changes
CHUNK_CHARS = 1 << 20


def source_specs(cfg) -> list[S.SourceSpec]:
    if cfg.mix:
        return [S.SourceSpec(m.source, m.weight, m.text_field or cfg.text_field,
                             m.messages_field or cfg.messages_field, m.split or cfg.split) for m in cfg.mix]
    return [S.SourceSpec(cfg.source, 1.0, cfg.text_field, cfg.messages_field, cfg.split)]


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def prepare(cfg, force: bool = False, log=print, hf_path: str | None = None, progress: bool | None = None,
            summary: bool = True) -> Path:
    """Prepare `cfg` (a DataSection) into cfg.prepared_dir; returns that folder. Idempotent: a folder prepared
    from the same content and settings is reused; a changed corpus (a file added, edited, removed) or a
    changed setting is prepared again. Every input is checked before any tokenization. summary=False: no
    summary line in `log` (`data prepare` prints it as its result)."""
    out = Path(cfg.prepared_dir)
    show = sys.stderr.isatty() if progress is None else progress
    srcs = [S.resolve_source(spec) for spec in source_specs(cfg)]  # refuses bad inputs, before any work
    info = T.resolve_tokenizer(cfg.tokenizer, hf_path, cfg.vocab_size)
    _check_tokenizer_fits(srcs, info)
    content = [s.content_fingerprint() for s in srcs]
    # tokens: everything but the weights (a trained tokenizer depends on every source); meta: and the weights
    tokens_key = _digest(FORMAT_VERSION, info.digest, cfg.vocab_size, content,
                         [replace(s.spec, weight=1.0) for s in srcs], cfg.max_source_bytes, cfg.val_fraction)
    fingerprint = _digest(tokens_key, [s.spec.weight for s in srcs])
    meta_path = out / "meta.json"
    old = _read_json(meta_path)
    if not force and old and old.get("fingerprint") == fingerprint:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok, tok_file = _tokenizer(out, info, srcs, cfg, tokens_key, force, log, show)
    vocab = tok.get_vocab_size() if tok else None
    eos = T.eos_id(tok) if tok else None
    entries = []
    for src, fp in zip(srcs, content, strict=True):
        # the weight is not part of a source's tokens: reweighting a mixture re-tokenizes nothing
        src_fp = _digest(tokens_key if info.json_text is None else info.digest, fp, replace(src.spec, weight=1.0),
                         cfg.max_source_bytes, cfg.val_fraction, cfg.shard_tokens)
        folder = out / src.key
        folder.mkdir(exist_ok=True)
        index = _read_json(folder / "index.json")
        if force or not index or index.get("fingerprint") != src_fp:
            if src.kind == "tokens":
                index = _index_tokens(src, folder, src_fp, vocab, cfg)
            else:
                index = _tokenize_source(src, folder, src_fp, tok, tok_file, info, eos, cfg, log, show)
        entries.append((src, index))
    meta = _meta(fingerprint, entries, vocab, eos, info, cfg)
    _write_json(meta_path, meta)
    if summary:
        log(summary_line(out, meta))
    return out


def _check_tokenizer_fits(srcs, info) -> None:
    text = [s for s in srcs if s.kind == "text"]
    if text and info.json_text is None and any(s.kind == "tokens" for s in srcs):
        raise ValueError("data.tokenizer='train' with pre-tokenized and text sources: the token ids must come "
                         "from one tokenizer; allowed: data.tokenizer = the tokenizer the pre-tokenized data used")
    chat = next((s for s in srcs if s.chat), None)
    if chat and not info.chat_template:
        f = next(f for f in chat.files if f.chat)
        raise ValueError(f"data.source '{f.path}': records hold chat messages ('{f.field}') but the tokenizer "
                         f"{info.setting} has no chat template (tokenizer_config.json chat_template or "
                         f"chat_template.jinja beside it); allowed: a tokenizer folder with a chat template, or "
                         f"data.text_field naming a text field")


def _tokenizer(out: Path, info, srcs, cfg, fingerprint: str, force: bool, log, show):
    """The tokenizer object and its saved file in the prepared folder (trained once; reused on resume)."""
    path = out / "tokenizer.json"
    if not any(s.kind == "text" for s in srcs) and info.json_text is None:
        return None, None  # pre-tokenized only, no tokenizer named: vocabulary from the data
    marker = out / "tokenizer.fingerprint"
    if info.json_text is not None:
        tok = info.tok
    elif not force and path.is_file() and marker.is_file() and marker.read_text() == fingerprint:
        tok = T.load(path.read_text(encoding="utf-8"))  # trained by an interrupted run of the same corpus
    else:
        t0 = time.perf_counter()
        pieces = (p for src in srcs if src.kind == "text"
                  for seg in _segments(src, cfg, info, show, f"train tokenizer ({src.spec.source})")
                  for p in T.cut_long_runs(seg[0]))
        tok = T.train_bpe(pieces, cfg.vocab_size)
        log(f"trained a byte-level BPE tokenizer ({tok.get_vocab_size()} tokens) in {time.perf_counter() - t0:.1f} s")
    tmp = path.with_name("tokenizer.json.tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    marker.write_text(fingerprint)
    return tok, path


def _segments(src, cfg, info, show: bool, desc: str) -> Iterator[tuple[str, bool, bool]]:
    """(segment text, add_special_tokens, doc_end) of a text source, within data.max_source_bytes."""
    budget = S.ByteBudget(cfg.max_source_bytes)
    render = T.chat_renderer(info) if src.chat else None
    total = cfg.max_source_bytes or src.total_bytes()
    bar = _bar(show, total, desc)
    first = True
    try:
        for block in S.text_blocks(src, budget, render):
            parts = T.segments(block.text) if block.text else [""]
            for i, seg in enumerate(parts):
                yield seg, first and not block.special, block.doc_end and i == len(parts) - 1
                first = False
            bar.update(len(block.text.encode("utf-8", errors="ignore")) if bar.total else 0)
            first = block.doc_end
    finally:
        bar.close()
    src.capped = budget.hit


def _bar(show: bool, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not show, leave=False,
                file=sys.stderr)


def _chunks(segs: Iterator[tuple[str, bool, bool]]) -> Iterator[list[tuple[str, bool, bool]]]:
    chunk, size = [], 0
    for seg in segs:
        chunk.append(seg)
        size += len(seg[0])
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encoded(chunks, tok, tok_file: Path, eos, dtype: str, workers: int) -> Iterator[tuple[np.ndarray, int]]:
    """(token array, documents ended) of each chunk, in order. workers > 1: that many processes, at most 2 chunks each in
    flight (bounded memory: the reader never runs ahead of the encoders)."""
    if workers <= 1:
        for chunk in chunks:
            yield T.encode_items(tok, chunk, eos, dtype), _docs(chunk)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # spawn: the caller may hold a process group and threads (fork would copy them); the workers import
    # only numpy and tokenizers. TOKENIZERS_PARALLELISM=false: one thread per worker, `workers` cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append((pool.submit(T.worker_encode, str(tok_file), chunk, eos, dtype), _docs(chunk)))
            if len(pending) >= 2 * workers:
                future, docs = pending.popleft()
                yield future.result(), docs
        while pending:
            future, docs = pending.popleft()
            yield future.result(), docs


def _docs(chunk) -> int:
    return sum(1 for _, _, doc_end in chunk if doc_end)


def _workers(cfg, src) -> int:
    if cfg.workers:
        return cfg.workers
    # auto: tokenizing a small corpus inline is faster than starting processes
    small = (cfg.max_source_bytes or src.total_bytes()) < 32 * CHUNK_CHARS
    return 1 if small else max(1, min(os.cpu_count() or 1, 8))


def _tokenize_source(src, folder: Path, src_fp: str, tok, tok_file, info, eos, cfg, log, show) -> dict:
    """Stream `src` through the tokenizer into shards; resumes from progress.json of the same fingerprint."""
    dtype = np.dtype(np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32).name
    state_path = folder / "progress.json"
    state = _read_json(state_path)
    if not state or state.get("fingerprint") != src_fp:
        for stale in folder.glob("shard-*"):
            stale.unlink()
        state = {"fingerprint": src_fp, "shards": [], "chunks_done": 0, "documents": 0}
    elif state["shards"]:
        log(f"resuming {src.spec.source}: {len(state['shards'])} complete shard(s), "
            f"{sum(s['tokens'] for s in state['shards']):,} tokens")
    workers = _workers(cfg, src)
    skip = state["chunks_done"]
    chunks = _chunks(_segments(src, cfg, info, show, f"tokenize {src.spec.source}"))
    todo = (c for i, c in enumerate(chunks) if i >= skip)  # resumed: chunks of complete shards are read, not encoded
    t0, new_tokens = time.perf_counter(), 0
    shard_file, shard_tokens, shard_docs, fh = None, 0, 0, None
    bar = _bar(show, 0, f"tokens {src.spec.source}")
    bar.unit, bar.unit_scale = "tok", True
    done = skip
    try:
        for arr, docs in _encoded(todo, tok, tok_file, eos, dtype, workers):
            if fh is None:
                shard_file = folder / f"shard-{len(state['shards']):05d}.bin"
                fh = open(shard_file.with_suffix(".bin.tmp"), "wb")
                shard_tokens = shard_docs = 0
            arr.tofile(fh)
            shard_tokens += len(arr)
            shard_docs += docs
            done += 1
            new_tokens += len(arr)
            bar.update(len(arr))
            bar.set_postfix_str(f"{new_tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tokens/s")
            if shard_tokens >= cfg.shard_tokens:
                _close_shard(fh, shard_file, shard_tokens, shard_docs, done, state, state_path)
                fh = None
        if fh is not None:
            _close_shard(fh, shard_file, shard_tokens, shard_docs, done, state, state_path)
    finally:
        bar.close()
        if fh is not None and not fh.closed:
            fh.close()
    wall = time.perf_counter() - t0
    total = sum(s["tokens"] for s in state["shards"])
    if total < 2:
        raise ValueError(f"data.source='{src.spec.source}': {total} tokens after tokenization; allowed: a "
                         f"source with text")
    log(f"tokenized {src.spec.source}: {new_tokens:,} tokens in {wall:.1f} s ({new_tokens / max(wall, 1e-9):,.0f} "
        f"tokens/s, {workers} worker(s))")
    index = _split_index(src, src_fp, total, cfg, [{"path": s["path"], "dtype": dtype, "offset": 0,
                                                    "tokens": s["tokens"]} for s in state["shards"]])
    index["documents"] = sum(s["documents"] for s in state["shards"])
    index["tokens_per_s"] = new_tokens / max(wall, 1e-9)
    index["workers"] = workers
    _write_json(folder / "index.json", index)
    state_path.unlink(missing_ok=True)
    return index


def _close_shard(fh, shard_file: Path, tokens: int, docs: int, done: int, state: dict, state_path: Path) -> None:
    fh.flush()
    os.fsync(fh.fileno())
    fh.close()
    shard_file.with_suffix(".bin.tmp").replace(shard_file)
    state["shards"].append({"path": shard_file.name, "tokens": tokens, "documents": docs})
    state["chunks_done"] = done
    _write_json(state_path, state)


def _split_index(src, src_fp: str, total: int, cfg, shards: list[dict]) -> dict:
    n_val = max(int(total * cfg.val_fraction), 1)
    return {"format_version": FORMAT_VERSION, "fingerprint": src_fp, "source": src.spec.source,
            "kind": src.kind, "formats": src.formats(), "files": len(src.files), "skipped_files": src.skipped,
            "max_source_bytes": cfg.max_source_bytes, "capped": src.capped,
            "tokens": total, "train_tokens": total - n_val, "val_tokens": n_val, "shards": shards}


def _index_tokens(src, folder: Path, src_fp: str, vocab: int | None, cfg) -> dict:
    """Pre-tokenized files are used in place: checked (integer dtype, ids in the vocabulary), not copied."""
    from paratrain.train.data import indexed

    shards, docs, budget = [], 0, cfg.max_source_bytes
    for f in src.files:
        if f.fmt == "npy":
            try:
                arr = np.load(f.path, mmap_mode="r")
            except (ValueError, OSError, EOFError) as exc:  # a cut-short copy: header or data shorter than it says
                raise S.refuse(f.path, f"not a complete .npy ({exc})") from None
            if arr.dtype.kind not in "iu":
                raise S.refuse(f.path, f"a .npy of {arr.dtype}; token arrays must be integers")
            offset, dtype, n = int(arr.offset), arr.dtype, int(arr.size)
            if not arr.flags.c_contiguous:
                raise S.refuse(f.path, "a Fortran-order .npy; token arrays must be C-order")
        else:
            ds = indexed.read_index(f.path)
            offset, dtype, n = 0, ds.dtype, ds.num_tokens
            docs += ds.num_documents
        path = f.path  # the .npy, or the Megatron .bin
        if budget is not None:  # the cap, in bytes of token data
            n = min(n, max(budget, 0) // dtype.itemsize)
            budget -= n * dtype.itemsize
        if n:
            top = _check_ids(path, dtype, offset, n, vocab)
            shards.append({"path": str(path.resolve()), "dtype": dtype.name, "offset": offset, "tokens": n,
                           "max_id": top})
    total = sum(s["tokens"] for s in shards)
    if total < 2:
        raise ValueError(f"data.source='{src.spec.source}': {total} tokens; allowed: a source with tokens")
    src.capped = budget is not None and budget <= 0
    index = _split_index(src, src_fp, total, cfg, shards)
    index["documents"] = docs or None
    index["max_id"] = max(s["max_id"] for s in shards)
    _write_json(folder / "index.json", index)
    return index


def _check_ids(path: Path, dtype: np.dtype, offset: int, n: int, vocab: int | None, block: int = 1 << 24) -> int:
    """Every id in [0, vocab): one pass over the file in blocks (bounded memory). Returns the largest id."""
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,))
    lo = hi = 0
    for start in range(0, n, block):
        part = tokens[start:start + block]
        lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
    if lo < 0 or (vocab is not None and hi >= vocab):
        raise ValueError(f"data.source '{path}': token ids from {lo} to {hi}, outside the tokenizer's vocabulary "
                         f"[0, {vocab}); allowed: data.tokenizer = the tokenizer that produced these ids")
    return hi


def _meta(fingerprint: str, entries, vocab, eos, info, cfg) -> dict:
    weights = np.array([src.spec.weight for src, _ in entries], dtype=float)
    weights = weights / weights.sum()
    if vocab is None:  # pre-tokenized only: the data's largest id + 1
        vocab = max(int(index.get("max_id", 0)) for _, index in entries) + 1
    sources = [{"dir": src.key, "source": src.spec.source, "weight": float(w), "formats": index["formats"],
                "files": index["files"], "skipped_files": index["skipped_files"], "documents": index["documents"],
                "train_tokens": index["train_tokens"], "val_tokens": index["val_tokens"], "capped": index["capped"]}
               for (src, index), w in zip(entries, weights, strict=True)]
    dtypes = {s["dtype"] for _, index in entries for s in index["shards"]}
    return {"fingerprint": fingerprint, "format_version": FORMAT_VERSION, "vocab_size": vocab, "eos_id": eos,
            "dtype": dtypes.pop() if len(dtypes) == 1 else "mixed", "tokenizer": info.setting,
            "documents": sum(s["documents"] or 0 for s in sources),
            "train_tokens": sum(s["train_tokens"] for s in sources),
            "val_tokens": sum(s["val_tokens"] for s in sources),
            "source": " + ".join(s["source"] for s in sources), "max_source_bytes": cfg.max_source_bytes,
            "sources": sources}


def summary_line(out: Path, meta: dict) -> str:
    cap = ""
    if meta.get("max_source_bytes"):
        hit = any(s["capped"] for s in meta["sources"])
        cap = f"; data.max_source_bytes={meta['max_source_bytes']:,} ({'reached: corpus cut' if hit else 'not reached'})"
    skipped = sum(n for s in meta["sources"] for n in s["skipped_files"].values())
    skip = f"; {skipped} file(s) of other formats left out" if skipped else ""
    return (f"{out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens from "
            f"{meta['documents']:,} documents of {meta['source']}, vocab {meta['vocab_size']:,} "
            f"({meta['dtype']}){cap}{skip}")


def read_meta(prepared_dir: str | Path) -> dict:
    path = Path(prepared_dir) / "meta.json"
    meta = _read_json(path)
    if meta is None or "sources" not in meta:
        raise ValueError(f"data.prepared_dir='{prepared_dir}': not prepared (run `paratrain data prepare`)")
    return meta
