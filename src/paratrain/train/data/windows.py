"""Training samples: windows of seq_len+1 tokens over the prepared shards, and the deterministic global
sample order (one source: GlobalSampler; a weighted mixture: BlendSampler).

A sampler defines one *global* order of samples; a data-parallel rank takes its slice of each global batch
by global sample index. Changing the data-parallel size therefore keeps the same global order, which is
what lets a checkpoint resume under a different layout and continue the same run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paratrain.train.data.pipeline import read_meta

BLEND_PERIOD = 10_000  # the mixture's source pattern repeats every this many samples (weights to 1e-4)


class TokenStream:
    """The token shards of one source as one sequence (memory-mapped, opened on first use)."""

    def __init__(self, folder: Path, shards: list[dict]):
        self.folder, self.shards = folder, shards
        self.starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in shards])]).astype(np.int64)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._maps:
            s = self.shards[i]
            path = Path(s["path"]) if Path(s["path"]).is_absolute() else self.folder / s["path"]
            self._maps[i] = np.memmap(path, dtype=s["dtype"], mode="r", offset=s["offset"], shape=(s["tokens"],))
        return self._maps[i]

    def read(self, start: int, n: int) -> np.ndarray:
        out, i = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while n > 0:
            lo = start - int(self.starts[i])
            part = self._shard(i)[lo:lo + n]
            out.append(part.astype(np.int64))
            start, n, i = start + len(part), n - len(part), i + 1
        return out[0] if len(out) == 1 else np.concatenate(out)


class TokenWindows:
    """Non-overlapping windows of seq_len+1 tokens over one source's split (inputs and targets). The val
    split is the last val_fraction of the source's tokens, train the rest."""

    def __init__(self, prepared_dir: str | Path, split: str, seq_len: int, source: int = 0):
        meta = read_meta(prepared_dir)
        entry = meta["sources"][source]
        folder = Path(prepared_dir) / entry["dir"]
        import json

        index = json.loads((folder / "index.json").read_text())
        self.stream = TokenStream(folder, index["shards"])
        self.lo = 0 if split == "train" else index["train_tokens"]
        self.length = index["train_tokens"] if split == "train" else index["val_tokens"]
        self.seq_len = seq_len
        self.num_samples = (self.length - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"split '{split}' of {entry['source']} has {self.length} tokens, fewer than "
                             f"seq_len+1={seq_len + 1}")

    def rows(self, indices) -> np.ndarray:
        s = self.seq_len
        return np.stack([self.stream.read(self.lo + int(i) * s, s + 1) for i in indices])

    def batch(self, indices):
        import torch  # here, not at import: the tokenizer worker processes load this package without torch

        rows = torch.from_numpy(self.rows(indices))
        return rows[:, :-1], rows[:, 1:]


class MixtureWindows:
    """Several sources' windows as one index space: sample id = offset of its source + its index there."""

    def __init__(self, parts: list[TokenWindows], weights: list[float]):
        self.parts, self.weights = parts, weights
        self.offsets = np.concatenate([[0], np.cumsum([p.num_samples for p in parts])]).astype(np.int64)
        self.num_samples = int(self.offsets[-1])

    def batch(self, indices):
        import torch

        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        rows = np.empty((len(indices), self.parts[0].seq_len + 1), dtype=np.int64)
        for s in np.unique(which):
            mask = which == s
            rows[mask] = self.parts[s].rows(indices[mask] - self.offsets[s])
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]


def open_windows(prepared_dir: str | Path, split: str, seq_len: int):
    meta = read_meta(prepared_dir)
    if len(meta["sources"]) == 1:
        return TokenWindows(prepared_dir, split, seq_len)
    parts = [TokenWindows(prepared_dir, split, seq_len, i) for i in range(len(meta["sources"]))]
    return MixtureWindows(parts, [s["weight"] for s in meta["sources"]])


def make_sampler(windows, global_batch: int, seed: int):
    if isinstance(windows, MixtureWindows):
        return BlendSampler([p.num_samples for p in windows.parts], windows.weights, global_batch, seed)
    return GlobalSampler(windows.num_samples, global_batch, seed)


