"""torchrun with its workers forked from a launcher that imported torch and paratrain once.

`python -m torch.distributed.run ... -m paratrain train ...` starts every worker as a new Python process that
imports torch and paratrain (~3-4.5 CPU-s each before any work: a job restarted twice on 4 ranks pays it 12 times).
`torchrun_cmd` runs the same torchrun command line (its elastic agent, rendezvous, restarts and failure reports)
with torchrun's own `--run-path --start-method fork`: the agent forks each worker, which runs
tests/torchrun_worker.py (`paratrain ARGS`). The agent's process imports paratrain before torchrun's main, so
the forked workers start warm. The CLI path without fork (`-m paratrain`) stays covered by
test_context_parallel_torchrun.py and by `paratrain launch` itself in test_multinode_netns.py's shrink test;
`forked` turns the command `paratrain launch --dry-run --json` prints into this form (the netns host-kill test).
`run` goes one step further: the agent itself (torchrun's main, the same arguments) is forked from the session's
multiprocessing fork server (tests/dist_pool.py), which imported torch and paratrain once, instead of a
`python -c PRELOAD` process importing them (~3.5 CPU-s) for every job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("torchrun_worker.py")
# what `python -m torch.distributed.run` runs, after the imports every worker needs (the deterministic flag imports
# torch._inductor: 0.7 CPU-s per process)
PRELOAD = ("import sys, torch._inductor.config, paratrain.cli, paratrain.train.loop; "
           "from torch.distributed.run import main; sys.argv[0] = 'torchrun'; main()")


def torchrun_cmd(torchrun_args: list[str], paratrain_args: list[str]) -> list[str]:
    """`torchrun TORCHRUN_ARGS -m paratrain PARATRAIN_ARGS`, its workers forked from a warm agent."""
    return [sys.executable, "-c", PRELOAD, *torchrun_args, "--run-path", "--start-method", "fork", str(WORKER),
            *paratrain_args]


def split_launch(command: list[str]) -> tuple[list[str], list[str]]:
    """(TORCHRUN_ARGS, ARGS) of `PYTHON -m torch.distributed.run TORCHRUN_ARGS -m paratrain ARGS`, the command
    `paratrain launch` execs."""
    assert command[1:3] == ["-m", "torch.distributed.run"], command
    at = next(i for i in range(3, len(command)) if command[i:i + 2] == ["-m", "paratrain"])
    return command[3:at], command[at + 2:]


class Agent:
    """A torchrun agent `start` forked from the fork server, waited for like a subprocess.Popen."""

    def __init__(self, process):
        self.process, self.pid = process, process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("torchrun", timeout)
        return self.process.exitcode


def start(torchrun_args: list[str], paratrain_args: list[str], env: dict[str, str], log_path: Path,
          cwd: Path | None = None, netns: str | None = None, append: bool = False,
          fork_workers: bool = True) -> Agent:
    """`torchrun TORCHRUN_ARGS -m paratrain PARATRAIN_ARGS` with the agent itself forked warm: from the session's
    fork server (tests/dist_pool.py, which imported torch and paratrain once), in its own session with `env`, its
    stdout and stderr into `log_path` (appended to with `append`), inside the network namespace `netns` if given
    (as `ip netns exec` puts it: setns); its workers forked from it as in `torchrun_cmd`. Saves the ~3.5 CPU-s a
    `python -c PRELOAD` agent spends importing. fork_workers=False: the agent starts its workers as torchrun
    does by default, each a new `python -m paratrain` process (the README's `torchrun ... -m paratrain` path)."""
    import dist_pool

    argv = [*torchrun_args, "--run-path", "--start-method", "fork", str(WORKER), *paratrain_args] if fork_workers \
        else [*torchrun_args, "-m", "paratrain", *paratrain_args]
    agent = dist_pool.forkserver().Process(target=_agent, args=(argv, dict(env), str(log_path), cwd, netns, append))
    agent.start()
    return Agent(agent)


def run(torchrun_args: list[str], paratrain_args: list[str], env: dict[str, str], log_path: Path, timeout_s: float,
        cwd: Path | None = None, fork_workers: bool = True) -> tuple[int | str, str]:
    """`start`, then wait: (exit code, or "timeout after N s" once the whole process group was killed; the log)."""
    agent = start(torchrun_args, paratrain_args, env, log_path, cwd, fork_workers=fork_workers)
    agent.process.join(timeout_s)
    code: int | str | None = agent.returncode
    if code is None:  # still running: kill torchrun and its workers (killing the agent alone would orphan them)
        os.killpg(agent.pid, signal.SIGKILL)
        agent.process.join()
        code = f"timeout after {timeout_s} s"
    return code, Path(log_path).read_text(errors="replace")


def _agent(argv: list[str], env: dict[str, str], log_path: str, cwd: Path | None, netns: str | None,
           append: bool) -> None:
    """In a process forked by the fork server: become torchrun (`python -m torch.distributed.run ARGV`)."""
    os.setsid()
    if netns is not None:
        _enter_netns(netns)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ["torchrun", *argv]
    from torch.distributed.run import main

    main(argv)


def _enter_netns(name: str) -> None:
    """setns(2) into the network namespace `ip netns add NAME` made (os.setns needs Python 3.12)."""
    import ctypes

    clone_newnet = 0x40000000
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def python_m_forked(argv: list[str], env: dict[str, str] | None = None, capture_output: bool = False,
                    text: bool = False, cwd: Path | str | None = None,
                    timeout: float | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, "-m", MODULE, *ARGS], env=...)` with the process forked warm from the
    session's fork server (which imported torch and paratrain once) instead of a new interpreter (~4 CPU-s of
    imports each): MODULE runs as __main__ (runpy), with `env` as its whole environment and ARGS as sys.argv[1:],
    its stdout and stderr captured into files, in `cwd`; the return code is -N for a process killed by signal N,
    as subprocess gives it. For product code that starts its own `python -m` workers (paratrain verify) and for
    a run that must die in a process of its own (a SIGKILL); the interpreter's start is what it does not cover."""
    import tempfile

    import dist_pool

    assert argv[:2] == [sys.executable, "-m"], argv
    with tempfile.TemporaryDirectory(prefix="paratrain-fork-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = dist_pool.forkserver().Process(target=_python_m, args=(argv[2], argv[3:], dict(env or os.environ),
                                                                      str(out), str(err), cwd))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(argv, timeout, out.read_bytes(), err.read_bytes())
        stdout, stderr = out.read_bytes(), err.read_bytes()
    if text:
        stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    return subprocess.CompletedProcess(argv, proc.exitcode, stdout if capture_output else None,
                                       stderr if capture_output else None)


def _python_m(module: str, args: list[str], env: dict[str, str], out: str, err: str, cwd) -> None:
    import runpy

    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
