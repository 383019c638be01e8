"""Checkpoints that never lose work: sharded as trained (DCP), committed atomically, verified on load.

Layout of one checkpoint, `<dir>/step_00000100/` (dir: a local path, a shared filesystem path or s3://...):
  __<rank>_<i>.distcp, .metadata   DCP shards of model + optimizer state, keyed by single-device parameter names
  extra_rank<r>.pt                 per rank: RNG states, LR scheduler, sampler position, step
  MANIFEST.json                    written last, by rank 0, after every rank has written and checksummed its
                                   files: the commit. Lists every file with its size and sha256, plus the
                                   step, world size and layout it was saved under.
A folder without MANIFEST.json is an interrupted save: never resumed from, removed on the next resume.
A folder whose files do not match its manifest (truncated, corrupted, missing) is refused with a message naming
the file, marked with REFUSED.json (kept for inspection), and the previous complete checkpoint is used.

Resharding: DCP matches tensors by name and reshards them to whatever layout loads them; the model keeps the
single-device names across pipeline splits (`state_module`). RNG rule when the layout changes: see `load`.
See docs/checkpoints.md.
"""

from __future__ import annotations

import copy
import io
import json
import random
import re
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from paratrain.device import HOST_BACKEND, accelerator_rng_state, pin_memory, set_accelerator_rng_state
from paratrain.train.faults import fault_point
from paratrain.train.storage import RetryPolicy, Storage, StorageError, is_transient, short

MANIFEST = "MANIFEST.json"
REFUSED = "REFUSED.json"
# Format 2: optimizer state flattened per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"), which
# DCP's state-dict helpers provide for pipeline parallelism. Format 1 kept torch's nested `param_groups` list,
# one per rank; DCP stores one rank's copy of such a duplicated key, so a pipeline rank whose parameters were not
# in that copy lost its hyperparameters on load (KeyError 'betas' at the first step after resuming under PP).
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
STEP_DIR = re.compile(r"^step_(\d{8})$")
VERIFY_MODES = ("checksum", "size", "none")
# DCP warns on every single-process save/load; one process without a process group is a supported case here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, or a save that did not commit. A ValueError so that the CLI reports
    it as one line (it is about input the user controls: the checkpoint directory)."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def extra_name(rank: int) -> str:
    return f"extra_rank{rank}.pt"


def format_layout(layout: dict, world_size: int) -> str:
    dims = " x ".join(f"{k}{v}" for k, v in layout.items() if v != 1) or "single device"
    return f"{dims} on {world_size} rank(s)"


def state_dict_options(format_version: int) -> StateDictOptions:
    """How model + optimizer state is laid out in a checkpoint of this format (see FORMAT_VERSION)."""
    return StateDictOptions(flatten_optimizer_state_dict=format_version >= 2)


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
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    state.update(accelerator_rng_state())  # {device type: per-device states}, none on the host
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    set_accelerator_rng_state(state)


def stage_to_cpu(state: dict) -> dict:
    """A private CPU copy (DTensors stay DTensors) for an asynchronous write: training mutates the originals."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    cpu = _create_cpu_state_dict(state, pin_memory=pin_memory())
    return _copy_state_dict(state, cpu)


def check_resume_source(resume: str, resume_from: str | None) -> None:
    """Fail before any work when the checkpoint to resume from cannot exist: `--resume-from` (or a path in
    checkpoint.resume) on a local or shared filesystem that is missing, or a URL scheme we cannot read.
    An s3:// source is checked when it is read (its listing needs the network and retries)."""
    name, value = ("--resume-from", resume_from) if resume_from else ("checkpoint.resume", resume)
    if value in ("auto", "none") and name == "checkpoint.resume":
        return
    allowed = ('allowed: a checkpoint folder (.../step_00000100) or a checkpoint directory (its newest complete '
               'checkpoint), a local or shared filesystem path or s3://bucket/prefix'
               + ('; or "auto" (newest in checkpoint.dir) or "none" (start fresh)' if name == "checkpoint.resume"
                  else ""))
    if "://" in value and not value.startswith(("s3://", "file://")):
        raise ValueError(f"{name}={value!r}: unsupported URL scheme; {allowed}")
    if value.startswith("s3://"):
        return
    local = Path(value.removeprefix("file://"))
    if not local.is_dir():
        what = "not a folder" if local.exists() else "no such folder"
        raise ValueError(f"{name}={value!r}: {what}; {allowed}")


