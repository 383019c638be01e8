"""Checkpoints that never lose work: sharded as trained (DCP), committed atomically, verified on load.

Layout of one checkpoint, `<dir>/step_00000100/` (dir: a local path, a shared filesystem path or s3://...):
  __<rank>_<i>.distcp, .metadata   DCP shards of model + optimizer state, keyed by single-device parameter names
  extra_rank<r>.pt                 per rank: RNG states, LR scheduler, sampler position, step
  MANIFEST.json                    written last, by rank 0, after every rank has written and checksummed its
                                   files: the commit. Lists every file with its size and sha256, plus the
                                   step, world size and layout it was saved under.
A folder without MANIFEST.json is never resumed from. At the next start it is removed (with a log line) when its
shards are incomplete (no DCP .metadata: an interrupted save), and moved to <dir>/quarantine/ when DCP finished
it (.metadata present: a lost or deleted manifest; nothing is deleted that might be the only copy of the work).
A folder whose files do not match its manifest (truncated, corrupted, missing) is refused with a message naming
the file, marked with REFUSED.json (kept for inspection), and the previous complete checkpoint is used. If no
usable checkpoint is left, the run stops with an error instead of starting over silently (see `resume`).

Resharding: DCP matches tensors by name and reshards them to whatever layout loads them; the model keeps the
single-device names across pipeline splits (`state_module`). RNG rule when the layout changes: see `load`.
See docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import json
import os
import random
import re
import shutil
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from paratrain.device import HOST_BACKEND, accelerator_rng_state, pin_memory, set_accelerator_rng_state
from paratrain.train.faults import FaultInjector
from paratrain.train.storage import RetryPolicy, Storage, StorageError, check_root, describe, is_transient

MANIFEST = "MANIFEST.json"
REFUSED = "REFUSED.json"
DCP_METADATA = ".metadata"  # written by DCP after every rank's shards: a folder with it has complete shards
QUARANTINE = "quarantine"  # <dir>/quarantine/<step folder>-<unix s>: kept, never resumed from, never pruned
# Format 2: optimizer state flattened per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"), which
# DCP's state-dict helpers provide for pipeline parallelism. Format 1 kept torch's nested `param_groups` list,
# one per rank; DCP stores one rank's copy of such a duplicated key, so a pipeline rank whose parameters were not
# in that copy lost its hyperparameters on load (KeyError 'betas' at the first step after resuming under PP).
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
STEP_DIR = re.compile(r"^step_(\d{8})$")
VERIFY_MODES = ("checksum", "size", "none")


@contextlib.contextmanager
def quiet_no_dist(no_dist: bool = True):
    """DCP warns on every single-process save/load; one process without a process group is a supported case
    here. Silenced around those calls only (not by a filter set at import for the whole process)."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


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


def _tensors(obj):
    """Every tensor in a (nested) state dict; a DTensor counts as its local shard (what this rank writes)."""
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors(value)
    elif isinstance(obj, torch.Tensor):
        yield getattr(obj, "_local_tensor", obj)


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
    check_root(value, name)  # a URL with a slash missing
    if value.startswith("s3://"):
        return
    local = Path(value.removeprefix("file://"))
    if not local.is_dir():
        what = "not a folder" if local.exists() else "no such folder"
        raise ValueError(f"{name}={value!r}: {what}; {allowed}")


def check_checkpoint_dir(directory: str, rank: int, policy: RetryPolicy | None = None, *,
                         before_probe: Callable[[Storage], None] | None = None) -> None:
    """Fail before any work when checkpoints could never be written to `directory` (a missing bucket, no write
    permission, a path through a file), instead of training for hours with every save failing. Rank 0 writes and
    removes a small probe (retried like any storage operation); every rank gets the same answer.
    `before_probe(storage)` runs on rank 0 first (taking the run lease, removing failed partial saves: on a full
    disk the space they hold is what the probe needs)."""
    error = None
    if rank == 0:
        try:
            storage = Storage(directory, policy)
            if before_probe is not None:
                before_probe(storage)
            probe = storage.join(".paratrain-write-probe")
            storage.write_bytes(probe, b"paratrain")
            storage.remove_tree(probe)
        except ValueError as exc:  # a URL scheme we cannot write (Storage names the field), a lease held
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


def step_dirs(st: Storage) -> list[tuple[int, str, dict]]:
    """(step, path, {file name: size}) of every step folder under st.root, oldest first."""
    out = []
    for name, size in st.listdir(st.root).items():
        match = STEP_DIR.match(name)
        if match and size is None:
            path = st.join(name)
            out.append((int(match.group(1)), path, st.listdir(path)))
    return sorted(out)


