"""Megatron-Core's indexed dataset (.bin tokens + .idx index), read and written byte for byte as
megatron/core/datasets/indexed_dataset.py does (_IndexWriter / _IndexReader), so corpora already
preprocessed for Megatron (tools/preprocess_data.py) train here without re-tokenizing.

.idx layout (little endian): b"MMIDIDX\\x00\\x00", version u64 (=1), dtype code u8, sequence count u64,
document count u64, sequence lengths int32[seq], sequence byte pointers int64[seq], document indices
int64[doc] (sequence index where each document starts, first 0, last = seq), then int8 modes per
sequence for multimodal data (ignored here). The .bin holds the tokens of every sequence back to back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
# Megatron's DType enum: numeric code of the token dtype stored in the .idx
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_HEAD_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # 34, as Megatron's reader computes it


@dataclass
class IndexedDataset:
    """An opened .bin/.idx pair: the index arrays are memory-mapped views, nothing is read eagerly."""

    bin_path: Path
    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def tokens(self) -> np.ndarray:
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r")


def paths(prefix: str | Path) -> tuple[Path, Path]:
    """(.bin, .idx) of a prefix or of either file (names may hold other dots: corpus.v1.bin)."""
    base = str(prefix)
    if base.endswith((".bin", ".idx")):
        base = base[:-4]
    return Path(base + ".bin"), Path(base + ".idx")


def read_index(prefix: str | Path) -> IndexedDataset:
    """Open `prefix`.idx / `prefix`.bin; a file that is not Megatron's format is refused with one line."""
    bin_, idx = paths(prefix)
    for path in (idx, bin_):
        if not path.is_file():
            raise ValueError(f"data.source '{prefix}': Megatron indexed dataset needs both {idx.name} and "
                             f"{bin_.name}; {path.name} is missing")
    with open(idx, "rb") as fh:
        head = fh.read(_HEAD_BYTES)
    if len(head) < _HEAD_BYTES or head[:9] != INDEX_HEADER:
        raise ValueError(f"data.source '{idx}': not a Megatron index (header {head[:9]!r}, expected {INDEX_HEADER!r})")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in DTYPE_CODES or DTYPE_CODES[code] in (np.float32, np.float64):
        raise ValueError(f"data.source '{idx}': Megatron index version {version}, dtype code {code}; allowed: "
                         f"version 1 with an integer token dtype (codes 1-5, 8)")
    buf = np.memmap(idx, mode="r", dtype=np.uint8)
    need = _HEAD_BYTES + seqs * 4 + seqs * 8 + docs * 8
    if len(buf) < need:
        raise ValueError(f"data.source '{idx}': index truncated ({len(buf)} bytes, header says at least {need})")
    lengths = np.frombuffer(buf, dtype=np.int32, count=seqs, offset=_HEAD_BYTES)
    pointers = np.frombuffer(buf, dtype=np.int64, count=seqs, offset=_HEAD_BYTES + seqs * 4)
    doc_idx = np.frombuffer(buf, dtype=np.int64, count=docs, offset=_HEAD_BYTES + seqs * 12)
    ds = IndexedDataset(bin_, np.dtype(DTYPE_CODES[code]), lengths, pointers, doc_idx)
    _check_contiguous(ds)
    return ds


def _check_contiguous(ds: IndexedDataset, block: int = 1 << 20) -> None:
    """Sequences back to back from byte 0 (what Megatron's builder writes), and the .bin exactly that long:
    then the whole .bin is one token stream in document order. Checked in blocks: bounded memory."""
    item = ds.dtype.itemsize
    expected = 0
    for lo in range(0, len(ds.sequence_lengths), block):
        lengths = ds.sequence_lengths[lo:lo + block].astype(np.int64)
        starts = expected + np.concatenate([[0], np.cumsum(lengths[:-1] * item)])
        if (ds.sequence_pointers[lo:lo + block] != starts).any():
            raise ValueError(f"data.source '{ds.bin_path}': sequence pointers are not back to back; allowed: a "
                             f".bin/.idx written by Megatron's IndexedDatasetBuilder")
        expected += int(lengths.sum()) * item
    size = ds.bin_path.stat().st_size
    if size != expected:
        raise ValueError(f"data.source '{ds.bin_path}': {size} bytes, but the index describes {expected}")


def write_indexed(prefix: str | Path, documents: list[np.ndarray], dtype=np.int32) -> None:
    """Write documents (one sequence each) as Megatron's IndexedDatasetBuilder + _IndexWriter do."""
    bin_path, idx_path = paths(prefix)
    code = next(c for c, t in DTYPE_CODES.items() if np.dtype(t) == np.dtype(dtype))
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)])
    with open(bin_path, "wb") as fh:
        for d in documents:
            fh.write(np.asarray(d, dtype=dtype).tobytes(order="C"))
    doc_idx = np.arange(len(documents) + 1, dtype=np.int64)
    with open(idx_path, "wb") as fh:
        fh.write(INDEX_HEADER)
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", code))
        fh.write(struct.pack("<Q", len(lengths)))
        fh.write(struct.pack("<Q", len(doc_idx)))
        fh.write(lengths.tobytes(order="C"))
        fh.write(pointers.astype(np.int64).tobytes(order="C"))
        fh.write(doc_idx.tobytes(order="C"))
