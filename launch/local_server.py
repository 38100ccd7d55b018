"""A `shardserve launch` in a process of its own on a free loopback port, for measurements that need a real
server (calibrate's request timing, bench/gpu_serve.py, bench/multiturn.py): started, waited for,
stopped by its pid."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from shardserve.planner import PlanError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def start(args: list[str], log: Path, what: str, timeout_s: float, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`shardserve launch *args --port <a free one>`, its output in `log` (a file: a pipe nothing reads
    would fill), once /health answers: (the process, its URL). One that exits or stays unhealthy for
    timeout_s is stopped, and a PlanError says `what` did not come up, with its log's last lines."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shardserve.launch", "launch", *args, "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while not is_healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            last = " | ".join(log.read_text().strip().splitlines()[-3:])
            raise PlanError(f"{what} did not come up: {last}")
        time.sleep(0.25)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """Stops the server by its pid (and kills it if it does not stop within a minute)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
