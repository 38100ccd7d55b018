"""Test hosts made of network namespaces joined by a veth pair: each has its own interface,
address, routes and ports, while sharing this machine's files and processes table; a booted host
also has a process table (and mounts) of its own, as a container or a machine has."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

SHARDSERVE = [sys.executable, "-m", "shardserve.launch"]
ETC_NETNS = Path("/etc/netns")  # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts
# PID 1 of a booted host: it reaps the orphans handed to it, as a machine's init does
_INIT = "import os, time\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        time.sleep(0.2)\n"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def namespaces_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"ssprobe{secrets.token_hex(3)}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    netns: str
    interface: str
    ip: str
    state_dir: Path  # its SHARDSERVE_CLUSTER_DIR
    init_pid: int | None = None  # booted: its PID 1, as this machine numbers it
    machine_pids: set[int] = field(default_factory=set)  # booted: the init and what started it
    _holder: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    def command(self, args: list[str], **env: str) -> list[str]:
        values = [f"{k}={v}" for k, v in {"SHARDSERVE_CLUSTER_DIR": str(self.state_dir),
                                          "OMP_NUM_THREADS": "1", **env}.items()]
        enter = (["nsenter", f"--target={self.init_pid}", "--pid", "--mount", "--net", f"--wd={os.getcwd()}", "--"]
                 if self.init_pid else ["ip", "netns", "exec", self.netns])
        return [*enter, "env", *values, *args]

    def boot(self, binds: dict[Path, Path] | None = None, inside: Host | None = None) -> None:
        """Give this host a process table of its own (a PID namespace with its /proc) and, in `binds`,
        folders of its own (mount point -> this host's folder), for every command run here after.
        NOTE: without it a Ray driver on one host finds the other host's raylet in the shared process
        table and attaches to it. `inside`: the table is nested in that host's, so that a process
        there can start processes here (as srun does; a process may enter only a PID namespace below
        its own); that host then sees this one's processes."""
        mounts = "".join(f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))} && "
                         for dst, src in (binds or {}).items())
        start = ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--mount-proc",
                 "bash", "-c", f"{mounts}exec {shlex.quote(sys.executable)} -c {shlex.quote(_INIT)}"]
        if inside is not None:
            start = ["nsenter", f"--target={inside.init_pid}", "--pid", "--mount", "--", *start]
        self._holder = subprocess.Popen(start, start_new_session=True)
        deadline, python = time.monotonic() + 10, os.path.realpath(sys.executable)
        while self.init_pid is None:
            assert self._holder.poll() is None and time.monotonic() < deadline, f"{self.netns} did not boot"
            time.sleep(0.05)
            for pid in self._all_pids():
                numbers, exe = _pid_numbers(pid), _exe(pid)
                if len(numbers) > 1 and numbers[-1] == 1 and exe == python:
                    self.init_pid = pid
        self.machine_pids = set(self._all_pids())

    def pid_seen_from(self, other: Host) -> int:
        """This booted host's init as `other` (the host it was booted inside) numbers it."""
        assert self.init_pid and other.init_pid
        return _pid_numbers(self.init_pid)[len(_pid_numbers(other.init_pid)) - 1]

    def run(self, args: list[str], timeout: float = 180.0, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(args, **env), capture_output=True, text=True,
                              timeout=timeout)

    def shardserve(self, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
        return self.run([*SHARDSERVE, *args], timeout=timeout)

    def popen(self, args: list[str], log: Path, **env: str) -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen(self.command(args, **env), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def _all_pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def pids(self) -> list[int]:
        """Every process run inside this host, but the booted host's own init."""
        return [pid for pid in self._all_pids() if pid not in self.machine_pids]

    def signal_all(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait_empty(self, timeout: float) -> bool:
        """True once no process is left inside this host (reaped or not), False after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.pids():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def kill_all(self) -> None:
        """SIGKILL every process inside this host, its init too (a booted host is then off), as
        deleting a pod or cutting a node's power does."""
        self.machine_pids = set()
        for _ in range(5):  # a process may be forking as it dies
            self.signal_all(signal.SIGKILL)
            if self.wait_empty(5):
                break
        else:
            raise AssertionError(f"processes left in {self.netns}: {self.pids()}")
        if self._holder is not None:
            self._holder.wait(timeout=10)
        self.init_pid, self._holder = None, None

    def watch(self, url: str, log: Path) -> subprocess.Popen:
        """Poll `url` from inside this host every 0.1 s, one status per line (0: no answer)."""
        code = ("import sys, time, urllib.request, urllib.error\n"
                "out = open(sys.argv[2], 'w', buffering=1)\n"
                "while True:\n"
                "    try:\n"
                "        status = urllib.request.urlopen(sys.argv[1], timeout=2).status\n"
                "    except urllib.error.HTTPError as e:\n"
                "        status = e.code\n"
                "    except Exception:\n"
                "        status = 0\n"
                "    out.write(f'{status}\\n')\n"
                "    time.sleep(0.1)\n")
        return subprocess.Popen(self.command([sys.executable, "-c", code, url, str(log)]),
                                start_new_session=True)

    def http(self, url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, str]:
        """(status, text) of a request made inside this host; status 0 when nothing answers."""
        code = ("import json, sys, urllib.request, urllib.error\n"
                "url, body = sys.argv[1], sys.argv[2]\n"
                "data = body.encode() if body else None\n"
                "req = urllib.request.Request(url, data=data, headers={'content-type': 'application/json'})\n"
                "try:\n"
                f"    r = urllib.request.urlopen(req, timeout={timeout}); print(r.status); print(r.read().decode())\n"
                "except urllib.error.HTTPError as e:\n"
                "    print(e.code); print(e.read().decode())\n"
                "except Exception:\n"
                "    print(0)\n")
        result = self.run([sys.executable, "-c", code, url, json.dumps(body) if body else ""],
                          timeout=timeout + 30)
        status, _, text = result.stdout.partition("\n")
        return int(status or 0), text.strip()


def _pid_numbers(pid: int) -> list[int]:
    """The process's number in its PID namespace and each one above, outermost first (NSpid)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(line for line in status if line.startswith("NSpid:"))
    except (OSError, StopIteration):
        return []
    return [int(n) for n in line.split()[1:]]


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def make_hosts(root: Path) -> tuple[Host, Host]:
    """Two namespaces with a veth pair on a random /24 (names unique, so tests can run side by side)."""
    tag = secrets.token_hex(3)
    subnet = f"10.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 1}"
    hosts = tuple(Host(f"ss{tag}{side}", f"vs{tag}{side}", f"{subnet}.{i + 1}", root / side)
                  for i, side in enumerate("ab"))
    a, b = hosts
    for host in hosts:
        _ip("netns", "add", host.netns)
    _ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
    for host in hosts:
        _ip("link", "set", host.interface, "netns", host.netns)
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", host.interface)
        _ip("-n", host.netns, "link", "set", host.interface, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        host.state_dir.mkdir(parents=True)
    return a, b


def name_hosts(names: dict[str, Host]) -> None:
    """Host names that resolve inside every host, as a cluster's DNS would: each namespace gets its
    own /etc/hosts (name -> the host's IP); delete_hosts removes them."""
    lines = "127.0.0.1 localhost\n" + "".join(f"{host.ip} {name}\n" for name, host in names.items())
    for host in {host.netns: host for host in names.values()}.values():
        (ETC_NETNS / host.netns).mkdir(parents=True, exist_ok=True)
        (ETC_NETNS / host.netns / "hosts").write_text(lines)


def delete_hosts(hosts: tuple[Host, ...]) -> None:
    for host in hosts:
        subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        shutil.rmtree(ETC_NETNS / host.netns, ignore_errors=True)
    try:
        ETC_NETNS.rmdir()  # when no other test's hosts have names there
    except OSError:
        pass


def namespace_exists(name: str) -> bool:
    return name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
