"""Checkpoints: bitwise resume, async save, manifest verification with fallback, interrupted saves, keep-k,
retries, and real SIGKILLs (during a save; a rank under torchrun with restarts). S3 cases: test_checkpoint_s3.py;
multi-rank and resharding cases: test_checkpoint_dist.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from paratrain.cli import main
from paratrain.train.checkpoint import MANIFEST, REFUSED, CheckpointError, CheckpointManager, step_name
from paratrain.train.storage import RetryPolicy, Storage, StorageError, retry

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 6, 3


def train_args(tmp: Path, data: Path, run: str, *extra: str) -> list[str]:
    sets = ["train.steps=6", "checkpoint.interval=3", "train.progress=false", "train.eval_every=0",
            "metrics.tensorboard=false", f'metrics.run_dir="{tmp / run}"', f'data.prepared_dir="{data}"',
            "data.max_source_bytes=300000", "data.vocab_size=384", "model.vocab=384", "model.layers=2",
            "train.global_batch=4", "train.microbatch=2", "train.seq_len=32", "optim.warmup_steps=2",
            *extra]
    return ["train", *[a for s in sets for a in ("--set", s)]]


def run_train(tmp: Path, data: Path, run: str, *extra: str, resume_from: str | None = None, faults=None) -> dict:
    summary = tmp / f"{run}.json"
    args = train_args(tmp, data, run, *extra) + ["--summary-json", str(summary)]
    if resume_from:
        args += ["--resume-from", resume_from]
    assert (main(args) if faults is None else main_with_faults(args, faults)) == 0
    return json.loads(summary.read_text())


def main_with_faults(argv: list[str], faults) -> int:
    """`paratrain train ...` as main() runs it, with test-only fault hooks passed in (the CLI itself only reads
    PARATRAIN_FAULT_KILL)."""
    from paratrain.cli import build_parser
    from paratrain.train.commands import run_train as cli_run_train

    return cli_run_train(build_parser().parse_args(argv), faults=faults)


_REFERENCE: dict = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 6-step run that saves at steps 3 and 6; its data folder is shared by the tests.
    Computed once per session (test_checkpoint_s3 uses it too); tests copy, never modify, its checkpoints."""
    if not _REFERENCE:
        tmp = tmp_path_factory.mktemp("ckpt-ref")
        data = tmp / "data"
        summary = run_train(tmp, data, "ref")
        _REFERENCE.update(tmp=tmp, data=data, summary=summary, ckpt=tmp / "ref" / "checkpoints")
    return _REFERENCE


def test_resume_continues_bitwise_with_clear_message(reference, tmp_path, capsys):
    ref = reference["summary"]
    assert len(ref["losses"]) == STEPS
    step3 = str(reference["ckpt"] / step_name(3))
    resumed = run_train(tmp_path, reference["data"], "b", resume_from=step3)
    assert resumed["losses"] == ref["losses"][EVERY:]  # bitwise: same layout, fp32, deterministic
    out = capsys.readouterr().err
    assert f"resumed from {step3} at step 3: saved as single device on 1 rank(s), now single device" in out
    assert "sampler at global sample 12" in out


def test_auto_resume_picks_newest_complete_checkpoint(reference, tmp_path, capsys):
    run_dir = tmp_path / "c"
    shutil.copytree(reference["ckpt"], run_dir / "checkpoints")
    shutil.rmtree(run_dir / "checkpoints" / step_name(6))
    partial = run_dir / "checkpoints" / step_name(5)  # a save that never committed
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    got = run_train(tmp_path, reference["data"], "c")
    assert got["losses"] == reference["summary"]["losses"][EVERY:]
    out = capsys.readouterr().err
    assert f"removing interrupted checkpoint {partial}" in out and "at step 3" in out
    assert not partial.exists()


