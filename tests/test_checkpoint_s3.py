"""Checkpoints on S3: an S3-compatible server (moto) that the test starts on 127.0.0.1; endpoint and credentials
reach paratrain the usual AWS ways (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), as they would for AWS S3."""

from __future__ import annotations

import importlib.util
import json
import socket

import pytest
import test_checkpoint
from test_checkpoint import EVERY, run_train, train_args

from paratrain.cli import main
from paratrain.train.checkpoint import MANIFEST, step_name
from paratrain.train.faults import FaultInjector
from paratrain.train.storage import RetryPolicy, Storage, StorageError

# Skipped without moto, found without importing it: the pool's ranks import this module for _rank_main, which
# needs no S3 server, and importing moto.server cost each rank ~0.6 CPU-s; this process imports it in S3Server.
# (find_spec of "moto.server" would import moto itself, ~0.3 CPU-s: moto and its server's flask instead)
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("moto", "flask")),
                                reason="moto[server] not installed")
BUCKET = "paratrain-ckpt"
reference = test_checkpoint.reference  # the same uninterrupted local run, as a fixture of this module


class S3Server:
    """moto in this process; stop() takes the endpoint down (connections refused), start() brings it back with
    the objects it held (moto keeps them in process memory)."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None

    def start(self, *_):
        from moto import server as moto_server

        self._server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self, *_):
        self._server.stop()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server()
    server.start()
    mp = pytest.MonkeyPatch()
    for key, value in {"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}.items():
        mp.setenv(key, value)
    mp.delenv("AWS_PROFILE", raising=False)
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    yield server
    mp.undo()
    server.stop()


def test_s3_save_and_resume_bitwise(s3, reference, tmp_path, capsys):
    url = f"s3://{BUCKET}/resume"
    full = run_train(tmp_path, reference["data"], "a", f'checkpoint.dir="{url}"')
    assert full["losses"] == reference["summary"]["losses"]
    st = Storage(url)
    assert sorted(st.listdir(url)) == [step_name(3), step_name(6)]
    assert MANIFEST in st.listdir(st.join(step_name(6)))
    resumed = run_train(tmp_path, reference["data"], "b", resume_from=f"{url}/{step_name(3)}")
    assert resumed["losses"] == reference["summary"]["losses"][EVERY:]
    # Automatic resume from the bucket: newest complete one is step 6, so nothing is left to train; the run
    # says so in one line and writes no summary of a run that did not run.
    capsys.readouterr()
    assert main([*train_args(tmp_path, reference["data"], "c", f'checkpoint.dir="{url}"', "train.steps=6"),
                 "--summary-json", str(tmp_path / "c.json")]) == 0
    assert not (tmp_path / "c.json").exists()
    err = capsys.readouterr().err
    assert f"resumed from {url}/{step_name(6)}" in err
    assert f"nothing left to train: the checkpoint is at step 6, train.steps=6 (a finished run in {url})" in err


def test_s3_outage_during_saves_fails_loudly_and_training_continues(s3, reference, tmp_path, capsys, caplog,
                                                                   monkeypatch):
    """Server stopped (1) before the write of step 2, (2) after the shards of step 4 but before its commit;
    back after the next step each time. Saves every 2 steps; steps 6 commits."""
    url = f"s3://{BUCKET}/outage"
    hooks = FaultInjector(hooks={"save_begin": [lambda step, rank: step == 2 and s3.stop()],
                                 "save_written": [lambda step, rank: step == 4 and s3.stop()],
                                 "after_step": [lambda step, rank: step in (3, 5) and s3.start()]})
    got = run_train(tmp_path, reference["data"], "d", f'checkpoint.dir="{url}"', "checkpoint.interval=2",
                    "checkpoint.retries=2", "checkpoint.retry_base_s=0.05", faults=hooks)
    assert got["losses"] == reference["summary"]["losses"]  # training never noticed
    assert got["failed_checkpoint_saves"] == 2
    out = capsys.readouterr().err
    lines = {step: next(ln for ln in out.splitlines() if ln.startswith(f"ERROR: checkpoint of step {step} NOT saved"))
             for step in (2, 4)}
    assert "EndpointConnectionError" in lines[2] and "retry 1/1 in" in caplog.text  # backoff was logged
    assert f"write {url}/{step_name(4)}/MANIFEST.json failed after 2 attempts" in lines[4]
    assert "latest complete: unknown, storage unreachable" in lines[2] and "checkpoint step 6 committed" in out
    st = Storage(url)
    # Step 4's shards were written without a commit; pruned once step 6 committed. Only step 6 is a checkpoint.
    assert sorted(st.listdir(url)) == [step_name(6)]
    assert got["checkpoint"] == f"{url}/{step_name(6)}"


def test_s3_server_lost_mid_save_and_back_during_the_backoff_commits_after_retries(s3, reference, tmp_path,
                                                                                caplog, monkeypatch):
    """The server stops while step 2 is being saved (the shards are written, this rank's checksums not yet read
    back) and comes back during the first backoff wait: the retried storage operations succeed against the real
    endpoint, step 2 commits, nothing failed, and it resumes bitwise."""
    url = f"s3://{BUCKET}/flaky"
    hooks = FaultInjector(hooks={"save_shards": [lambda step, rank: step == 2 and s3.stop()]})
    real_delay, restarts = RetryPolicy.delay_s, []

    def back_during_backoff(self, attempt):
        if not restarts:  # the first backoff after the outage: storage comes back while we wait
            restarts.append(attempt)
            s3.start()
        return real_delay(self, attempt)

    monkeypatch.setattr(RetryPolicy, "delay_s", back_during_backoff)
    got = run_train(tmp_path, reference["data"], "f", f'checkpoint.dir="{url}"', "checkpoint.interval=2",
                    "checkpoint.retries=3", "checkpoint.retry_base_s=0.05", faults=hooks)
    assert restarts == [0]  # the outage was seen and retried
    assert "EndpointConnectionError" in caplog.text and "retry 1/2 in" in caplog.text
    assert got["failed_checkpoint_saves"] == 0 and got["losses"] == reference["summary"]["losses"]
    st = Storage(url)
    assert sorted(st.listdir(url)) == [step_name(2), step_name(4), step_name(6)]
    resumed = run_train(tmp_path, reference["data"], "g", resume_from=f"{url}/{step_name(2)}")
    assert resumed["losses"] == reference["summary"]["losses"][2:]


def test_s3_missing_bucket_is_one_clear_error_before_training(s3, reference, tmp_path, capsys):
    from test_checkpoint import main, train_args

    url = "s3://no-such-bucket/run"
    assert main(train_args(tmp_path, reference["data"], "nb", f'checkpoint.dir="{url}"')) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint.dir='{url}': cannot write there" in err[0], err
    assert not (tmp_path / "nb").exists()  # nothing trained, no run folder


def test_s3_options_follow_the_aws_precedence(monkeypatch):
    from paratrain.train.storage import s3_options

    for key in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    assert s3_options()["client_kwargs"] == {} and "profile" not in s3_options()  # AWS S3, botocore's defaults
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert s3_options()["client_kwargs"] == {"endpoint_url": "http://generic:1", "region_name": "eu-west-1"}
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:2")  # the service-specific variable wins
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    monkeypatch.setenv("AWS_PROFILE", "training")
    opts = s3_options()
    assert opts["client_kwargs"] == {"endpoint_url": "http://s3-only:2", "region_name": "us-west-2"}
    assert opts["profile"] == "training" and opts["use_listings_cache"] is False


def test_s3_credentials_from_a_profile_file(s3, tmp_path, monkeypatch):
    """No key in the environment: botocore must find the credentials through AWS_PROFILE in a shared credentials
    file (it raises NoCredentialsError otherwise), the endpoint through AWS_ENDPOINT_URL_S3 and the region
    through the profile's config."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "credentials").write_text("[ci]\naws_access_key_id = from-file\naws_secret_access_key = x\n")
    (tmp_path / "config").write_text("[profile ci]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "ci")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.url)
    st = Storage(f"s3://{BUCKET}/profile")
    st.write_bytes(st.join("hello.txt"), b"hi")
    assert st.listdir(st.root) == {"hello.txt": 2} and st.read_bytes(st.join("hello.txt")) == b"hi"
    st.remove_tree(st.root)

    # No credentials anywhere: a configuration error, reported at once (no retries, no backoff).
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup on this machine
    monkeypatch.delenv("AWS_PROFILE")
    with pytest.raises(StorageError, match=r"^write s3://\S+/hello.txt: NoCredentialsError"):
        Storage(f"s3://{BUCKET}/profile", RetryPolicy(attempts=4, base_s=30.0)).write_bytes(st.join("hello.txt"), b"")


def _rank_main(env: dict, args: list[str]) -> int:
    import os

    from paratrain.cli import main

    os.environ.update(env)  # the pool's ranks may have been forked before this module set the AWS variables
    return main(args)


def test_s3_two_ranks_async_save_then_resume_in_one_process(s3, reference, tmp_path, dist_run):
    import os

    from test_checkpoint import train_args

    url = f"s3://{BUCKET}/dp2"
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
    args = train_args(tmp_path, reference["data"], "dp2", f'checkpoint.dir="{url}"', "checkpoint.async_save=true",
                      "parallel.dp=2", 'parallel.dp_kind="fsdp"') + ["--summary-json", str(tmp_path / "dp2.json")]
    assert dist_run(2, _rank_main, env, args) == [0, 0]
    dp2 = json.loads((tmp_path / "dp2.json").read_text())
    manifest = json.loads(Storage(url).read_bytes(f"{url}/{step_name(3)}/{MANIFEST}"))
    assert {"__0_0.distcp", "__1_0.distcp", "extra_rank0.pt", "extra_rank1.pt"} <= set(manifest["files"])
    single = run_train(tmp_path, reference["data"], "one", resume_from=f"{url}/{step_name(3)}")
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(single["losses"], dp2["losses"][EVERY:], strict=True))


def test_s3_run_lease_is_exclusive_and_released(s3):
    from paratrain.train.lease import LeaseHeld, RunLease

    st = Storage(f"s3://{BUCKET}/lease")
    logs: list[str] = []
    first = RunLease(st, 60, logs.append, settle_s=0.05)
    first.acquire()
    second = RunLease(st, 60, logs.append, settle_s=0.05)
    second.record["host"] = "another-node"  # a run elsewhere: its pid says nothing about ours
    with pytest.raises(LeaseHeld, match=f"checkpoint.dir='s3://{BUCKET}/lease' is in use by another run"):
        second.acquire()
    first.release()
    assert not st.exists(st.join("LEASE.json"))
    second.acquire()
    assert json.loads(st.read_bytes(st.join("LEASE.json")))["id"] == second.record["id"]
    second.release()
