"""The ports of Ray on this host: a head port clear of Ray's own defaults and free here, and the Ray
instances already running (found by their command lines)."""

from __future__ import annotations

import socket
from pathlib import Path

DEFAULT_PORT = 6379  # Ray's own default, what users of `ray start` expect
# `ray start` defaults a head's --port must stay clear of: its workers bind anywhere in this range, and
# these services take fixed ports (the dashboard, the Ray client server, the dashboard agent)
RAY_WORKER_PORTS = range(10002, 19999 + 1)
RAY_SERVICE_PORTS = {8265: "Ray's dashboard", 10001: "the Ray client server", 52365: "Ray's dashboard agent"}


def head_port_problem(port: int) -> str | None:
    """Why a head cannot take `port` (one of Ray's default ports, or in use here), with a free choice;
    None when it can (0: any free port)."""
    if port == 0:
        return None
    clash = (f"inside Ray's worker-port range {RAY_WORKER_PORTS.start}-{RAY_WORKER_PORTS.stop - 1} (a worker "
             "may bind it first)" if port in RAY_WORKER_PORTS else
             f"the default port of {RAY_SERVICE_PORTS[port]}" if port in RAY_SERVICE_PORTS else None)
    if clash is None and is_port_free(port):
        return None
    why = clash or f"in use on this host (`ss -ltnp 'sport = :{port}'` names the process)"
    choice = free_head_port()
    other = f"--port {choice} (free here), or " if choice else ""
    return f"--port {port} is {why}: choose another, e.g. {other}--port 0 for any free port"


def is_port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no clash
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _is_head_port(port: int) -> bool:
    return port not in RAY_WORKER_PORTS and port not in RAY_SERVICE_PORTS and is_port_free(port)


def free_head_port() -> int | None:
    """Ray's default port when it is free here, else a free one the kernel hands out outside Ray's ports."""
    if _is_head_port(DEFAULT_PORT):
        return DEFAULT_PORT
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if _is_head_port(port):
            return port
    return None


def local_ray_instances() -> dict[str, int]:
    """The GCS address of each Ray instance running on this host, with one process of it: Ray's own
    processes carry --gcs-address=IP:PORT on their command line."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith(b"--gcs-address="):
                found.setdefault(arg.split(b"=", 1)[1].decode(errors="replace"), int(entry.name))
    return found