def test_async_save_trains_identically_and_its_checkpoint_resumes_bitwise(reference, tmp_path):
    ref = reference["summary"]["losses"]
    got = run_train(tmp_path, reference["data"], "d", "checkpoint.async_save=true")
    assert got["losses"] == ref
    ckpt = tmp_path / "d" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == [step_name(3), step_name(6)]
    assert all((ckpt / n / MANIFEST).is_file() for n in (step_name(3), step_name(6)))
    again = run_train(tmp_path, reference["data"], "e", resume_from=str(ckpt / step_name(3)))
    assert again["losses"] == ref[EVERY:]


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, words", [("truncate", "the manifest says"), ("corrupt", "(corrupted)")])
def test_damaged_newest_checkpoint_is_refused_and_previous_used(reference, tmp_path, capsys, how, words):
    run_dir = tmp_path / "f"
    shutil.copytree(reference["ckpt"], run_dir / "checkpoints")
    shard = run_dir / "checkpoints" / step_name(6) / "__0_0.distcp"
    _damage(shard, how)
    got = run_train(tmp_path, reference["data"], "f")
    assert got["losses"] == reference["summary"]["losses"][EVERY:]  # continued from step 3
    out = capsys.readouterr().err
    assert f"checkpoint {shard.parent} refused: {shard}: " in out and words in out
    assert "at step 3" in out
    # The damaged folder was replaced by the new save of step 6, which verifies.
    manifest = json.loads((shard.parent / MANIFEST).read_text())
    assert manifest["step"] == 6 and not (shard.parent / REFUSED).exists()


def test_resume_from_a_damaged_checkpoint_is_one_clear_error(reference, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(reference["ckpt"] / step_name(6), bad)
    _damage(bad / ".metadata", "truncate")
    args = train_args(tmp_path, reference["data"], "g") + ["--resume-from", str(bad)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot resume from {bad}: {bad}/.metadata:" in err[0]


@pytest.mark.parametrize("extra, message", [
    (["--resume-from", "{tmp}/no/such/step_00000003"], "--resume-from='{tmp}/no/such/step_00000003': no such folder; "
                                                       "allowed: a checkpoint folder"),
    (["--set", 'checkpoint.resume="atuo"'], "checkpoint.resume='atuo': no such folder; allowed: .* or \"auto\""),
    (["--resume-from", "gs://bucket/run"], "--resume-from='gs://bucket/run': unsupported URL scheme"),
])
def test_a_resume_source_that_cannot_exist_fails_before_any_work(tmp_path, capsys, extra, message):
    data = tmp_path / "data"  # never prepared: the error comes first
    args = train_args(tmp_path, data, "r") + [e.format(tmp=tmp_path) for e in extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message.format(tmp=tmp_path), err[0]), err
    assert not data.exists() and not (tmp_path / "r").exists()


def test_a_checkpoint_dir_that_cannot_be_written_fails_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    data = tmp_path / "data"
    args = train_args(tmp_path, data, "w", f'checkpoint.dir="{blocker}/ckpt"', "checkpoint.retries=1")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint.dir='{blocker}/ckpt': cannot write there (write {blocker}/ckpt/" in err[0]
    assert "NotADirectoryError" in err[0] and "allowed: a writable" in err[0]
    assert not data.exists()  # refused before data preparation


# ---- the manager on a small module: fast cases ---------------------------------------------------------------
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _manager(path, **kw) -> tuple[CheckpointManager, list[str]]:
    logs: list[str] = []
    return CheckpointManager(path, keep=kw.pop("keep", 3), log=logs.append, **kw), logs


def test_keep_last_k_and_interrupted_older_saves_pruned(tmp_path):
    mgr, _ = _manager(tmp_path, keep=2)
    model, opt = _model_and_optimizer(0)
    (tmp_path / step_name(1)).mkdir()  # an interrupted save from before
    for step in (2, 3, 4, 5):
        mgr.save(step, [model], opt, {"step": step})
    assert [Path(p).name for p in mgr.committed()] == [step_name(4), step_name(5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(4), step_name(5)]


def test_refused_checkpoint_falls_back_and_restores_previous_state(tmp_path):
    mgr, logs = _manager(tmp_path)
    model, opt = _model_and_optimizer(1)
    mgr.save(1, [model], opt, {"step": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    rng_after_save = torch.rand(4)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    mgr.save(2, [model], opt, {"step": 2})
    _damage(tmp_path / step_name(2) / "__0_0.distcp", "corrupt")

    fresh, fresh_opt = _model_and_optimizer(99)
    resumed = CheckpointManager(tmp_path, log=logs.append).resume([fresh], fresh_opt)
    assert resumed.step == 1 and resumed.extra == {"step": 1}
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    assert torch.equal(torch.rand(4), rng_after_save)  # RNG restored to the state at the save
    assert any("refused" in m and "__0_0.distcp" in m and "corrupted" in m for m in logs)
    assert (tmp_path / step_name(2) / REFUSED).is_file() and mgr.latest().endswith(step_name(1))


def test_format_1_checkpoints_still_load_and_unknown_formats_are_refused(tmp_path, monkeypatch):
    """Format 2 flattens the optimizer state per parameter name; checkpoints of format 1 (nested param_groups)
    written before keep loading."""
    import paratrain.train.checkpoint as ckpt_module

    model, opt = _model_and_optimizer(4)
    monkeypatch.setattr(ckpt_module, "FORMAT_VERSION", 1)
    _manager(tmp_path)[0].save(1, [model], opt, {"step": 1})
    monkeypatch.undo()
    assert json.loads((tmp_path / step_name(1) / MANIFEST).read_text())["format"] == 1
    fresh, fresh_opt = _model_and_optimizer(5)
    assert _manager(tmp_path)[0].resume([fresh], fresh_opt).step == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(),
                                                 strict=True))
    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for a, b in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))

    manifest_path = tmp_path / step_name(1) / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(CheckpointError, match=r"checkpoint format 99; this paratrain reads formats \(1, 2\)"):
        _manager(tmp_path)[0].load(str(tmp_path / step_name(1)), [fresh], fresh_opt)


def test_truncated_manifest_is_refused_and_previous_used(tmp_path):
    mgr, logs = _manager(tmp_path)
    model, opt = _model_and_optimizer(6)
    mgr.save(1, [model], opt, {"step": 1})
    mgr.save(2, [model], opt, {"step": 2})
    manifest = tmp_path / step_name(2) / MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:40])
    assert mgr.resume([model], opt).step == 1
    assert any(f"checkpoint {manifest.parent} refused: {manifest}: unreadable manifest" in m for m in logs), logs
    assert (manifest.parent / REFUSED).is_file()


