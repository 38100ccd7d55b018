"""What the tests see of processes through /proc: children by module, liveness, waiting for exits.

A process can exit between being listed and being read; each helper counts it as gone then."""

import os
import time


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent(pid: int) -> int | None:
    """The parent's pid, from /proc/PID/stat (the field after the state, past the name's last ')')."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children(pid: int, module: str, recursive: bool = False) -> list[int]:
    """The live children (every descendant when recursive) of pid whose command line names module."""
    found = []
    for child in sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == pid):
        if module.encode() in _cmdline(child):
            found.append(child)
        if recursive:
            found += children(child, module, recursive=True)
    return found


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """Waits up to seconds for every pid to exit; the ones still running."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(is_running(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if is_running(p)]