def quarantine(st: Storage, path: str, why: str, log: Callable[[str], None]) -> str:
    """Move a step folder out of the way (never resumed from, never pruned), with a log line saying why."""
    dest = st.join(QUARANTINE, f"{st.name(path)}-{int(time.time() * 1000)}")  # unix ms: sorts by time
    st.move(path, dest)
    log(f"moved {path} to {dest}: {why}; kept for inspection (delete it when done)")
    return dest


def tidy_incomplete(st: Storage, log: Callable[[str], None], quarantine_complete: bool = True) -> list[str]:
    """Folders without a manifest: removed (logged) when their shards are incomplete, quarantined when DCP
    finished them (its .metadata is there): intact shards whose manifest was lost are not thrown away.
    Returns "<name>: why" of each quarantined one. quarantine_complete=False leaves those where they are
    (the resume then quarantines them and counts them as unusable: a fresh start past them is refused)."""
    kept = []
    for _, path, files in step_dirs(st):
        if MANIFEST in files or REFUSED in files:
            continue
        if DCP_METADATA in files:
            if not quarantine_complete:
                continue
            dest = quarantine(st, path, f"no {MANIFEST} but complete DCP shards (a lost manifest, or a save "
                                        "killed just before its commit): not resumed from", log)
            kept.append(f"{st.name(path)}: no {MANIFEST}, shards moved to {dest}")
        else:
            log(f"removing interrupted checkpoint {path} (no {MANIFEST}, shards incomplete)")
            st.remove_tree(path)
    return kept


