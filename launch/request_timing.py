"""The server's time per request beyond the engine's first step: a real `shardserve launch` of the micro
model on a free loopback port, sequential streaming requests, client TTFT less the engine's own.

What the planner calls request_ms (perf_tables.HostModel): the HTTP request parsed, the prompt
tokenized and handed to the engine's process, the engine noticing it, and the first token's way back
as a server-sent event. Each request's first token is timed at the client; the engine's part (from a
request's first step to its first token) is what the request added to the server's own
`vllm:request_prefill_time_seconds`. One request at a time, so none waits for another's step; the
median over the requests after a warm-up."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from shardserve.planner import PlanError

STARTUP_TIMEOUT_S = 300.0
WARMUP = 2  # first requests: compiles, allocator, tokenizer caches


def measure_request_ms(device: str, num_requests: int = 16, prompt_len: int = 32) -> float:
    """Milliseconds a request's TTFT spends outside the engine's steps, at one request in flight."""
    from shardserve.runtime.host_timing import make_micro_model, random_prompts

    with tempfile.TemporaryDirectory(prefix="shardserve-request-") as folder:
        make_micro_model(folder)
        proc, url = _start(folder, device, Path(folder) / "server.log")
        try:
            outside = []
            engine_before = 0.0
            for prompt in random_prompts(32000, WARMUP + num_requests, prompt_len, 0):
                ttft = _first_token_s(url, prompt)
                engine = _histogram_sum(url, "vllm:request_prefill_time_seconds")
                outside.append(ttft - (engine - engine_before))  # this request's part outside the engine
                engine_before = engine
        finally:
            _stop(proc)
    return round(max(0.0, statistics.median(outside[WARMUP:])) * 1e3, 3)


def _start(folder: str, device: str, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "shardserve.launch", "launch", "--model", folder, "--port", str(port),
               "--device", device, "--max-model-len", "256", "--served-model-name", "calibrate",
               "--set", "enable_prefix_caching=false", "--set", f"kv_cache_memory_bytes={64 << 20}"]
    with open(log, "w") as out:  # a file, not a pipe that nothing reads while the requests run
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _is_healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            last = " | ".join(log.read_text().strip().splitlines()[-3:])
            raise PlanError(f"calibrate: the server that times a request's way (`shardserve launch` of a micro "
                            f"model on {device}) did not come up: {last}")
        time.sleep(0.25)
    return proc, url


def _is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    """Stops the server by its pid (and kills it if it does not stop)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _first_token_s(url: str, prompt: list[int]) -> float:
    """Seconds from sending a streaming completion to reading its first token's event."""
    body = json.dumps({"model": "calibrate", "prompt": prompt, "max_tokens": 2, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data: {"):
                first = time.perf_counter() - start
                response.read()  # the rest of the stream, so the request ends before the next one
                return first
    raise PlanError("calibrate: the server that times a request's way streamed no token")


def _histogram_sum(url: str, name: str) -> float:
    """The sum of a Prometheus histogram over all its label sets, from /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    sums = re.findall(rf"^{re.escape(name)}_sum(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    if not sums:
        raise PlanError(f"calibrate: the server that times a request's way has no {name} in /metrics")
    return sum(float(value) for value in sums)