def test_missing_file_and_every_checkpoint_refused_is_an_error(tmp_path):
    mgr, _ = _manager(tmp_path)
    model, opt = _model_and_optimizer(2)
    mgr.save(1, [model], opt, {"step": 1})
    (tmp_path / step_name(1) / "extra_rank0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .* not starting over from step 0 silently"):
        mgr.resume([model], opt)
    assert mgr.verify(str(tmp_path / step_name(1))).endswith("extra_rank0.pt: missing (the manifest lists it "
                                                             f"with {_size_in_manifest(tmp_path)} bytes)")


def _size_in_manifest(tmp_path) -> int:
    return json.loads((tmp_path / step_name(1) / MANIFEST).read_text())["files"]["extra_rank0.pt"]["size"]


def test_save_failure_is_loud_marks_nothing_and_next_save_succeeds(tmp_path, monkeypatch):
    mgr, logs = _manager(tmp_path, retry=RetryPolicy(attempts=2, base_s=0.0))
    model, opt = _model_and_optimizer(3)
    mgr.save(1, [model], opt, {"step": 1})
    real = Storage.write_bytes

    def flaky(self, path, data):
        raise ConnectionResetError("storage went away")

    monkeypatch.setattr(Storage, "write_bytes", flaky)
    mgr.save(2, [model], opt, {"step": 2})
    assert mgr.failed_saves == 1 and mgr.latest().endswith(step_name(1))
    assert any(m.startswith("ERROR: checkpoint of step 2 NOT saved") and "storage went away" in m for m in logs)
    assert any("retry 1/1" in m for m in logs)  # the whole write was retried once before giving up
    monkeypatch.setattr(Storage, "write_bytes", real)
    mgr.save(3, [model], opt, {"step": 3})
    assert mgr.latest().endswith(step_name(3)) and mgr.failed_saves == 1


def test_retry_backs_off_on_transient_errors_and_not_on_permanent_ones(caplog):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("slow down")
        return "ok"

    assert retry(flaky, "put x", RetryPolicy(attempts=3, base_s=0.0)) == "ok" and len(calls) == 3
    assert "retry 2/2" in caplog.text
    calls.clear()
    with pytest.raises(StorageError, match="put y: PermissionError"):
        retry(lambda: calls.append(1) or (_ for _ in ()).throw(PermissionError("denied")), "put y", RetryPolicy())
    assert len(calls) == 1
    with pytest.raises(StorageError, match="failed after 2 attempts: TimeoutError"):
        retry(lambda: (_ for _ in ()).throw(TimeoutError("t")), "put z", RetryPolicy(attempts=2, base_s=0.0))


