"""How long a 1-token request from one client takes while others abuse the server (issue 40's goal: within 1 s at
the 99th percentile). Starts the demo with two replicas on this machine, then runs, all at once: a client fanning
out (4 prompts x n=8 of 200 tokens, again and again), distinct JSON schemas of 700 optional fields (slow to
compile), 15 MB bodies (token ids over the context; a chat body with 2.5 million wrong items), streams read
slowly, 200 connections that never finish their headers, and, half-way, one replica killed. The probe client sends
a 1-token completion every 0.25 s and its latencies are printed as percentiles, beside the same probe on the idle
server.

    .venv/bin/python bench/abuse_probe.py [--seconds 60]"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil


def post(url: str, body: dict, timeout: float = 120.0, raw: bytes | None = None) -> int:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return 0


def start_server(replicas: int, log) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "shardserve.launch", "launch", "--profile", "demo",
                             "--port", str(port), "--data-parallel-size", str(replicas), "--hardware", f"{replicas}xcpu"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("the server did not start (its log: abuse_probe.log)")


def probe(url: str, seconds: float) -> list[float]:
    """1-token completions from the client 'probe', one every 0.25 s: their latencies (a failure counts as inf)."""
    latencies, start = [], time.monotonic()
    deadline = start + seconds
    while time.monotonic() < deadline:
        began = time.monotonic()
        status = post(f"{url}/v1/completions", {"prompt": "The", "max_tokens": 1, "user": "probe"}, timeout=60)
        latencies.append(time.monotonic() - began if status == 200 else float("inf"))
        if latencies[-1] > 1.0:
            print(f"  probe at {began - start:.1f} s took {latencies[-1]:.2f} s (status {status})", flush=True)
        time.sleep(max(0.0, 0.25 - (time.monotonic() - began)))
    return latencies


ABUSES = ("fan", "schema", "big", "slow", "half_open", "kill")


def abusers(url: str, done: threading.Event, names: list[str]) -> list[threading.Thread]:
    def again(work) -> threading.Thread:
        def loop():
            k = 0
            while not done.is_set():
                work(k)
                k += 1
        return threading.Thread(target=loop, daemon=True)

    big_ids = json.dumps({"prompt": list(range(1000, 3500)) * 1000, "max_tokens": 2, "user": "big"}).encode()
    big_chat = json.dumps({"messages": [{"role": "user", "content": list(range(2_500_000))}], "user": "big"}).encode()
    work = {
        "fan": lambda k: post(f"{url}/v1/completions", {"prompt": ["The"] * 4, "n": 8, "max_tokens": 200,
                                                 "ignore_eos": True, "user": "fan"}),
        "schema": lambda k: post(f"{url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "user": "schema",
            "guided_json": {"type": "object", "properties": {f"f{k}_{i}": {"type": "string"} for i in range(700)}}}),
        "big": lambda k: post(f"{url}/v1/completions", {}, raw=big_ids if k % 2 else big_chat),
        "slow": lambda k: slow_reader(url),
    }
    return [again(w) for name, w in work.items() if name in names]


def slow_reader(url: str) -> None:
    """A stream of 200 tokens read a few bytes a second."""
    body = json.dumps({"prompt": "The", "max_tokens": 200, "stream": True, "ignore_eos": True, "user": "slow"})
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        for _ in range(20):
            if not sock.recv(16):
                return
            time.sleep(0.5)


def half_open(url: str, count: int) -> list[socket.socket]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sockets.append(sock)
    return sockets


def kill_a_replica(proc: subprocess.Popen) -> int | None:
    """SIGKILL one engine core (a child process running the core loop); its pid."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        if "shardserve.runtime.core.loop" in " ".join(child.cmdline()):
            os.kill(child.pid, signal.SIGKILL)
            return child.pid
    return None


def percentiles(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    cut = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else ordered * 99
    failed = sum(1 for x in ordered if x == float("inf"))
    return (f"n={len(ordered)} p50={cut[49]:.3f}s p90={cut[89]:.3f}s p99={cut[98]:.3f}s "
            f"max={ordered[-1]:.3f}s failed={failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--abuse", nargs="+", choices=ABUSES, default=list(ABUSES), help="all of them by default")
    args = parser.parse_args()
    log = open("abuse_probe.log", "w")
    proc, url = start_server(2, log)
    try:
        print("idle:   ", percentiles(probe(url, 10)), flush=True)
        done = threading.Event()
        threads = abusers(url, done, args.abuse)
        for thread in threads:
            thread.start()
        stalled = half_open(url, 200) if "half_open" in args.abuse else []
        if "kill" in args.abuse:
            threading.Timer(args.seconds / 2, lambda: print("killed replica core", kill_a_replica(proc),
                                                            flush=True)).start()
        print("abused: ", percentiles(probe(url, args.seconds)), flush=True)
        done.set()
        for sock in stalled:
            sock.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
