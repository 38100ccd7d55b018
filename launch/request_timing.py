"""The server's time per request beyond the engine's first step: a real `shardserve launch` of the micro
model on a free loopback port, sequential streaming requests, client TTFT less the engine's own.

What the planner calls request_ms (perf_tables.HostModel): the HTTP request parsed, the prompt
tokenized and handed to the engine's process, the engine noticing it, and the first token's way back
as a server-sent event. Each request's first token is timed at the client; the engine's part (from a
request's first step to its first token) is what the request added to the server's own
`vllm:request_prefill_time_seconds`. One request at a time, so none waits for another's step; the
median over the requests after a warm-up.

The same server then times its API process: the CPU seconds it spends (its own, read from /proc) on bursts of
streamed requests, per request and per streamed token (HTTP, the prompt's way in; each token's detokenizing, its
event and its write). One API process serves every replica, so these bound the deployment's request rate
(perf_tables.HostModel.api_request_ms, api_token_ms)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shardserve.launch import local_server
from shardserve.planner import PlanError

STARTUP_TIMEOUT_S = 300.0
WARMUP = 2  # first requests: compiles, allocator, tokenizer caches
BURST = 96  # streamed requests a burst, for the API process's CPU time
SHORT_OUTPUT, LONG_OUTPUT = 2, 34  # tokens each request streams in the two bursts


@dataclass(frozen=True)
class ServerTiming:
    request_ms: float  # a request's TTFT outside the engine's steps, one request in flight
    api_request_ms: float  # the API process's CPU per request
    api_token_ms: float  # and per streamed token


def measure_server(device: str, num_requests: int = 16, prompt_len: int = 32) -> ServerTiming:
    """A real server of the micro model: a request's way through it, and its API process's CPU time."""
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
            prompts = random_prompts(MICRO["vocab_size"], BURST, prompt_len, 1)
            short, long = (_api_cpu_ms(url, proc.pid, prompts, n) for n in (SHORT_OUTPUT, LONG_OUTPUT))
        finally:
            local_server.stop(proc)
    per_token = max(0.0, (long - short) / (LONG_OUTPUT - SHORT_OUTPUT))
    return ServerTiming(round(max(0.0, statistics.median(outside[WARMUP:])) * 1e3, 3),
                        round(max(0.0, short - SHORT_OUTPUT * per_token), 3), round(per_token, 4))


def _api_cpu_ms(url: str, pid: int, prompts: list[list[int]], max_tokens: int) -> float:
    """The API process's CPU milliseconds per request over a burst of streamed requests, 16 in flight."""
    before = _cpu_s(pid)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda prompt: _stream(url, prompt, max_tokens), prompts))
    return (_cpu_s(pid) - before) * 1e3 / len(prompts)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process so far (/proc/<pid>/stat: fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _request(url: str, prompt: list[int], max_tokens: int) -> urllib.request.Request:
    body = json.dumps({"model": "calibrate", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    return urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})


def _stream(url: str, prompt: list[int], max_tokens: int) -> None:
    with urllib.request.urlopen(_request(url, prompt, max_tokens), timeout=120) as response:
        response.read()


def _first_token_s(url: str, prompt: list[int]) -> float:
    """Seconds from sending a streaming completion to reading its first token's event."""
    request = _request(url, prompt, 2)
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
