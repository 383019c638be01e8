"""One run per checkpoint directory: an exclusive lease, `<checkpoint.dir>/LEASE.json`.

Two runs writing one directory both "commit" every save, prune each other's checkpoints and delete each other's
saves in progress; nothing in the checkpoints themselves shows it. So rank 0 takes a lease before it touches
the directory: a small object naming the owner (host, pid, job id, start time) with a heartbeat that a
background thread refreshes every ttl/4. A second run finds a live lease and is refused with one line naming
the holder. The lease is taken over (with a log line) when its heartbeat is older than its ttl (the holder died
without releasing it, e.g. SIGKILL or a lost node), at once when the holder is a dead process on this host, and
at once by the same job restarted (the same TORCHELASTIC_RUN_ID or SLURM_JOB_ID: torchrun's restarts, a
requeued Slurm job).

It works the same on a local disk, a shared filesystem and S3 (only whole-object writes and reads). Creating a
lease where none exists is exclusive on a filesystem (O_EXCL); on S3 the writer reads the lease back after a
short settle time and keeps it only if its own record is there, and every heartbeat checks the owner again, so
a run that lost a race stops at its next save, without saving (`lost`). Why our own: torch.distributed has no cross-job lock,
and the cloud lock services (DynamoDB, etcd) would be one more dependency for one small object.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from paratrain.train.storage import Storage, StorageError, retry

LEASE = "LEASE.json"
JOB_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


class LeaseHeld(ValueError):
    """Another live run holds the directory: one line naming it (a ValueError: the CLI prints it, exits 2)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def job_id() -> str:
    """The scheduler's id of this job, the same across its restarts ("" outside torchrun and Slurm)."""
    return next((f"{k}={os.environ[k]}" for k in JOB_ENV if os.environ.get(k)), "")


class RunLease:
    def __init__(self, storage: Storage, ttl_s: float, log: Callable[[str], None], *, settle_s: float | None = None):
        self.storage = storage
        self.path = storage.join(LEASE)
        self.ttl_s = ttl_s
        self.log = log
        self.settle_s = (2.0 if storage.remote else 0.0) if settle_s is None else settle_s
        self.record = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "job": job_id(),
                       "started_unix_s": time.time(), "heartbeat_unix_s": time.time(), "ttl_s": ttl_s}
        self.lost = ""  # why the lease is no longer ours (another run took it), "" while held
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- holder ----------------------------------------------------------------------------------------------
    def holder(self) -> dict | None:
        try:
            return json.loads(self.storage.read_bytes(self.path))
        except StorageError:
            if not self.storage.exists(self.path):
                return None
            raise
        except ValueError:  # a torn or foreign file: nobody can be shown to hold it
            return None

    def why_free(self, h: dict, now: float) -> str | None:
        """Why holder `h` no longer holds the lease, or None while it does."""
        if h.get("id") == self.record["id"]:
            return "ours"
        age = now - float(h.get("heartbeat_unix_s", 0))
        if age > float(h.get("ttl_s", self.ttl_s)):
            return f"its heartbeat is {age:.0f} s old (ttl {h.get('ttl_s')} s)"
        if h.get("host") == self.record["host"] and not _pid_alive(int(h.get("pid", -1))):
            return f"process {h.get('pid')} on this host has exited"
        if h.get("host") == self.record["host"] and h.get("pid") == self.record["pid"]:
            return "an earlier run in this very process that did not release it"
        if self.record["job"] and h.get("job") == self.record["job"]:
            return f"the same job ({self.record['job']}) restarted"
        return None

    @staticmethod
    def describe(h: dict, now: float) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(h.get("started_unix_s", 0))))
        job = f", job {h['job']}" if h.get("job") else ""
        return (f"host {h.get('host')} pid {h.get('pid')}{job}, started {started}, last heartbeat "
                f"{now - float(h.get('heartbeat_unix_s', 0)):.0f} s ago")

    # ---- acquire, heartbeat, release ---------------------------------------------------------------------
    def acquire(self) -> None:
        now = time.time()
        h = self.holder()
        if h is not None:
            why = self.why_free(h, now)
            if why is None:
                raise self._held(h, now)
            if why != "ours":
                self.log(f"taking over the run lease {self.path} from {self.describe(h, now)}: {why}")
        self._write(exclusive=h is None)
        if self.settle_s:
            time.sleep(self.settle_s)  # S3: a racing writer's PUT lands within this; read back who won
        h = self.holder()
        if h is None or h.get("id") != self.record["id"]:
            raise self._held(h or {}, time.time())
        self._thread = threading.Thread(target=self._beat, name="paratrain-lease", daemon=True)
        self._thread.start()

    def _held(self, h: dict, now: float) -> LeaseHeld:
        return LeaseHeld(f"checkpoint.dir={self.storage.root!r} is in use by another run ({self.describe(h, now)}; "
                         f"lease {self.path}); two runs on one directory would mix and prune each other's "
                         f"checkpoints: wait for it, use another checkpoint.dir / metrics.run_dir, or, if that run "
                         f"is dead, the lease expires {self.ttl_s:.0f} s after its last heartbeat "
                         "(checkpoint.lease_ttl_s)")

    def _write(self, exclusive: bool = False) -> None:
        self.record["heartbeat_unix_s"] = time.time()
        data = json.dumps(self.record).encode()
        if exclusive and not self.storage.remote:  # a filesystem: creating the lease is atomic and exclusive
            retry(lambda: self._create(data), f"write {self.path}", self.storage.policy)
        else:
            self.storage.write_bytes(self.path, data)

    def _create(self, data: bytes) -> None:
        os.makedirs(self.storage.root, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return  # another run created it since we looked: the read-back decides
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                h = self.holder()
                if h is not None and h.get("id") != self.record["id"]:
                    self.lost = f"the run lease {self.path} was taken by {self.describe(h, time.time())}"
                    self.log(f"ERROR: {self.lost}; this run stops at its next save, without saving")
                    return
                self._write()
            except (StorageError, OSError) as exc:  # storage down: keep trying; the ttl is the margin
                self.log(f"WARNING: run lease heartbeat failed: {exc}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.lost:
            return
        try:
            h = self.holder()
            if h is not None and h.get("id") == self.record["id"]:
                self.storage.remove_tree(self.path)
        except StorageError as exc:
            self.log(f"WARNING: could not release the run lease {self.path}: {exc}; it expires in {self.ttl_s:.0f} s")