class _Slicing:
    def rank_indices(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """This data-parallel rank's contiguous slice of step's global batch."""
        per_rank = self.global_batch // dp_size
        return self.global_indices(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]

    def next_indices(self, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray:
        idx = self.rank_indices(self.step, dp_rank, dp_size)
        self.step += 1
        return idx

    def _check_state(self, state: dict, keys) -> None:
        for key in keys:
            if state.get(key) != getattr(self, key):
                raise ValueError(f"data sampler state: checkpoint has {key}={state.get(key)}, this run has "
                                 f"{getattr(self, key)}; resume needs the same data and global batch")
        self.step = int(state["step"])


def _permutation(cache: dict, key, n: int) -> np.ndarray:
    """Seeded permutation of range(n) for `key` (seed, ..., epoch); the last one is kept: consecutive steps
    draw from the same epoch, and a permutation of a large dataset costs O(n)."""
    if cache.get("key") != key:
        cache["key"], cache["perm"] = key, np.random.default_rng(list(key)).permutation(n)
    return cache["perm"]


@dataclass
class GlobalSampler(_Slicing):
    """Step t's global batch = samples [t*B, (t+1)*B) of an endless sequence of seeded per-epoch permutations.

    State is just the number of optimizer steps consumed, so it checkpoints as one integer and is independent
    of the data-parallel layout.
    """

    num_samples: int
    global_batch: int
    seed: int
    step: int = 0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def _epoch_perm(self, epoch: int) -> np.ndarray:
        return _permutation(self._cache, (self.seed, epoch), self.num_samples)

    def global_indices(self, step: int) -> np.ndarray:
        g = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        epochs, offsets = np.divmod(g, self.num_samples)
        out = np.empty_like(g)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._epoch_perm(int(e))[offsets[mask]]
        return out

    def describe(self, total_steps: int) -> str | None:
        return None

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        self._check_state(state, ("seed", "global_batch", "num_samples"))


def blend_pattern(weights: list[float], period: int = BLEND_PERIOD) -> np.ndarray:
    """Source of each position of one period: Megatron's BlendedDataset rule (at each sample, the source
    furthest behind its weight: argmax(w * (i + 1) - count)), so every prefix is as close to the weights
    as whole samples allow."""
    w = np.asarray(weights, dtype=float) / sum(weights)
    counts = np.zeros(len(w))
    out = np.empty(period, dtype=np.int64)
    for i in range(period):
        s = int(np.argmax(w * (i + 1) - counts))
        out[i] = s
        counts[s] += 1
    return out


class BlendSampler(_Slicing):
    """A weighted mixture: global sample g comes from source pattern[g % P]; it is that source's k-th draw
    (k counted exactly from the periodic pattern), which is sample perm_epoch[k % n] of its own seeded
    per-epoch permutation, epoch = k // n. A source drawn more than its size repeats (more epochs), one
    drawn less is subsampled. State: the step, as for GlobalSampler."""

    def __init__(self, num_samples: list[int], weights: list[float], global_batch: int, seed: int, step: int = 0):
        self.num_samples, self.weights = list(num_samples), [float(w) for w in weights]
        self.global_batch, self.seed, self.step = global_batch, seed, step
        self.pattern = blend_pattern(self.weights)
        self.per_period = np.bincount(self.pattern, minlength=len(weights))
        # rank of each position among the earlier positions of the same source in the period
        self.rank_in_period = np.empty(len(self.pattern), dtype=np.int64)
        for s in range(len(weights)):
            where = np.flatnonzero(self.pattern == s)
            self.rank_in_period[where] = np.arange(len(where))
        self.offsets = np.concatenate([[0], np.cumsum(self.num_samples)]).astype(np.int64)
        self._caches = [{} for _ in weights]

    def global_indices(self, step: int) -> np.ndarray:
        g = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        period, pos = np.divmod(g, len(self.pattern))
        src = self.pattern[pos]
        k = period * self.per_period[src] + self.rank_in_period[pos]
        out = np.empty_like(g)
        for s in np.unique(src):
            mask = src == s
            epochs, offsets = np.divmod(k[mask], self.num_samples[s])
            local = np.empty_like(epochs)
            for e in np.unique(epochs):
                m = epochs == e
                local[m] = _permutation(self._caches[s], (self.seed, int(s), int(e)), self.num_samples[s])[offsets[m]]
            out[mask] = self.offsets[s] + local
        return out

    def realised(self, total_samples: int) -> list[dict]:
        """Per source: share of the first total_samples samples and epochs over that source."""
        full, rest = divmod(total_samples, len(self.pattern))
        counts = full * self.per_period + np.bincount(self.pattern[:rest], minlength=len(self.weights))
        return [{"weight": w, "share": float(c / max(total_samples, 1)), "samples": int(c),
                 "epochs": float(c / n)} for w, c, n in zip(self.weights, counts, self.num_samples, strict=True)]

    def describe(self, total_steps: int) -> str:
        parts = [f"source {i}: weight {r['weight']:.3f}, realised {r['share']:.4f} ({r['samples']:,} samples, "
                 f"{r['epochs']:.2f} epochs)" for i, r in enumerate(self.realised(total_steps * self.global_batch))]
        return "data mixture over the run: " + "; ".join(parts)

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "num_samples": self.num_samples, "weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        self._check_state(state, ("seed", "global_batch", "num_samples", "weights"))


def all_tokens(prepared_dir: str | Path, source: int = 0) -> np.ndarray:
    """Every token of one prepared source (train then val), as one array (for inspection and tests)."""
    import json

    entry = read_meta(prepared_dir)["sources"][source]
    folder = Path(prepared_dir) / entry["dir"]
    stream = TokenStream(folder, json.loads((folder / "index.json").read_text())["shards"])
    return stream.read(0, len(stream))
