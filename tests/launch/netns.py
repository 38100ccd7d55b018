"""Test hosts made of network namespaces joined by a veth pair: each has its own interface,
address, routes and ports, while sharing this machine's files and processes table."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SHARDSERVE = [sys.executable, "-m", "shardserve.launch"]


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

    def command(self, args: list[str], **env: str) -> list[str]:
        values = [f"{k}={v}" for k, v in {"SHARDSERVE_CLUSTER_DIR": str(self.state_dir),
                                          "OMP_NUM_THREADS": "1", **env}.items()]
        return ["ip", "netns", "exec", self.netns, "env", *values, *args]

    def run(self, args: list[str], timeout: float = 180.0, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(args, **env), capture_output=True, text=True,
                              timeout=timeout)

    def shardserve(self, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
        return self.run([*SHARDSERVE, *args], timeout=timeout)

    def popen(self, args: list[str], log: Path, **env: str) -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen(self.command(args, **env), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

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


def delete_hosts(hosts: tuple[Host, ...]) -> None:
    for host in hosts:
        subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)


def namespace_exists(name: str) -> bool:
    return name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
