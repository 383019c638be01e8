"""Two network hosts on one machine: Linux network namespaces joined by a veth pair.

Each host is a network namespace with its own loopback and one end of a veth pair carrying an address in a
private /24 (10.200.<x>.1 and .2). Processes started with `Host.popen` run inside the namespace (`ip netns
exec`), so they see only that host's interfaces: a torchrun started there must advertise the veth address
(`--local-addr`) and gloo must bind to the veth interface (GLOO_SOCKET_IFNAME), exactly as on two real nodes.

The file system is shared (like a cluster's shared file system for checkpoints and data). Needs root and
iproute2 (`ip`); `unavailable_reason()` says why not, for a clear pytest skip.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str | None:
    """None when network namespaces can be made here, else why not (for pytest.skip)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the tests as root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed: apt-get install iproute2"
    probe = f"ptprobe{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One namespace = one network host."""

    netns: str
    ifname: str
    addr: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def popen(self, cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start `cmd` on this host (its own session, so the host can be killed as a whole)."""
        proc = subprocess.Popen(self.exec_prefix() + cmd, env=env, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def addresses(self) -> set[str]:
        """Every IPv4 address configured in this host's namespace (to check it has only its own)."""
        out = _ip("-n", self.netns, "-o", "-4", "addr", "show", check=False).stdout.split()
        return {out[i + 1].split("/")[0] for i, word in enumerate(out) if word == "inet"}

    def pids(self) -> list[int]:
        """Every process living in this host's namespace (agents and the workers they spawned)."""
        out = _ip("netns", "pids", self.netns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def kill_all(self, sig: int = signal.SIGKILL) -> int:
        """Kill every process of this host, as a node failure would; returns how many were signalled."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        return len(pids)


class TwoHosts:
    """Create with `TwoHosts.create()`, always `destroy()` (idempotent; also registered with atexit)."""

    def __init__(self, hosts: list[Host]):
        self.hosts = hosts
        self._destroyed = False
        atexit.register(self.destroy)

    @classmethod
    def create(cls, subnet_octet: int | None = None) -> TwoHosts:
        tag = secrets.token_hex(3)  # unique per run: parallel test runs never share a namespace
        octet = subnet_octet if subnet_octet is not None else 1 + secrets.randbelow(250)
        hosts = [Host(f"pt{tag}{side}", f"ve{tag}{side}", f"10.200.{octet}.{i + 1}") for i, side in enumerate("ab")]
        made = cls(hosts)
        try:
            for h in hosts:
                _ip("netns", "add", h.netns)
            a, b = hosts
            _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
            for h in hosts:
                _ip("link", "set", h.ifname, "netns", h.netns)
                _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
                _ip("-n", h.netns, "link", "set", h.ifname, "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")  # TCPStore/gloo also talk over loopback
        except BaseException:
            made.destroy()
            raise
        return made

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        for h in self.hosts:
            h.kill_all()
        for h in self.hosts:
            for _ in range(20):  # a namespace with a dying process may refuse deletion for a moment
                if _ip("netns", "del", h.netns, check=False).returncode == 0 or not self.exists(h):
                    break
                time.sleep(0.1)

    @staticmethod
    def exists(host: Host) -> bool:
        return host.netns in _ip("netns", "list", check=False).stdout.split()
