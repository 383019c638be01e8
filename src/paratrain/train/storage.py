"""Where checkpoints live: a local path, a shared filesystem path (EFS, Lustre, NFS: the same code as local) or
`s3://bucket/prefix` through fsspec/s3fs, with bounded retries and exponential backoff on transient errors.

S3 settings come the usual AWS ways, so the same config works against AWS S3 and S3-compatible stores:
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (endpoint), AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN
or AWS_PROFILE or an instance role (credentials, resolved by botocore), AWS_REGION / AWS_DEFAULT_REGION (region).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("paratrain.checkpoint")
T = TypeVar("T")
HASH_CHUNK_BYTES = 8 << 20

# Errors that another attempt cannot fix: a wrong path, missing permission, a bug. Everything else from storage
# (connection refused or reset, timeouts, throttling, 5xx from S3, EIO on a shared filesystem) is retried.
PERMANENT_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError,
                    TypeError, KeyError, AttributeError, NotImplementedError)


class StorageError(RuntimeError):
    """A storage operation failed after all retries (or with an error no retry can fix)."""


# OS errors another attempt cannot fix: no space, over quota, read-only, no permission. (EIO, ETIMEDOUT,
# ECONNRESET and the like stay transient.)
PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG}

# botocore's configuration errors (by name: botocore is only imported with s3fs): missing or partial
# credentials, an unknown profile, no region. Waiting does not fix them.
PERMANENT_BOTOCORE_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "ProfileNotFound", "NoRegionError",
                             "UnknownCredentialError", "InvalidConfigError", "ParamValidationError"}


def _is_checkpoint_exception(exc: BaseException) -> bool:
    """isinstance(exc, DCP's CheckpointException), without importing DCP: while torch.distributed.checkpoint is
    not loaded no error can be one. Keeps this module (and the run lease, `paratrain checkpoint list`) free of
    torch at import: a process that only holds or checks a lease paid ~2.6 CPU-s for torch and DCP."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api is not None and isinstance(exc, api.CheckpointException)


def root_causes(exc: BaseException) -> list[BaseException]:
    """The errors behind `exc`: DCP's CheckpointException gathers every failed rank's error as an
    (exception, traceback) pair (torch 2.13); unwrap those (recursively), anything else is its own cause."""
    if _is_checkpoint_exception(exc):
        inner = [f[0] if isinstance(f, tuple) else getattr(f, "exception", f) for f in exc.failures.values()]
        return [c for e in inner if isinstance(e, BaseException) for c in root_causes(e)] or [exc]
    return [exc]


def describe(exc: BaseException) -> str:
    """One line naming the root cause(s), e.g. "OSError: [Errno 28] No space left on device"."""
    causes = root_causes(exc)
    text = "; ".join(dict.fromkeys(f"{type(c).__name__}: {short(c)}" for c in causes[:4]))
    return text + (f" (and {len(causes) - 4} more)" if len(causes) > 4 else "")


def is_transient(exc: BaseException) -> bool:
    causes = root_causes(exc)
    if len(causes) > 1 or causes[0] is not exc:  # DCP gathered several: transient only if every one is
        return all(is_transient(c) for c in causes)
    if type(exc).__name__ in PERMANENT_BOTOCORE_ERRORS:
        return False
    if isinstance(exc, OSError) and exc.errno in PERMANENT_ERRNOS:
        return False
    return isinstance(exc, Exception) and not isinstance(exc, PERMANENT_ERRORS)


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` tries in all; the wait doubles from base_s up to max_s, with +-25% jitter so that thousands of
    ranks retrying against one bucket do not do it in lockstep."""

    attempts: int = 4
    base_s: float = 0.5
    max_s: float = 8.0

    def delay_s(self, attempt: int) -> float:
        return min(self.base_s * 2 ** attempt, self.max_s) * random.uniform(0.75, 1.25)


def retry(fn: Callable[[], T], what: str, policy: RetryPolicy) -> T:
    """fn() with retries on transient errors; raises StorageError naming `what` when it still fails."""
    for attempt in range(policy.attempts):
        try:
            return fn()
        except BaseException as exc:  # noqa: BLE001 - Exception or DCP's CheckpointException, classified below
            if not (isinstance(exc, Exception) or _is_checkpoint_exception(exc)):
                raise
            if not is_transient(exc):
                raise StorageError(f"{what}: {describe(exc)}") from exc
            if attempt + 1 == policy.attempts:
                raise StorageError(f"{what} failed after {policy.attempts} attempts: {describe(exc)}") from exc
            wait_s = policy.delay_s(attempt)
            log.warning("storage: %s failed (%s); retry %d/%d in %.2f s", what, describe(exc),
                        attempt + 1, policy.attempts - 1, wait_s)
            time.sleep(wait_s)
    raise AssertionError("unreachable")


def short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= limit else first[:limit] + "..."


def s3_options() -> dict:
    """fsspec/s3fs options from the standard AWS environment. Listing caches are off: a checkpoint folder
    changes under us (other ranks write into it) and a stale listing could hide a commit."""
    client: dict = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        client["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client["region_name"] = region
    # Our RetryPolicy is the outer, logged loop; keep botocore's inner one short so that an outage
    # is reported in seconds, not minutes of silent retries.
    opts = {"use_listings_cache": False, "skip_instance_cache": True, "client_kwargs": client,
            "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 10}}
    if os.environ.get("AWS_PROFILE"):
        opts["profile"] = os.environ["AWS_PROFILE"]
    return opts


_URL_LIKE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/?(?!/)")  # s3:/bucket, s3:bucket (a one-letter C: is a drive)


def check_root(root: str, field: str = "checkpoint.dir") -> None:
    """A checkpoint location we can use: a filesystem path, s3://bucket/prefix or file://path. A URL with a slash
    missing (`s3:/bucket`) is refused: it was taken as a local folder named 's3:' and the run saved there."""
    allowed = "allowed: a local or shared filesystem path or s3://bucket/prefix"
    if "://" in root and not root.startswith(("s3://", "file://")):
        raise ValueError(f"{field}={root!r}: {allowed}")
    if "://" not in root and _URL_LIKE.match(root):
        raise ValueError(f"{field}={root!r}: a URL with a slash missing (scheme://...)?; {allowed} (a local folder "
                         f"whose name has a colon: ./{root})")


class Storage:
    """One checkpoint root. Paths passed around are strings: absolute local paths or s3://bucket/key."""

    def __init__(self, root: str | Path, policy: RetryPolicy | None = None):
        root = str(root)
        check_root(root)
        self.remote = root.startswith("s3://")
        self.root = root.rstrip("/") if self.remote else str(Path(root.removeprefix("file://")).absolute())
        self.policy = policy or RetryPolicy()
        self._fs = None

    @property
    def fs(self):
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem("s3", **s3_options()) if self.remote else fsspec.filesystem("file")
        return self._fs

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts]) if self.remote else os.path.join(self.root, *parts)

    def name(self, path: str) -> str:
        return path.rstrip("/").rsplit("/", 1)[-1]

    # ---- DCP readers and writers -------------------------------------------------------------------------
    def writer(self, path: str):
        if self.remote:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(path, sync_files=False, **s3_options())
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(path, sync_files=True)  # fsync: the manifest must never precede the data

    def reader(self, path: str):
        if self.remote:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(path, **s3_options())
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)

    # ---- small operations, each retried -------------------------------------------------------------------
    def listdir(self, path: str) -> dict[str, int | None]:
        """name -> size in bytes (None for folders) of the entries directly in `path`; {} if it is missing."""
        def op():
            if not self.fs.exists(path):
                return {}
            entries = self.fs.ls(path, detail=True)
            return {self.name(e["name"]): (None if e["type"] == "directory" else int(e["size"])) for e in entries}
        return retry(op, f"list {path}", self.policy)

    def exists(self, path: str) -> bool:
        return retry(lambda: self.fs.exists(path), f"check {path}", self.policy)

    def read_bytes(self, path: str) -> bytes:
        return retry(lambda: self.fs.cat_file(path), f"read {path}", self.policy)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Atomic: readers see the old object or the whole new one (S3 PUT; local tmp + fsync + rename)."""
        retry(lambda: self._write_once(path, data), f"write {path}", self.policy)

    def _write_once(self, path: str, data: bytes) -> None:
        if self.remote:
            self.fs.pipe_file(path, data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself must survive a crash
        finally:
            os.close(dir_fd)

    def remove_tree(self, path: str) -> None:
        def op():
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        retry(op, f"remove {path}", self.policy)

    def move(self, src: str, dst: str) -> None:
        """Move a folder (local: one rename; S3: copy then delete, as S3 has no rename)."""
        def op():
            if self.remote:
                self.fs.mv(src, dst, recursive=True)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.replace(src, dst)
        retry(op, f"move {src} to {dst}", self.policy)

    def digest(self, path: str) -> tuple[int, str]:
        """(size in bytes, sha256 hex) of one file, streamed."""
        def op():
            if not self.remote:  # plain file I/O: ~2x faster than through fsspec's file wrapper
                with open(path, "rb") as fh:
                    return os.fstat(fh.fileno()).st_size, hashlib.file_digest(fh, "sha256").hexdigest()
            h, size = hashlib.sha256(), 0
            with self.fs.open(path, "rb", block_size=HASH_CHUNK_BYTES) as fh:
                while chunk := fh.read(HASH_CHUNK_BYTES):
                    h.update(chunk)
                    size += len(chunk)
            return size, h.hexdigest()
        return retry(op, f"read {path} for its checksum", self.policy)
