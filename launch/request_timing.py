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
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from shardserve.launch import local_server
from shardserve.planner import PlanError

STARTUP_TIMEOUT_S = 300.0
WARMUP = 2  # first requests: compiles, allocator, tokenizer caches


def measure_request_ms(device: str, num_requests: int = 16, prompt_len: int = 32) -> float:
    """Milliseconds a request's TTFT spends outside the engine's steps, at one request in flight."""
    from shardserve.runtime.timing.host_timing import MICRO, make_micro_model, random_prompts

    with tempfile.TemporaryDirectory(prefix="shardserve-request-") as folder:
        make_micro_model(folder)
        proc, url = local_server.start(
            ["--model", folder, "--device", device, "--max-model-len", "256", "--served-model-name", "calibrate",
             "--set", "enable_prefix_caching=false", "--set", f"kv_cache_memory_bytes={64 << 20}"],
            Path(folder) / "server.log", f"calibrate: the server that times a request's way (`shardserve launch` "
            f"of a micro model on {device})", STARTUP_TIMEOUT_S, {**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            outside = []
            engine_before = 0.0
            for prompt in random_prompts(MICRO["vocab_size"], WARMUP + num_requests, prompt_len, 0):
                ttft = _first_token_s(url, prompt)
                engine = _histogram_sum(url, "vllm:request_prefill_time_seconds")
                outside.append(ttft - (engine - engine_before))  # this request's part outside the engine
                engine_before = engine
        finally:
            local_server.stop(proc)
    return round(max(0.0, statistics.median(outside[WARMUP:])) * 1e3, 3)


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
