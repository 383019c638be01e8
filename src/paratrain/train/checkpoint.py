"""Checkpoints with torch.distributed.checkpoint (DCP): sharded as trained, committed atomically.

Layout: <dir>/step_00000100/ holds the DCP shards, extra per-rank state (RNG) and, written last by rank 0
after every rank has finished, `COMMITTED.json`. Only folders with that marker count as checkpoints, so a
save interrupted at any point is never taken as the latest.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

MARKER = "COMMITTED.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def state_module(parts: list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the single-device model's, over all model parts of this rank.

    DCP's state-dict helpers take one module; a pipeline rank holds several parts (virtual stages), each a
    Llama with only its own layers. Keeping the original names is what lets checkpoints reshard across
    pipeline layouts.
    """
    if len(parts) == 1:
        return parts[0]
    view, layers = nn.Module(), nn.ModuleDict()
    for part in parts:
        for name, child in part.named_children():
            if name == "layers":
                layers.update(child)
            elif child is not None:
                setattr(view, name, child)
    view.layers = layers
    return view


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, directory: str | Path, rank: int, keep: int = 3):
        self.dir = Path(directory)
        self.rank = rank
        self.keep = keep

    def committed(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and (p / MARKER).is_file())

    def latest(self) -> Path | None:
        done = self.committed()
        return done[-1] if done else None

    def save(self, step: int, parts, optimizer, train_state: dict) -> Path:
        path = self.dir / f"step_{step:08d}"
        model_sd, optim_sd = get_state_dict(state_module(parts), optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        torch.save({"rng": rng_state(), **train_state}, path / f"extra_rank{self.rank}.pt")
        _barrier()
        if self.rank == 0:
            tmp = path / (MARKER + ".tmp")
            tmp.write_text(json.dumps({"step": step}))
            tmp.replace(path / MARKER)
            self._prune()
        _barrier()
        return path

    def load(self, path: Path, parts, optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(state_module(parts), optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(state_module(parts), optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra_file = path / f"extra_rank{self.rank}.pt"
        if not extra_file.is_file():
            extra_file = path / "extra_rank0.pt"  # resuming with more ranks than saved: take rank 0's
        extra = torch.load(extra_file, weights_only=False)
        set_rng_state(extra.pop("rng"))
        return extra

    def _prune(self) -> None:
        for old in self.committed()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
