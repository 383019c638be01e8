"""The tokenizer a run trained with, kept in its run directory beside config.toml (torch-free).

The prepared data folder (data.prepared_dir, `data/stdlib` by default) is shared: another config with the same
folder but other data settings (a source, a cap, a vocabulary size) prepares it again, with a newly trained
tokenizer. A run's checkpoints hold token ids of the tokenizer it trained with, so `train` copies that one into
<run_dir>/tokenizer.json, refuses to resume with another, and `generate` and `export` read the run's copy
before the shared folder's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

RUN_TOKENIZER = "tokenizer.json"


def prepared_tokenizer(cfg) -> Path:
    return Path(cfg.data.prepared_dir) / RUN_TOKENIZER


def check_run_tokenizer(cfg) -> None:
    """Resuming: the prepared data's tokenizer must be the one the run trained with (when the run kept one)."""
    kept, prepared = Path(cfg.metrics.run_dir) / RUN_TOKENIZER, prepared_tokenizer(cfg)
    if kept.is_file() and prepared.is_file() and kept.read_bytes() != prepared.read_bytes():
        raise ValueError(f"data.prepared_dir='{cfg.data.prepared_dir}': its tokenizer.json is not the one this run "
                         f"trained with ({kept}; the folder was prepared again with other data settings), so "
                         f"resuming would feed the checkpoint other token ids; allowed: the run's data settings "
                         f"({Path(cfg.metrics.run_dir) / 'config.toml'}), data.tokenizer='{kept}', or a new "
                         f"metrics.run_dir")


def keep_run_tokenizer(cfg) -> None:
    """Copy the prepared data's tokenizer.json into the run directory (main rank, at every start)."""
    prepared = prepared_tokenizer(cfg)
    if prepared.is_file():
        shutil.copyfile(prepared, Path(cfg.metrics.run_dir) / RUN_TOKENIZER)


def run_tokenizer(cfg, checkpoint: str | None = None) -> Path | None:
    """The tokenizer.json of the weights of `checkpoint`: the one kept beside its run's config.toml (above the
    checkpoint; "latest": metrics.run_dir's), else the prepared data folder's (runs from before the copy, or no
    checkpoint named); None if none."""
    places = []
    if checkpoint and checkpoint != "latest" and "://" not in checkpoint:
        places += [p for p in Path(checkpoint).absolute().parents[:3] if (p / "config.toml").is_file()]
    if checkpoint == "latest":
        places.append(Path(cfg.metrics.run_dir))
    found = next((p / RUN_TOKENIZER for p in places if (p / RUN_TOKENIZER).is_file()), None)
    prepared = prepared_tokenizer(cfg)
    return found or (prepared if prepared.is_file() else None)