def check_checkpoint_dir(directory: str, rank: int, policy: RetryPolicy | None = None) -> None:
    """Fail before any work when checkpoints could never be written to `directory` (a missing bucket, no write
    permission, a path through a file), instead of training for hours with every save failing. Rank 0 writes and
    removes a small probe (retried like any storage operation); every rank gets the same answer."""
    error = None
    if rank == 0:
        try:
            storage = Storage(directory, policy)
            probe = storage.join(".paratrain-write-probe")
            storage.write_bytes(probe, b"paratrain")
            storage.remove_tree(probe)
        except ValueError as exc:  # a URL scheme we cannot write: Storage's message names the field
            error = str(exc)
        except StorageError as exc:
            error = (f"checkpoint.dir={directory!r}: cannot write there ({exc}); allowed: a writable local or "
                     "shared filesystem path or s3://bucket/prefix with write access (or save nothing: "
                     "checkpoint.interval=0 and checkpoint.save_final=false)")
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ValueError(error)


@dataclass
class Resumed:
    path: str
    step: int
    extra: dict
    saved_layout: dict
    saved_world_size: int
    same_layout: bool

    def describe(self, layout: dict, world_size: int) -> str:
        how = ("same layout: every rank restored exactly" if self.same_layout else
               "layout changed: model and optimizer resharded by parameter name, every rank's RNG from saved "
               "rank 0")
        return (f"resumed from {self.path} at step {self.step}: saved as "
                f"{format_layout(self.saved_layout, self.saved_world_size)}, now "
                f"{format_layout(layout, world_size)} ({how})")