@dataclass
class Resumed:
    path: str
    step: int
    extra: dict
    saved_layout: dict
    saved_world_size: int
    same_layout: bool
    rng: dict | None = None  # the restored RNG state: re-applied after every start-up draw (train loop)

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
                 log: Callable[[str], None] | None = None, timeout_s: float = 1800.0, partial_load: bool = False,
                 allow_fresh_start: bool = False, faults: FaultInjector | None = None):
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
        self.partial_load = partial_load
        self.faults = faults or FaultInjector()  # test-only fault injection, inert by default
        self.allow_fresh_start = allow_fresh_start
        # checkpoint.collective_timeout_s: a save waits for the slowest rank's write, which can take far longer
        # than a training collective
        self.group = (dist.new_group(backend=HOST_BACKEND, timeout=timedelta(seconds=timeout_s))
                      if self.world_size > 1 else None)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="paratrain-ckpt") if async_save else None
        self._pending: Future | None = None
        self.failed_saves = 0
        self.last_error: dict[int, str] = {}  # step -> why its save failed (the run's exit status reads it)

    # ---- collectives (no-ops in one process) ---------------------------------------------------------------
    def _gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def from_any_rank(self, *values: str) -> tuple[str, ...]:
        """For each value, the first non-empty one over the ranks (e.g. why the numbers went non-finite: one rank
        seeing it is enough). Waits for a save in flight first: its thread uses the same group."""
        self.wait()
        gathered = self._gather(values)
        return tuple(next((v[i] for v in gathered if v[i]), "") for i in range(len(values)))

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
        return step_dirs(storage or self.storage)

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
        self.faults.point("save_begin", step, self.rank)
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
            self.faults.point("save_written", step, self.rank)
            self._commit(step, path, files)
        except CheckpointError as exc:
            self.failed_saves += 1
            self.last_error[step] = str(exc)
            self.log(f"ERROR: checkpoint of step {step} NOT saved: {exc}. Nothing was marked latest "
                     f"(latest complete: {self._latest_if_reachable()}); training continues")
            self._remove_failed(path)
            return False
        total = sum(f["size"] for f in files.values())
        self.log(f"checkpoint step {step} committed: {path} ({total / 2**20:,.1f} MiB, "
                 f"{time.perf_counter() - t0:.2f} s)")
        if self.rank == 0:
            self._prune(step)
        return True

    def _remove_failed(self, path: str) -> None:
        """A failed save's partial folder goes at once (a full disk needs that space back: the next save and
        the next start's write probe); best effort, every rank returns."""
        def op():
            if self.storage.exists(path) and not self.storage.exists(f"{path}/{MANIFEST}"):
                self.log(f"removing the failed save {path} (no {MANIFEST}; partial shards only)")
                self.storage.remove_tree(path)
        try:
            self._from_rank0(op)
        except CheckpointError as exc:
            self.log(f"WARNING: could not remove the failed save {path}: {exc}; the next start removes it")

    def _clear_for_save(self, path: str) -> None:
        """Rank 0, before writing step folder `path`: a refused or complete folder of the same step is moved to
        quarantine, an interrupted one removed; either way with a log line."""
        files = self.storage.listdir(path)
        if not files:
            return
        if REFUSED in files or MANIFEST in files:
            quarantine(self.storage, path, "replaced by a new save of the same step", self.log)
        else:
            self.log(f"removing interrupted checkpoint {path} (no {MANIFEST}) before saving that step again")
            self.storage.remove_tree(path)

    def _write(self, step: int, path: str, state: dict, extra: dict) -> dict[str, dict]:
        """Write every rank's shards, retrying the whole write (on all ranks together) on transient errors."""
        self._from_rank0(lambda: self._clear_for_save(path))  # leftovers of an earlier attempt at this step
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
            with quiet_no_dist(self.group is None):
                dcp.save(state, storage_writer=self.storage.writer(path), process_group=self.group,
                         no_dist=self.group is None)
            buffer = io.BytesIO()
            torch.save(extra, buffer)
            self.storage.write_bytes(f"{path}/{extra_name(self.rank)}", buffer.getvalue())
            self.faults.point("save_shards", step, self.rank)  # this rank's files written, not yet reported
            return None, True, self._describe_own_files(path)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - every rank must reach the gather
            full = self._disk_full(path, state)
            if full:  # torch.save's zip writer reports a full disk as "unexpected pos": say what happened
                return f"{full} (the write failed with {describe(exc)})", False, {}
            return describe(exc), is_transient(exc), {}  # the root cause, unwrapped from DCP's exception

    def _disk_full(self, path: str, state: dict) -> str | None:
        """A local or shared filesystem with less free space than this rank's shards need: ENOSPC's message,
        whatever error the write surfaced as (permanent: no retry frees space). None otherwise."""
        if self.storage.remote:
            return None
        need = sum(t.numel() * t.element_size() for t in _tensors(state))
        try:
            free = shutil.disk_usage(Path(path).parent).free
        except OSError:
            return None
        if free >= need:
            return None
        return (f"{os.strerror(errno.ENOSPC)}: {free / 2**20:,.1f} MiB free under {Path(path).parent}, this rank's "
                f"shards need {need / 2**20:,.1f} MiB")

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
        quarantined = self._from_rank0(lambda: tidy_incomplete(self.storage, self.log))
        candidates = self._from_rank0(self.committed)
        for path in reversed(candidates):
            problem = self.verify(path)
            if problem is None:
                return self.load(path, parts, optimizer)
            self.log(f"WARNING: checkpoint {path} refused: {problem}. Trying the previous complete one")
            self._from_rank0(lambda p=path, why=problem: self._mark_refused(p, why))
        unusable = self._from_rank0(self._unusable) + quarantined
        if unusable and not self.allow_fresh_start:
            raise CheckpointError(f"no usable checkpoint in {self.dir}, but {len(unusable)} that cannot be used "
                                  f"({'; '.join(unusable[:3])}); not starting over from step 0 silently: fix or "
                                  "remove them, resume another with --resume-from, or start fresh deliberately "
                                  "with checkpoint.allow_fresh_start=true (they are then moved to "
                                  f"{self.storage.join(QUARANTINE)})")
        if unusable:
            self.supersede_existing("checkpoint.allow_fresh_start=true: starting from step 0")
        return None

    def _unusable(self) -> list[str]:
        """Step folders left after the resume's tidying (refused ones), each with why, newest first."""
        out = []
        for _, path, files in reversed(self._step_dirs()):
            why = "refused"
            if REFUSED in files:
                why = json.loads(self.storage.read_bytes(f"{path}/{REFUSED}")).get("reason", why)
            out.append(f"{self.storage.name(path)}: {why}")
        return out

    def supersede_existing(self, why: str) -> None:
        """A fresh start into a directory holding step folders (checkpoint.resume="none", or
        allow_fresh_start past refused ones): move them to quarantine, so that this run's saves never mix
        with them and pruning never deletes them."""
        def op():
            for _, path, _files in self._step_dirs():
                quarantine(self.storage, path, f"{why}; a fresh run does not resume from or prune it", self.log)
        self._from_rank0(op)

    def _resolve_source(self, source: str) -> tuple[Storage, str]:
        st = Storage(source, self.storage.policy)
        if st.exists(f"{st.root}/{MANIFEST}"):
            return st, st.root
        done = self._from_rank0(lambda: self.committed(st))
        if not done:
            steps = self._from_rank0(lambda: [(st.name(p), self._why_unusable(st, p, f))
                                              for _, p, f in self._step_dirs(st)])
            if steps:  # "no checkpoint" would send the user looking in the wrong place
                raise CheckpointError(f"{source}: no usable checkpoint: its {len(steps)} step_* folder(s) are "
                                      f"not complete ({'; '.join(f'{n}: {w}' for n, w in steps[-3:])})")
            raise CheckpointError(f"{source}: not a checkpoint: it holds no {MANIFEST} and no complete "
                                  "step_* checkpoint folder")
        return st, done[-1]

    @staticmethod
    def _why_unusable(st: Storage, path: str, files: dict) -> str:
        if REFUSED in files:
            return "refused: " + json.loads(st.read_bytes(f"{path}/{REFUSED}")).get("reason", "")
        return f"no {MANIFEST} (an interrupted or uncommitted save)"

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
        # Which AdamW kernel a group runs is this layout's choice (train.loop.build_optimizer), not a
        # hyperparameter: the saved groups' `fused`/`foreach` would switch the fused kernel on for a group
        # that mixes DTensor and plain parameters (a checkpoint of FSDP resumed under EP x DDP), which it rejects.
        kernels = [{k: group[k] for k in ("fused", "foreach") if k in group} for group in optimizer.param_groups]
        reader = st.reader(path)
        skipped = self._check_parameter_set(path, model_sd, reader.read_metadata())
        if skipped is None:
            state = {"model": model_sd, "optim": optim_sd}
            with quiet_no_dist(self.group is None):
                dcp.load(state, storage_reader=reader, process_group=self.group, no_dist=self.group is None)
            set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=options)
        else:  # checkpoint.partial_load: the matching parameters only; optimizer state of another model is moot
            state = {"model": {k: v for k, v in model_sd.items() if k not in skipped}}
            with quiet_no_dist(self.group is None):
                dcp.load(state, storage_reader=reader, process_group=self.group, no_dist=self.group is None)
            set_model_state_dict(module, state["model"], options=StateDictOptions(strict=False))
        if manifest["format"] == 1 and skipped is None:
            self._restore_format1_hyperparameters(optimizer, state["optim"]["param_groups"], path)
        for group, kernel in zip(optimizer.param_groups, kernels, strict=True):
            group.update(kernel)
        same = manifest["world_size"] == self.world_size and manifest["layout"] == self.layout
        extra = torch.load(io.BytesIO(st.read_bytes(f"{path}/{extra_name(self.rank if same else 0)}")),
                           weights_only=False)
        rng = extra.pop("rng")
        set_rng_state(rng)
        return Resumed(path=path, step=int(manifest["step"]), extra=extra, saved_layout=manifest["layout"],
                       saved_world_size=manifest["world_size"], same_layout=same, rng=rng)

    def _check_parameter_set(self, path: str, model_sd: dict, metadata) -> set[str] | None:
        """Refuse a checkpoint whose parameters are not this model's (names and global shapes, over the union
        of every rank's parameters: a pipeline rank holds only its own stages). With checkpoint.partial_load,
        return the names to leave unloaded instead (logged). None: the parameter sets match."""
        saved = {k.removeprefix("model."): tuple(v.size) for k, v in metadata.state_dict_metadata.items()
                 if k.startswith("model.") and hasattr(v, "size")}
        mine = {k: tuple(v.shape) for k, v in model_sd.items()}  # DTensor .shape is the global shape
        ours = {k: v for per_rank in self._gather(mine) for k, v in per_rank.items()}
        missing = sorted(set(ours) - set(saved))
        unexpected = sorted(set(saved) - set(ours))
        shapes = sorted(k for k in set(ours) & set(saved) if ours[k] != saved[k])
        if not (missing or unexpected or shapes):
            return None

        def names(items: list[str]) -> str:
            return ", ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")
        parts = [f"{len(missing)} parameter(s) of this model missing from it ({names(missing)})" if missing else "",
                 f"{len(unexpected)} unexpected ({names(unexpected)})" if unexpected else "",
                 f"{len(shapes)} of another shape ({names([f'{k} {saved[k]} != {ours[k]}' for k in shapes])})"
                 if shapes else ""]
        what = "; ".join(p for p in parts if p)
        if not self.partial_load:
            raise CheckpointError(f"cannot resume from {path}: it holds another model's parameters: {what}; "
                                  "allowed: the model it was saved with, a new metrics.run_dir, or loading what "
                                  "matches with checkpoint.partial_load=true")
        self.log(f"WARNING: checkpoint.partial_load: {path}: {what}; loading the {len(set(ours) & set(saved)) - len(shapes)}"
                 " matching parameter(s), the others keep their initial values; optimizer state starts fresh")
        return (set(missing) | set(shapes)) & set(mine)
