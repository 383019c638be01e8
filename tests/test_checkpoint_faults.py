"""Faults that used to lose work silently (issue #19), each reproduced here: storage errors inside DCP's shard
writer (retried, root cause named), a full disk, refused checkpoints and a fresh start, a missing manifest,
non-finite numbers before a commit, a checkpoint of another model, two runs on one directory, SIGTERM, RNG.
Small in-process cases first; one torchrun job at the end."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torchrun_fork
from test_checkpoint import (
    EVERY,
    Tiny,
    _damage,
    _manager,
    _model_and_optimizer,
    main,
    main_with_faults,
    reference,
    train_args,
)
from torch import nn

from paratrain.train.checkpoint import MANIFEST, REFUSED, CheckpointError, step_name
from paratrain.train.faults import FaultInjector
from paratrain.train.storage import RetryPolicy, is_transient, root_causes

__all__ = ["reference"]  # the module-scoped fixture of test_checkpoint, shared
REPO = Path(__file__).resolve().parents[1]


def _fail_dcp_writes(monkeypatch, exc: BaseException, times: int) -> list[int]:
    """Make DCP's own shard writer (filesystem._write_item, used by FileSystemWriter and FsspecWriter) raise
    `exc` for its first `times` calls: the failure arises inside dcp.save and reaches us wrapped in DCP's
    CheckpointException, as a real storage error does."""
    real, calls = dcp_fs._write_item, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) <= times:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", flaky)
    return calls


# ---- storage errors inside DCP's writer ----------------------------------------------------------------------
def test_connection_reset_inside_the_shard_write_is_retried_and_the_save_commits(tmp_path, monkeypatch):
    mgr, logs = _manager(tmp_path, retry=RetryPolicy(attempts=3, base_s=0.0))
    model, opt = _model_and_optimizer(0)
    calls = _fail_dcp_writes(monkeypatch, ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), 1)
    mgr.save(1, [model], opt, {"step": 1})
    assert len(calls) > 1 and mgr.failed_saves == 0 and mgr.latest().endswith(step_name(1))
    warning = next(m for m in logs if m.startswith("WARNING: writing checkpoint step 1 failed"))
    assert "ConnectionResetError" in warning and "Connection reset by peer" in warning and "retry 1/2" in warning
    fresh, fresh_opt = _model_and_optimizer(9)
    assert mgr.resume([fresh], fresh_opt).step == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(),
                                                 strict=True))


def test_dcp_failures_are_unwrapped_and_permanent_ones_are_not_retried(tmp_path, monkeypatch):
    """torch 2.13's CheckpointException holds (exception, traceback) per rank: the root cause must be found
    inside, a full disk must be named and reported at once (no retry can free space)."""
    mgr, logs = _manager(tmp_path, retry=RetryPolicy(attempts=4, base_s=0.0))
    model, opt = _model_and_optimizer(0)
    calls = _fail_dcp_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"), 100)
    mgr.save(1, [model], opt, {"step": 1})
    assert mgr.failed_saves == 1 and len(calls) == 1  # one attempt: permanent
    error = next(m for m in logs if m.startswith("ERROR: checkpoint of step 1 NOT saved"))
    assert "No space left on device" in error and "CheckpointException ranks" not in error
    assert not (tmp_path / step_name(1)).exists()  # the failed partial is removed at once, with a line
    assert any(f"removing the failed save {tmp_path / step_name(1)}" in m for m in logs)
    from torch.distributed.checkpoint.api import CheckpointException

    wrapped = CheckpointException("x", {0: (ConnectionResetError("reset"), None),
                                        1: (PermissionError(errno.EACCES, "denied"), None)})
    assert [type(e).__name__ for e in root_causes(wrapped)] == ["ConnectionResetError", "PermissionError"]
    assert not is_transient(wrapped)
    assert is_transient(CheckpointException("x", {0: (TimeoutError("slow"), None)}))
    assert not is_transient(OSError(errno.EDQUOT, "Disk quota exceeded"))


# ---- resume semantics -----------------------------------------------------------------------------------------
def _copy_reference(reference, tmp_path: Path, run: str) -> Path:
    ckpt = tmp_path / run / "checkpoints"
    shutil.copytree(reference["ckpt"], ckpt)
    return ckpt


def test_refused_checkpoints_never_lead_to_a_silent_fresh_start(reference, tmp_path, capsys):
    """Both checkpoints truncated: the first start refuses them (exit 2); the second start (a torchrun restart)
    used to skip the REFUSED-marked folders, find nothing, train from step 0 and exit 0."""
    ckpt = _copy_reference(reference, tmp_path, "r")
    for step in (3, 6):
        _damage(ckpt / step_name(step) / "__0_0.distcp", "truncate")
    args = train_args(tmp_path, reference["data"], "r")
    for attempt in range(2):
        assert main(args) == 2, attempt
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("paratrain train: error:")]
        assert len(err) == 1 and "no usable checkpoint in" in err[0] and "not starting over from step 0" in err[0]
        assert f"{step_name(6)}: {ckpt / step_name(6)}/__0_0.distcp:" in err[0]
    metrics = tmp_path / "r" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()
    assert all((ckpt / step_name(s) / REFUSED).is_file() for s in (3, 6))
    # Deliberately: both are moved to quarantine (kept), and the run starts from step 0.
    assert main(args + ["--set", "checkpoint.allow_fresh_start=true"]) == 0
    out = capsys.readouterr().err
    assert out.count(f"to {ckpt}/quarantine/step_0000000") == 2 and "checkpoint.allow_fresh_start=true" in out
    assert sorted(p.name.split("-")[0] for p in (ckpt / "quarantine").iterdir()) == [step_name(3), step_name(6)]


def test_a_lost_manifest_quarantines_intact_shards_instead_of_deleting_them(tmp_path):
    mgr, logs = _manager(tmp_path)
    model, opt = _model_and_optimizer(1)
    mgr.save(1, [model], opt, {"step": 1})
    mgr.save(2, [model], opt, {"step": 2})
    (tmp_path / step_name(2) / MANIFEST).unlink()
    (tmp_path / step_name(3)).mkdir()  # a save interrupted inside DCP: no .metadata
    (tmp_path / step_name(3) / "__0_0.distcp").write_bytes(b"half")
    fresh, fresh_opt = _model_and_optimizer(7)
    assert mgr.resume([fresh], fresh_opt).step == 1
    moved = list((tmp_path / "quarantine").iterdir())
    assert [p.name.split("-")[0] for p in moved] == [step_name(2)] and (moved[0] / "__0_0.distcp").is_file()
    assert any(f"moved {tmp_path / step_name(2)} to {moved[0]}: no {MANIFEST} but complete DCP shards" in m
               for m in logs)
    assert any(f"removing interrupted checkpoint {tmp_path / step_name(3)}" in m for m in logs)
    # Only the manifest-less one left (step 1 gone too): an error, not a fresh start.
    shutil.rmtree(tmp_path / step_name(1))
    shutil.copytree(moved[0], tmp_path / step_name(2))
    with pytest.raises(CheckpointError, match=f"no usable checkpoint .*{step_name(2)}: no {MANIFEST}, shards moved"):
        _manager(tmp_path)[0].resume([fresh], fresh_opt)


def test_a_refused_folder_replaced_by_a_new_save_is_kept_with_a_log_line(tmp_path):
    mgr, logs = _manager(tmp_path)
    model, opt = _model_and_optimizer(2)
    mgr.save(1, [model], opt, {"step": 1})
    mgr.save(2, [model], opt, {"step": 2})
    _damage(tmp_path / step_name(2) / "__0_0.distcp", "corrupt")
    assert mgr.resume([model], opt).step == 1
    mgr.save(2, [model], opt, {"step": 2})
    assert any(m.startswith(f"moved {tmp_path / step_name(2)} to {tmp_path}/quarantine/") and "replaced by a new "
               "save" in m for m in logs), logs
    assert mgr.latest().endswith(step_name(2)) and mgr.verify(mgr.latest()) is None


def test_sixteen_flipped_bytes_are_caught_at_load_by_default(tmp_path):
    mgr, logs = _manager(tmp_path)  # the default verification: sha256 of every file
    model, opt = _model_and_optimizer(3)
    mgr.save(1, [model], opt, {"step": 1})
    mgr.save(2, [model], opt, {"step": 2})
    shard = tmp_path / step_name(2) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[64:80] = bytes(b ^ 0x5A for b in data[64:80])
    shard.write_bytes(bytes(data))
    assert mgr.resume([model], opt).step == 1
    assert any(f"refused: {shard}: sha256" in m for m in logs)


# ---- strict loading -----------------------------------------------------------------------------------------
class Wider(Tiny):
    def __init__(self):
        super().__init__()
        self.c = nn.Linear(2, 2)  # a parameter the checkpoint does not have
        self.b = nn.Linear(8, 4)  # another shape


def test_a_checkpoint_of_another_model_is_refused_with_the_names_unless_partial_load(tmp_path):
    mgr, logs = _manager(tmp_path)
    model, opt = _model_and_optimizer(4)
    mgr.save(1, [model], opt, {"step": 1})
    smaller = nn.Sequential()
    smaller.a = nn.Linear(8, 8)
    for other in (Wider(), smaller):
        other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
        with pytest.raises(CheckpointError, match="holds another model's parameters") as err:
            mgr.resume([other], other_opt)
        assert "checkpoint.partial_load=true" in str(err.value)
    wider = Wider()
    wider_msg = str(pytest.raises(CheckpointError, mgr.resume, [wider], torch.optim.AdamW(wider.parameters())).value)
    assert "2 parameter(s) of this model missing from it (c.bias, c.weight)" in wider_msg
    assert "2 of another shape (b.bias (2,) != (4,), b.weight (2, 8) != (4, 8))" in wider_msg
    assert "2 unexpected (b.bias, b.weight)" in str(pytest.raises(
        CheckpointError, mgr.resume, [smaller], torch.optim.AdamW(smaller.parameters())).value)

    partial, _ = _manager(tmp_path, partial_load=True)
    torch.manual_seed(0)
    wider = Wider()
    init_c = wider.c.weight.detach().clone()
    assert partial.resume([wider], torch.optim.AdamW(wider.parameters(), lr=0.1)).step == 1
    assert torch.equal(wider.a.weight, model.a.weight) and torch.equal(wider.c.weight, init_c)


# ---- storage full --------------------------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()

    def mount_with(size_bytes: int) -> Path:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the ENOSPC path is covered by "
                        "test_dcp_failures_are_unwrapped_and_permanent_ones_are_not_retried")
        return mount

    yield mount_with
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_disk_exits_non_zero_keeps_the_previous_checkpoint_and_a_restart_succeeds(reference, tmp_path,
                                                                                      small_tmpfs, capsys):
    one = sum(f.stat().st_size for f in (reference["ckpt"] / step_name(3)).iterdir())
    disk = small_tmpfs(int(2.3 * one))
    filler = disk / "filler"
    filler.write_bytes(b"\0" * int(0.8 * one))  # room for step 3, not for step 6 too
    args = train_args(tmp_path, reference["data"], "full", f'checkpoint.dir="{disk / "ckpt"}"')
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "the final checkpoint (step 6) was NOT saved" in err and "No space left on device" in err
    assert sorted(p.name for p in (disk / "ckpt").iterdir()) == [step_name(3)]  # no partial left behind
    assert main(["checkpoint", "verify", str(disk / "ckpt")]) == 0
    filler.unlink()  # space freed
    capsys.readouterr()
    got_path = tmp_path / "full2.json"
    assert main(args + ["--summary-json", str(got_path)]) == 0
    got = json.loads(got_path.read_text())
    assert got["resumed_from"] == str(disk / "ckpt" / step_name(3))
    assert got["losses"] == reference["summary"]["losses"][EVERY:]


# ---- non-finite numbers ----------------------------------------------------------------------------------------
def _nan_weights_after(monkeypatch, step: int) -> None:
    """A bad update: after optimizer step `step`, one weight becomes NaN (as a diverging or bit-flipped update
    would leave it); the next loss is NaN."""
    import paratrain.train.loop as loop

    real = loop.build_optimizer

    def build(runner, opt_cfg):
        optimizer, count = real(runner, opt_cfg), [0]

        def poison(*_):
            count[0] += 1
            if count[0] == step:
                with torch.no_grad():
                    for param in runner.parameters():  # the norms' element 0 reaches every token
                        param.view(-1)[0] = float("nan")

        optimizer.register_step_post_hook(poison)
        return optimizer

    monkeypatch.setattr(loop, "build_optimizer", build)


@pytest.mark.parametrize("policy", ["stop", "rollback"])
def test_non_finite_numbers_are_never_committed(reference, tmp_path, monkeypatch, capsys, policy):
    _nan_weights_after(monkeypatch, 4)  # loss of step 5 is NaN; step 6 is a save
    summary = tmp_path / f"{policy}.json"
    args = train_args(tmp_path, reference["data"], policy, f'checkpoint.nonfinite="{policy}"') + [
        "--summary-json", str(summary)]
    code = main(args)
    got = json.loads(summary.read_text())
    ckpt = tmp_path / policy / "checkpoints"
    if policy == "stop":
        assert code == 1 and got["checkpoint"].endswith(step_name(3))
        assert "non-finite numbers at step 5: loss nan" in capsys.readouterr().err
        assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step")) == [step_name(3)]
    else:  # back to step 3, past the batches of steps 4..6: the final step 6 is finite and committed
        assert code == 0 and got["rollbacks"] == 1 and got["losses"][:4] == reference["summary"]["losses"][:4]
        assert all(x == x for x in got["losses"][-3:]) and got["losses"][-3:] != reference["summary"]["losses"][3:]
        assert "rolled back to step 3" in capsys.readouterr().err
        assert got["checkpoint"].endswith(step_name(6))
        lines = [json.loads(ln) for ln in (tmp_path / policy / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 5, 6]  # one record per step


# ---- SIGTERM, RNG, metrics across restarts ---------------------------------------------------------------------
def _generators() -> tuple:
    return (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())


def _same_generators(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


def test_sigterm_saves_at_the_next_step_exits_0_and_resumes_bitwise_with_the_rng(reference, tmp_path, monkeypatch,
                                                                                capsys):
    seen: dict[int, tuple] = {}

    def at_step(step, rank):
        seen[step] = _generators()  # what the step's draws would start from (reading it draws nothing)
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # the notice arrives during step 4

    summary = tmp_path / "term.json"
    argv = train_args(tmp_path, reference["data"], "term") + ["--summary-json", str(summary)]
    assert main_with_faults(argv, FaultInjector(hooks={"after_step": [at_step]})) == 0
    got = json.loads(summary.read_text())
    ckpt = tmp_path / "term" / "checkpoints"
    assert got["preempted"]["signal"] == "SIGTERM" and got["preempted"]["step"] == 4
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step")) == [step_name(3), step_name(4)]
    assert got["losses"] == reference["summary"]["losses"][:4]
    assert "SIGTERM: checkpoint of step 4 committed" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler removed after the run

    fresh = dict(seen)
    seen.clear()
    record = FaultInjector(hooks={"after_step": [lambda step, rank: seen.setdefault(step, _generators())]})
    assert main_with_faults(argv, record) == 0
    again = json.loads(summary.read_text())
    assert again["resumed_from"] == str(ckpt / step_name(4))
    assert again["losses"] == reference["summary"]["losses"][4:]  # bitwise
    # every generator continues exactly from the saved state (the start-up probe drew from the restored one)
    assert _same_generators(seen[5], fresh[4])
    records = [json.loads(ln) for ln in (tmp_path / "term" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_recomputed_steps_are_recorded_once_and_the_lost_ones_kept_aside(reference, tmp_path):
    run = tmp_path / "m"
    shutil.copytree(reference["tmp"] / "ref", run)  # steps 1..6 recorded, checkpoints 3 and 6
    shutil.rmtree(run / "checkpoints" / step_name(6))  # lost: steps 4..6 are recomputed from step 3
    assert main(train_args(tmp_path, reference["data"], "m")) == 0
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    superseded = [json.loads(ln) for ln in (run / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in superseded if "loss" in r] == [4, 5, 6]


# ---- one run per directory -------------------------------------------------------------------------------------
HOLD_LEASE = """
import sys, time
from paratrain.train.lease import RunLease
from paratrain.train.storage import Storage
lease = RunLease(Storage(sys.argv[1]), ttl_s=float(sys.argv[2]), log=print)
lease.acquire()
print("HELD", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_holder(reference, tmp_path, capsys):
    ckpt = tmp_path / "busy" / "checkpoints"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LEASE, str(ckpt), "30"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    try:
        assert holder.stdout.readline().strip() == "HELD"
        assert main(train_args(tmp_path, reference["data"], "busy")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"checkpoint.dir='{ckpt}' is in use by another run (host " in err[0]
        assert f"pid {holder.pid}," in err[0] and "last heartbeat" in err[0]
        assert not (tmp_path / "busy" / "metrics.jsonl").exists()  # refused before any work
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: its process is gone, so the lease is taken over at once.
    assert main(train_args(tmp_path, reference["data"], "busy", "train.steps=3", "checkpoint.save_final=true")) == 0
    out = capsys.readouterr().err
    assert f"taking over the run lease {ckpt}/LEASE.json" in out and f"process {holder.pid} on this host has exited" in out
    assert not (ckpt / "LEASE.json").exists()  # released at the end


def test_a_lease_of_another_host_expires_after_its_ttl(tmp_path):
    from paratrain.train.lease import LeaseHeld, RunLease
    from paratrain.train.storage import Storage

    st = Storage(tmp_path)
    logs: list[str] = []
    other = {"id": "x", "host": "node-7", "pid": 1, "job": "", "started_unix_s": 0, "ttl_s": 60}
    (tmp_path / "LEASE.json").write_text(json.dumps({**other, "heartbeat_unix_s": time.time() - 5}))
    with pytest.raises(LeaseHeld, match="in use by another run \\(host node-7 pid 1, .*last heartbeat 5 s ago"):
        RunLease(st, 60, logs.append).acquire()
    (tmp_path / "LEASE.json").write_text(json.dumps({**other, "heartbeat_unix_s": time.time() - 61}))
    lease = RunLease(st, 60, logs.append)
    lease.acquire()
    assert "heartbeat is 61 s old (ttl 60 s)" in logs[-1]
    assert json.loads((tmp_path / "LEASE.json").read_text())["id"] == lease.record["id"]
    lease.release()
    assert not (tmp_path / "LEASE.json").exists()


# ---- under torchrun ------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_torchrun_restart_after_refused_checkpoints_does_not_start_over(reference, tmp_path):
    """The report's case: the two newest (here: all) checkpoints truncated, torchrun --max-restarts 1. Attempt 0
    refuses them and exits 2; attempt 1 used to find no checkpoint (they were marked refused), train from step 0
    and return 0. Now every attempt refuses, torchrun fails, and the checkpoints are kept."""
    ckpt = _copy_reference(reference, tmp_path, "tr")
    for step in (3, 6):
        _damage(ckpt / step_name(step) / "__0_0.distcp", "truncate")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("PARATRAIN_FAULT_KILL", None)
    code, log = torchrun_fork.run(["--nproc-per-node", "1", "--standalone", "--max-restarts", "1"],  # forked warm
                                  train_args(tmp_path, reference["data"], "tr"), env, tmp_path / "tr.log", 280,
                                  cwd=REPO)
    assert code != 0, log[-3000:]
    assert log.count("no usable checkpoint in") == 2, log[-3000:]  # both attempts refused, neither trained
    metrics = tmp_path / "tr" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()
    assert sorted(p.name for p in ckpt.iterdir()) == [step_name(3), step_name(6)]
    assert all((ckpt / step_name(s) / REFUSED).is_file() for s in (3, 6))


def test_lost_manifests_refuse_a_fresh_start_through_train(reference, tmp_path, capsys):
    """Every checkpoint's manifest lost (its shards complete): `train` used to quarantine them in its start-up
    tidy, then find nothing to resume and train from step 0 silently; the resume's refusal never saw them."""
    ckpt = _copy_reference(reference, tmp_path, "m")
    for step in (3, 6):
        (ckpt / step_name(step) / MANIFEST).unlink()
    assert main(train_args(tmp_path, reference["data"], "m")) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("paratrain train: error:")]
    assert len(err) == 1 and "no usable checkpoint in" in err[0] and f"{step_name(6)}: no {MANIFEST}" in err[0]
    metrics = tmp_path / "m" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()