class CheckpointManager:
    """Save, find, verify and load checkpoints under one directory. Every method is called on every rank.

    Collectives go through a dedicated gloo group, so an asynchronous save (a background thread per rank)
    never interleaves with the training loop's collectives.
    """

    def __init__(self, directory, rank: int = 0, keep: int = 3, *, layout: dict | None = None,
                 async_save: bool = False, verify: str = "checksum", retry: RetryPolicy | None = None,
                 log: Callable[[str], None] | None = None):
        if verify not in VERIFY_MODES:
            raise ValueError(f"checkpoint.verify={verify!r}: allowed {VERIFY_MODES}")
        self.storage = Storage(directory, retry)
        self.dir = self.storage.root
        self.rank = rank
        self.keep = keep
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.layout = dict(layout or {"dp": self.world_size})
        self.verify_mode = verify
        self.log = log or (lambda msg: print(msg, flush=True) if rank == 0 else None)
        self.group = dist.new_group(backend=HOST_BACKEND, timeout=timedelta(minutes=30)) if self.world_size > 1 else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="paratrain-ckpt") if async_save else None
        self._pending: Future | None = None
        self.failed_saves = 0

    # ---- collectives (no-ops in one process) ---------------------------------------------------------------
    def _gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _from_rank0(self, fn: Callable):
        """fn() on rank 0 only; every rank gets its result (or the same CheckpointError)."""
        result, error = None, None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - the other ranks wait in the gather: always reach it
                error = str(exc) if isinstance(exc, (StorageError, CheckpointError)) else f"{type(exc).__name__}: {exc}"
        result, error = self._gather((result, error))[0]
        if error:
            raise CheckpointError(error)
        return result

    # ---- discovery ----------------------------------------------------------------------------------------
    def _step_dirs(self, storage: Storage | None = None) -> list[tuple[int, str, dict]]:
        """(step, path, {file name: size}) of every step folder, oldest first."""
        st = storage or self.storage
        out = []
        for name, size in st.listdir(st.root).items():
            match = STEP_DIR.match(name)
            if match and size is None:
                path = st.join(name)
                out.append((int(match.group(1)), path, st.listdir(path)))
        return sorted(out)

    def committed(self, storage: Storage | None = None) -> list[str]:
        """Complete checkpoints (manifest present, not refused), oldest first."""
        return [p for _, p, files in self._step_dirs(storage) if MANIFEST in files and REFUSED not in files]

    def latest(self) -> str | None:
        done = self.committed()
        return done[-1] if done else None

    def _latest_if_reachable(self) -> str:
        if self.rank != 0:  # only rank 0 prints it; spare the storage thousands of listings
            return ""
        try:
            return self.latest() or "none"
        except StorageError:
            return "unknown, storage unreachable"

    def incomplete(self) -> list[str]:
        return [p for _, p, files in self._step_dirs() if MANIFEST not in files and REFUSED not in files]

    # ---- save ---------------------------------------------------------------------------------------------
    def save(self, step: int, parts, optimizer, train_state: dict) -> str:
        """Save (or, with async_save, start saving) `step`. A failed save is logged loudly and counted in
        `failed_saves`; training goes on and the previous complete checkpoint stays the latest."""
        self.wait()  # one save in flight: the previous one is committed (or has failed) before the next starts
        path = self.storage.join(step_name(step))
        model_sd, optim_sd = get_state_dict(state_module(parts), optimizer, options=state_dict_options(FORMAT_VERSION))
        state = {"model": model_sd, "optim": optim_sd}
        extra = {"rng": rng_state(), **copy.deepcopy(train_state)}
        fault_point("save_begin", step, self.rank)
        if self._executor is None:
            self._save_and_commit(step, path, state, extra)
        else:
            self._pending = self._executor.submit(self._save_and_commit, step, path, stage_to_cpu(state), extra)
        return path

    def wait(self) -> bool | None:
        """Block until the save in flight has committed or failed: True/False, None if there was none."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()

    def _save_and_commit(self, step: int, path: str, state: dict, extra: dict) -> bool:
        t0 = time.perf_counter()
        try:
            files = self._write(step, path, state, extra)
            fault_point("save_written", step, self.rank)
            self._commit(step, path, files)
        except CheckpointError as exc:
            self.failed_saves += 1
            self.log(f"ERROR: checkpoint of step {step} NOT saved: {exc}. Nothing was marked latest "
                     f"(latest complete: {self._latest_if_reachable()}); training continues")
            return False
        total = sum(f["size"] for f in files.values())
        self.log(f"checkpoint step {step} committed: {path} ({total / 2**20:,.1f} MiB, "
                 f"{time.perf_counter() - t0:.2f} s)")
        if self.rank == 0:
            self._prune(step)
        return True

    def _write(self, step: int, path: str, state: dict, extra: dict) -> dict[str, dict]:
        """Write every rank's shards, retrying the whole write (on all ranks together) on transient errors."""
        self._from_rank0(lambda: self.storage.remove_tree(path))  # leftovers of an earlier attempt at this step
        policy = self.storage.policy
        for attempt in range(policy.attempts):
            results = self._gather(self._write_attempt(step, path, state, extra))
            errors = [(r, msg, transient) for r, (msg, transient, _) in enumerate(results) if msg]
            if not errors:
                return {name: info for _, _, files in results for name, info in files.items()}
            summary = "; ".join(f"rank {r}: {msg}" for r, msg, _ in errors[:4])
            if not all(t for _, _, t in errors) or attempt + 1 == policy.attempts:
                raise CheckpointError(f"writing {path} failed after {attempt + 1} attempt(s): {summary}")
            wait_s = policy.delay_s(attempt)
            self.log(f"WARNING: writing checkpoint step {step} failed ({summary}); retry "
                     f"{attempt + 1}/{policy.attempts - 1} in {wait_s:.2f} s")
            time.sleep(wait_s)
        raise AssertionError("unreachable")

    def _write_attempt(self, step: int, path: str, state: dict, extra: dict) -> tuple[str | None, bool, dict]:
        """(error or None, error is transient, {file: size/sha256} of the files this rank wrote)."""
        try:
            dcp.save(state, storage_writer=self.storage.writer(path), process_group=self.group,
                     no_dist=self.group is None)
            buffer = io.BytesIO()
            torch.save(extra, buffer)
            self.storage.write_bytes(f"{path}/{extra_name(self.rank)}", buffer.getvalue())
            fault_point("save_shards", step, self.rank)  # this rank's files written, not yet reported
            return None, True, self._describe_own_files(path)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - every rank must reach the gather
            return f"{type(exc).__name__}: {short(exc)}", is_transient(exc), {}

    def _describe_own_files(self, path: str) -> dict[str, dict]:
        """Size and checksum of the files this rank wrote (DCP names them __<rank>_*; rank 0 adds .metadata)."""
        listing = self.storage.listdir(path)
        own = [n for n in listing if n.startswith(f"__{self.rank}_") or n == extra_name(self.rank)]
        if self.rank == 0:
            own.append(".metadata")
        out = {}
        for name in own:
            if self.verify_mode == "checksum":
                size, sha = self.storage.digest(f"{path}/{name}")
                out[name] = {"size": size, "sha256": sha}
            else:
                out[name] = {"size": listing[name]}
        return out

    def _commit(self, step: int, path: str, files: dict[str, dict]) -> None:
        manifest = {"format": FORMAT_VERSION, "step": step, "world_size": self.world_size, "layout": self.layout,
                    "created_unix_s": time.time(), "torch": torch.__version__, "verify": self.verify_mode,
                    "total_bytes": sum(f["size"] for f in files.values()), "files": dict(sorted(files.items()))}
        data = json.dumps(manifest, indent=1).encode()
        self._from_rank0(lambda: self.storage.write_bytes(f"{path}/{MANIFEST}", data))

    def _prune(self, newest_step: int) -> None:
        """Keep the last `keep` complete checkpoints; drop interrupted saves older than the one just committed."""
        try:
            dirs = self._step_dirs()
            done = [p for _, p, f in dirs if MANIFEST in f and REFUSED not in f]
            stale = [p for s, p, f in dirs if MANIFEST not in f and REFUSED not in f and s < newest_step]
            for path in done[:-self.keep] + stale:
                self.storage.remove_tree(path)
        except StorageError as exc:  # the new checkpoint is committed; a leftover old one is only space
            self.log(f"WARNING: pruning old checkpoints failed: {exc}")

    # ---- verify, resume, load -----------------------------------------------------------------------------
    def verify(self, path: str, storage: Storage | None = None) -> str | None:
        """Check every file against the manifest, files spread over the ranks. Returns the first problem
        (the same on every rank) or None."""
        st = storage or self.storage
        try:
            manifest = self._read_manifest(st, path)
            names = sorted(manifest["files"])
            mode = manifest.get("verify", "checksum") if self.verify_mode != "none" else "none"
            listing = st.listdir(path)
            problems = [p for name in names[self.rank::self.world_size]
                        if (p := self._check_file(st, path, name, manifest["files"][name], listing, mode))]
        except (StorageError, CheckpointError) as exc:
            problems = [str(exc)]
        except (KeyError, TypeError, ValueError) as exc:  # a manifest of the right format but wrong content
            problems = [f"{path}/{MANIFEST}: malformed ({type(exc).__name__}: {exc})"]
        found = [p for per_rank in self._gather(problems) for p in per_rank]
        return found[0] if found else None

    def _read_manifest(self, st: Storage, path: str) -> dict:
        if not st.exists(f"{path}/{MANIFEST}"):
            raise CheckpointError(f"{path}: no {MANIFEST}: an interrupted save, not a complete checkpoint")
        try:
            manifest = json.loads(st.read_bytes(f"{path}/{MANIFEST}"))
            assert isinstance(manifest["files"], dict)
        except (ValueError, KeyError, AssertionError) as exc:
            raise CheckpointError(f"{path}/{MANIFEST}: unreadable manifest ({exc})") from exc
        if manifest.get("format") not in READABLE_FORMATS:
            raise CheckpointError(f"{path}/{MANIFEST}: checkpoint format {manifest.get('format')!r}; this paratrain "
                                  f"reads formats {READABLE_FORMATS}")
        return manifest

    @staticmethod
    def _check_file(st: Storage, path: str, name: str, want: dict, listing: dict, mode: str) -> str | None:
        where = f"{path}/{name}"
        if name not in listing:
            return f"{where}: missing (the manifest lists it with {want['size']} bytes)"
        if mode == "none":
            return None
        if listing[name] != want["size"]:
            return f"{where}: {listing[name]} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if mode == "checksum" and "sha256" in want:
            _, sha = st.digest(where)
            if sha != want["sha256"]:
                return f"{where}: sha256 {sha[:16]}... != manifest {want['sha256'][:16]}... (corrupted)"
        return None

    def resume(self, parts, optimizer, source: str | None = None) -> Resumed | None:
        """Load `source` (a checkpoint folder, or a checkpoint directory: its newest complete one), or with
        source=None the newest complete checkpoint here, falling back past refused ones. None: nothing to
        resume (fresh start)."""
        if source is not None:
            st, path = self._resolve_source(source)
            problem = self.verify(path, st)
            if problem:
                raise CheckpointError(f"cannot resume from {source}: {problem}")
            return self.load(path, parts, optimizer, st)
        self._from_rank0(self._remove_incomplete)
        candidates = self._from_rank0(self.committed)
        for path in reversed(candidates):
            problem = self.verify(path)
            if problem is None:
                return self.load(path, parts, optimizer)
            self.log(f"WARNING: checkpoint {path} refused: {problem}. Trying the previous complete one")
            self._from_rank0(lambda p=path, why=problem: self._mark_refused(p, why))
        if candidates:
            raise CheckpointError(f"every checkpoint in {self.dir} was refused (see above); not starting over "
                                  "silently: fix or move them, or set checkpoint.resume=\"none\"")
        return None

    def _resolve_source(self, source: str) -> tuple[Storage, str]:
        st = Storage(source, self.storage.policy)
        if st.exists(f"{st.root}/{MANIFEST}"):
            return st, st.root
        done = self._from_rank0(lambda: self.committed(st))
        if not done:
            raise CheckpointError(f"{source}: not a checkpoint: it holds no {MANIFEST} and no complete "
                                  "step_* checkpoint folder")
        return st, done[-1]

    def _remove_incomplete(self) -> None:
        for path in self.incomplete():
            self.log(f"removing interrupted checkpoint {path} (no {MANIFEST})")
            self.storage.remove_tree(path)

    def _mark_refused(self, path: str, why: str) -> None:
        self.storage.write_bytes(f"{path}/{REFUSED}", json.dumps({"reason": why, "time_unix_s": time.time()}).encode())

    def _restore_format1_hyperparameters(self, optimizer, saved_groups: list[dict], path: str) -> None:
        """Format 1 stored one rank's nested param_groups; a pipeline rank whose parameters are not in that copy
        loads none of its groups' hyperparameters. Every rank builds the same groups in the same order from the
        same config (build_optimizer: decay, no decay), so group i's hyperparameters are those of saved group i."""
        missing = [i for i, group in enumerate(optimizer.param_groups) if "lr" not in group]
        if missing and len(saved_groups) != len(optimizer.param_groups):
            raise CheckpointError(f"{path}: a format-1 checkpoint without this rank's optimizer hyperparameters, "
                                  f"and {len(saved_groups)} saved groups for {len(optimizer.param_groups)}: "
                                  "resume it in one process (pp=1) once to rewrite it")
        for i in missing:
            optimizer.param_groups[i].update({k: v for k, v in saved_groups[i].items() if k != "params"})
        if missing:
            self.log(f"rank {self.rank}: format-1 checkpoint {path}: optimizer hyperparameters of group(s) "
                     f"{missing} taken from the saved groups of the same index")

    def load(self, path: str, parts, optimizer, storage: Storage | None = None) -> Resumed:
        """Load model + optimizer (resharded to this layout by DCP) and this rank's extra state.

        RNG rule: with the same world size and layout, rank r gets exactly the RNG state rank r saved. With a
        different layout, rank-to-rank correspondence is gone, so every rank takes saved rank 0's state: the
        same invariant as a fresh start, where every rank seeds identically (anything that needs per-rank
        streams derives them from its mesh coordinates, not from the global RNG).
        """
        st = storage or self.storage
        manifest = self._read_manifest(st, path)
        module = state_module(parts)
        options = state_dict_options(manifest["format"])
        model_sd, optim_sd = get_state_dict(module, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=st.reader(path), process_group=self.group, no_dist=self.group is None)
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
        if manifest["format"] == 1:
            self._restore_format1_hyperparameters(optimizer, state["optim"]["param_groups"], path)
        same = manifest["world_size"] == self.world_size and manifest["layout"] == self.layout
        extra = torch.load(io.BytesIO(st.read_bytes(f"{path}/{extra_name(self.rank if same else 0)}")),
                           weights_only=False)
        set_rng_state(extra.pop("rng"))
        return Resumed(path=path, step=int(manifest["step"]), extra=extra, saved_layout=manifest["layout"],
                       saved_world_size=manifest["world_size"], same_layout=same)
