"""Data: tokenize text into a packed, memory-mapped token file, and a deterministic, resumable sampler.

The sampler defines one *global* order of samples per epoch; a data-parallel rank takes its slice of each
global batch by global sample index. Changing the data-parallel size therefore keeps the same global order,
which is what lets a checkpoint resume under a different layout and continue the same run.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from paratrain.config import DataSection

EOS = "<|endoftext|>"
# End-of-document tokens of common tokenizer.json files (ours/GPT-2, Llama 3, Llama 2/SentencePiece, Gemma).
EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>")
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".jsonl")


def source_files(source: str) -> list[Path]:
    """The documents of a source, in a fixed order. 'stdlib' = this Python's standard library source."""
    root = Path(sysconfig.get_paths()["stdlib"]) if source == "stdlib" else Path(source)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"data.source='{source}': not 'stdlib', a text file or a folder of text files")
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3")
    files = [p for p in sorted(root.rglob("*")) if p.suffix in TEXT_SUFFIXES and p.is_file()
             and not any(part in skip for part in p.relative_to(root).parts)]
    if not files:
        raise ValueError(f"data.source='{source}': no text files ({', '.join(TEXT_SUFFIXES)}) found")
    return files


def read_documents(source: str, max_bytes: int) -> list[str]:
    docs, total = [], 0
    for path in source_files(source):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return docs


def _fingerprint(cfg: DataSection) -> str:
    key = json.dumps([cfg.source, cfg.tokenizer, cfg.vocab_size, cfg.max_source_bytes, cfg.val_fraction])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def build_tokenizer(cfg: DataSection, docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if cfg.tokenizer != "train":
        path = Path(cfg.tokenizer)
        if not path.is_file():
            raise ValueError(f"data.tokenizer='{cfg.tokenizer}': no such file; allowed: 'train' or a tokenizer.json path")
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def prepare(cfg: DataSection, force: bool = False, log=print) -> Path:
    """Tokenize `cfg.source` into `cfg.prepared_dir`/{train,val}.bin (+ meta.json, tokenizer.json).

    Idempotent: a folder prepared from the same settings is reused. Files are written under temporary
    names and renamed last, so an interrupted prepare never leaves a folder that looks complete.
    """
    out = Path(cfg.prepared_dir)
    meta_path = out / "meta.json"
    fp = _fingerprint(cfg)
    if not force and meta_path.is_file() and json.loads(meta_path.read_text()).get("fingerprint") == fp:
        return out
    if cfg.tokenizer != "train" and not Path(cfg.tokenizer).is_file():  # before reading the corpus
        raise ValueError(f"data.tokenizer='{cfg.tokenizer}': no such file; allowed: 'train' or a tokenizer.json path")
    out.mkdir(parents=True, exist_ok=True)
    docs = read_documents(cfg.source, cfg.max_source_bytes)
    tok = build_tokenizer(cfg, docs)
    vocab = tok.get_vocab_size()
    eos_id = next((i for i in map(tok.token_to_id, EOS_NAMES) if i is not None), None)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        if eos_id is not None:
            ids.append(eos_id)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    tokens = np.asarray(ids, dtype=dtype)
    n_val = max(int(len(tokens) * cfg.val_fraction), 1)
    for split, arr in (("train", tokens[:-n_val]), ("val", tokens[-n_val:])):
        tmp = out / f"{split}.bin.tmp"
        arr.tofile(tmp)
        tmp.replace(out / f"{split}.bin")
    tok.save(str(out / "tokenizer.json"))
    meta = {"fingerprint": fp, "vocab_size": vocab, "dtype": np.dtype(dtype).name, "eos_id": eos_id,
            "documents": len(docs), "train_tokens": int(len(tokens) - n_val), "val_tokens": n_val,
            "source": cfg.source}
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(meta_path)
    log(f"prepared {len(tokens):,} tokens from {len(docs)} documents (vocab {vocab}) in {out}")
    return out


def read_meta(prepared_dir: str | Path) -> dict:
    path = Path(prepared_dir) / "meta.json"
    if not path.is_file():
        raise ValueError(f"data.prepared_dir='{prepared_dir}': not prepared (run `paratrain data prepare`)")
    return json.loads(path.read_text())


class TokenWindows:
    """Non-overlapping windows of seq_len+1 tokens over a memory-mapped token file (inputs and targets)."""

    def __init__(self, prepared_dir: str | Path, split: str, seq_len: int):
        meta = read_meta(prepared_dir)
        self.tokens = np.memmap(Path(prepared_dir) / f"{split}.bin", dtype=meta["dtype"], mode="r")
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"split '{split}' has {len(self.tokens)} tokens, fewer than seq_len+1={seq_len + 1}")

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1] for i in indices])
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1], rows[:, 1:]


@dataclass
class GlobalSampler:
    """Step t's global batch = samples [t*B, (t+1)*B) of an endless sequence of seeded per-epoch permutations.

    State is just the number of optimizer steps consumed, so it checkpoints as one integer and is independent
    of the data-parallel layout.
    """

    num_samples: int
    global_batch: int
    seed: int
    step: int = 0

    def _epoch_perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_indices(self, step: int) -> np.ndarray:
        g = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        epochs, offsets = np.divmod(g, self.num_samples)
        out = np.empty_like(g)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._epoch_perm(int(e))[offsets[mask]]
        return out

    def rank_indices(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """This data-parallel rank's contiguous slice of step's global batch."""
        per_rank = self.global_batch // dp_size
        return self.global_indices(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]

    def next_indices(self, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray:
        idx = self.rank_indices(self.step, dp_rank, dp_size)
        self.step += 1
        return idx

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data sampler state: checkpoint has {key}={state[key]}, this run has "
                                 f"{getattr(self, key)}; resume needs the same data and global batch")
        self.step = int(state["step"])