def test_bad_checkpoint_dir_and_fault_spec_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"checkpoint.dir='gs://b/x': allowed"):
        Storage("gs://b/x")
    from paratrain.train.faults import FaultInjector

    FaultInjector().point("after_step", 1, 0)  # inert by default
    assert FaultInjector.from_env({}).kills == []
    with pytest.raises(ValueError, match="PARATRAIN_FAULT_KILL='after_stp:3'"):
        FaultInjector.from_env({"PARATRAIN_FAULT_KILL": "after_stp:3"})
    with pytest.raises(ValueError, match=r"'after_step:3,save_shards:x': step, rank and attempt must be integers"):
        FaultInjector.from_env({"PARATRAIN_FAULT_KILL": "after_step:3,save_shards:x"})
    with pytest.raises(ValueError, match=r"fault hooks at \['after_stp'\]: allowed points"):
        FaultInjector(hooks={"after_stp": []})
    assert FaultInjector.from_env({"PARATRAIN_FAULT_KILL": "after_step:3", "TORCHELASTIC_RESTART_COUNT": "1"}).attempt == 1


def test_fault_kills_select_point_step_rank_and_torchrun_attempt():
    from paratrain.train.faults import Kill, parse_kills

    kills = parse_kills("after_step:3:1, save_shards:4:1:1,save_written:6")
    assert kills == [Kill("after_step", 3, 1, 0), Kill("save_shards", 4, 1, 1), Kill("save_written", 6, None, 0)]
    first, second, every_rank = kills
    assert first.matches("after_step", 3, 1, attempt=0)
    assert not first.matches("after_step", 3, 1, attempt=1)  # the restarted job gets past it
    assert not first.matches("after_step", 3, 0, attempt=0) and not first.matches("after_step", 4, 1, attempt=0)
    assert second.matches("save_shards", 4, 1, attempt=1) and not second.matches("save_shards", 4, 1, attempt=0)
    assert every_rank.matches("save_written", 6, 5, attempt=0) and not every_rank.matches("save_shards", 6, 5, 0)


# ---- real SIGKILLs in subprocesses ------------------------------------------------------------------------
def _cli_env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("PARATRAIN_FAULT_KILL", None) if "PARATRAIN_FAULT_KILL" not in extra else None
    return env


def _subprocess_train(cmd: list[str], env: dict, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """`python -m paratrain ...` in a process of its own, forked warm from the session's fork server
    (tests/torchrun_fork.py python_m_forked: ~4 CPU-s of imports less than a new interpreter; the plain
    `python -m paratrain` start is run by the torchrun workers of test_context_parallel_torchrun.py)."""
    import torchrun_fork

    return torchrun_fork.python_m_forked(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)


def test_sigkill_during_checkpoint_write_keeps_previous_and_discards_partial(reference, tmp_path, capsys):
    args = train_args(tmp_path, reference["data"], "h")
    cmd = [sys.executable, "-m", "paratrain", *args, "--summary-json", str(tmp_path / "h.json")]
    killed = _subprocess_train(cmd, _cli_env(PARATRAIN_FAULT_KILL="save_written:6"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    ckpt = tmp_path / "h" / "checkpoints"
    partial = ckpt / step_name(6)
    assert (partial / "__0_0.distcp").is_file() and not (partial / MANIFEST).exists()  # killed mid-save

    # the restart in this process (only the kill needs a process of its own; a new one costs ~4 CPU-s of imports)
    capsys.readouterr()
    assert main([*args, "--summary-json", str(tmp_path / "h.json")]) == 0
    err = capsys.readouterr().err
    # Its DCP shards were complete (killed just before the manifest): kept in quarantine, not deleted.
    assert f"moved {partial} to {ckpt}/quarantine/{step_name(6)}-" in err and "at step 3" in err
    assert [p.name.split("-")[0] for p in (ckpt / "quarantine").iterdir()] == [step_name(6)]
    summary = json.loads((tmp_path / "h.json").read_text())
    assert summary["losses"] == reference["summary"]["losses"][EVERY:]
    assert json.loads((partial / MANIFEST).read_text())["step"] == 6  # re-saved, complete this time


def test_checkpoint_list_and_verify_commands(reference, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], ckpt)
    (ckpt / step_name(7)).mkdir()
    assert main(["checkpoint", "list", str(ckpt), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [(3, "complete"), (6, "complete"), (7, "interrupted")]
    assert rows[0]["layout"] == {"pp": 1, "dp": 1, "cp": 1, "tp": 1} and rows[0]["bytes"] > 1e6
    assert rows[0]["format"] == 2
    assert main(["checkpoint", "verify", str(ckpt)]) == 0
    assert capsys.readouterr().out.startswith(f"{ckpt / step_name(6)}: OK")
    _damage(ckpt / step_name(3) / "extra_rank0.pt", "corrupt")
    assert main(["checkpoint", "verify", str(ckpt / step_name(3))]) == 1
    assert f"REFUSED: {ckpt / step_name(3)}/extra_rank0.pt: sha256" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(tmp_path / "nothing")]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
