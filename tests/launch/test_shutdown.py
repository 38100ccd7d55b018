"""SIGTERM drains the server: new requests get 503, those in flight get --shutdown-timeout seconds, the
rest end cleanly (a stream with an error event and [DONE], a non-streaming request with a 503), exit 0."""

import asyncio
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.launch.conftest import MODEL, http, kill_if_running, metric, start_server

SHORT = {"model": MODEL, "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
LONG = SHORT | {"max_tokens": 1000}  # several seconds on the demo: past a 2 s timeout
RUNNING = "vllm:num_requests_running"


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def terminate(proc: subprocess.Popen) -> tuple[int, str, float]:
    """SIGTERM, then (exit code, output, seconds from the signal to the exit)."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out, time.monotonic() - sent


def sse_events(text: str) -> list[str]:
    return [event.removeprefix("data: ") for event in text.split("\n\n") if event]


@pytest.mark.slow
def test_requests_in_flight_finish_during_the_drain_and_new_ones_get_503():
    proc, url = start_server("--profile", "demo", "--shutdown-timeout", "20")
    try:
        with ThreadPoolExecutor(3) as pool:
            full = pool.submit(http, f"{url}/v1/completions", SHORT)
            streamed = pool.submit(http, f"{url}/v1/completions", SHORT | {"stream": True})
            wait_until(lambda: metric(url, RUNNING) == 2)
            ended = pool.submit(terminate, proc)
            wait_until(lambda: http(f"{url}/health")[0] == 503)  # draining: a load balancer sends no more
            status, body = http(f"{url}/v1/completions", SHORT)
            assert status == 503 and "shutting down" in body
            status, body = full.result()
            assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == SHORT["max_tokens"]
            status, text = streamed.result()
            events = sse_events(text)
            assert status == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            code, out, seconds = ended.result()
    finally:
        kill_if_running(proc)
    assert code == 0 and "Traceback" not in out, out
    assert seconds < 10, out  # it left once they were done, not at the timeout


@pytest.mark.slow
@pytest.mark.serial
def test_requests_past_the_timeout_are_ended_cleanly_and_the_server_exits_in_time():
    timeout = 2.0
    proc, url = start_server("--profile", "demo", "--shutdown-timeout", str(timeout))
    try:
        with ThreadPoolExecutor(2) as pool:
            full = pool.submit(http, f"{url}/v1/completions", LONG)
            streamed = pool.submit(http, f"{url}/v1/completions", LONG | {"stream": True})
            wait_until(lambda: metric(url, RUNNING) == 2)
            code, out, seconds = terminate(proc)
            status, body = full.result()
            assert status == 503 and "shutting down" in json.loads(body)["error"]["message"]
            status, text = streamed.result()
    finally:
        kill_if_running(proc)
    events = sse_events(text)
    assert status == 200 and json.loads(events[0])["choices"][0]["text"]  # it was streaming
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503
    assert code == 0 and "Traceback" not in out, out
    assert timeout <= seconds < timeout + 2, out


@pytest.mark.slow
def test_a_sigterm_to_the_whole_process_group_drains_too():
    """systemd stops a service by signalling every process of it: replicas and ranks leave the signal to
    the server, which drains them as before."""
    proc, url = start_server("--profile", "demo", "--data-parallel-size", "2", "--hardware", "2xcpu",
                             "--shutdown-timeout", "20", own_group=True)
    try:
        with ThreadPoolExecutor(1) as pool:
            full = pool.submit(http, f"{url}/v1/completions", SHORT)
            wait_until(lambda: metric(url, RUNNING) == 1)
            os.killpg(proc.pid, signal.SIGTERM)
            status, body = full.result()
            out, _ = proc.communicate(timeout=60)
    finally:
        kill_if_running(proc)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == SHORT["max_tokens"], body
    assert proc.returncode == 0 and "Traceback" not in out, out


def test_a_stream_ended_by_the_drain_is_counted_unavailable_not_success():
    from shardserve.launch.server.responding import streaming
    from shardserve.launch.server.metrics import ServerMetrics
    from shardserve.launch.openai_api.protocol import shutting_down
    from shardserve.launch.openai_api.response_format import error_event, sse

    async def events(end_with_error: bool):
        yield sse({"choices": [{"text": "a"}]})
        if end_with_error:
            yield error_event(shutting_down())
        yield "data: [DONE]\n\n"

    async def drain(response):
        return [event async for event in response.body_iterator]

    metrics = ServerMetrics(MODEL, lambda: [], 1024)
    for end_with_error in (True, False):
        asyncio.run(drain(streaming(events(end_with_error), metrics, None)))
    counts = {s.labels["outcome"]: s.value for m in metrics.registry.collect() if m.name == "shardserve_requests"
              for s in m.samples if s.name.endswith("_total")}
    assert counts == {"unavailable": 1.0, "success": 1.0}, counts
