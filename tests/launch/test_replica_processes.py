"""data_parallel_size > 1: each replica in a process of its own behind the one server."""

import asyncio
import contextlib
import concurrent.futures
import json
import os
import signal
import threading
import time

import pytest

from tests.launch.conftest import http, kill_if_running, start_server, stop_server
from tests.processes import children, wait_gone

pytestmark = pytest.mark.slow  # every test here starts a process

DP2 = ("--profile", "demo", "--set", "hardware=2xcpu", "--set", "data_parallel_size=2",
       "--set", "kv_cache_memory_bytes=33554432", "--set", "enable_prompt_tokens_details=true")


def _burst(url: str, num_requests: int) -> list:
    import openai

    async def burst():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        results = await asyncio.gather(*(client.completions.create(
            model="shardserve-demo", prompt=f"Item {i}", max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True}) for i in range(num_requests)))
        await client.close()
        return results

    return asyncio.run(burst())


def _running(url: str) -> list[float]:
    metrics = http(f"{url}/metrics")[1]
    return [float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("vllm:num_requests_running{")]


def _wait_running(url: str, done) -> list[float]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not done(_running(url)):
        time.sleep(0.1)
    return _running(url)


def _check_the_load_is_shared(url: str) -> None:
    results = _burst(url, 8)
    assert all(r.usage.completion_tokens == 8 for r in results)
    metrics = http(f"{url}/metrics")[1]
    served = [line for line in metrics.splitlines()
              if line.startswith("vllm:e2e_request_latency_seconds_count")]
    assert len(served) == 2 and all(float(line.split()[-1]) > 0 for line in served), served
    assert _wait_running(url, lambda running: running == [0.0, 0.0]) == [0.0, 0.0]


def _check_greedy_text_is_the_same_from_either_replica(url: str) -> None:
    request = {"model": "shardserve-demo", "prompt": "The function returns", "max_tokens": 8,
               "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two at once: one on each replica
        answers = list(pool.map(lambda _: http(f"{url}/v1/completions", request), range(2)))
    answers.append(http(f"{url}/v1/completions", request))
    assert all(code == 200 for code, _ in answers), answers
    assert len({json.loads(body)["choices"][0]["text"] for _, body in answers}) == 1, answers


def _check_a_dropped_stream_is_aborted(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="shardserve-demo", prompt="Once", max_tokens=1000,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    assert sum(_wait_running(url, lambda running: sum(running) > 0)) == 1  # one replica decodes it
    stream.close()  # the client goes away: its replica must free the request at once
    assert _wait_running(url, lambda running: sum(running) == 0) == [0.0, 0.0]


def _check_a_conversation_goes_back_to_its_cache(url: str) -> None:
    """The next turn goes to the replica holding the conversation's prefix although the other one is idle
    (least-loaded routing would send it there, and it would compute the whole prompt again)."""
    import openai

    first = {"model": "shardserve-demo", "max_tokens": 4, "temperature": 0,
             "prompt": " ".join(f"Step {i}: add the next number to the sum." for i in range(12))}
    code, body = http(f"{url}/v1/completions", first)
    assert code == 200, body
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    busy = client.completions.create(model="shardserve-demo", prompt="Once", max_tokens=1000, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
    next(iter(busy))  # both replicas were idle: it runs on replica 0, where the first turn ran
    try:
        second = first | {"prompt": first["prompt"] + json.loads(body)["choices"][0]["text"] + " Then stop."}
        code, answer = http(f"{url}/v1/completions", second)
        assert code == 200, answer
        assert json.loads(answer)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, answer
    finally:
        busy.close()
    routed = [line for line in http(f"{url}/metrics")[1].splitlines()
              if line.startswith("shardserve_routed_prompts_total{") and 'reason="prefix"' in line]
    assert routed and float(routed[0].split()[-1]) >= 1, routed
    assert _wait_running(url, lambda running: sum(running) == 0) == [0.0, 0.0]


def test_replicas_in_their_own_processes_serve_and_stop_cleanly():
    proc, url = start_server(*DP2)
    replicas = children(proc.pid, "shardserve.runtime.core.loop")
    try:
        assert len(replicas) == 2, replicas
        # each replica's engine runs in its own process: no rank and no engine in the server's
        assert not children(proc.pid, "shardserve.runtime.distributed.worker_process")
        _check_the_load_is_shared(url)
        _check_greedy_text_is_the_same_from_either_replica(url)
        _check_a_dropped_stream_is_aborted(url)
        _check_a_conversation_goes_back_to_its_cache(url)
    finally:
        code, out = stop_server(proc)
    assert code == 0, out
    assert "data_parallel_size=2" in out and "replica 1 up in process" in out
    assert "shut down cleanly" in out
    assert wait_gone(replicas, 15) == [], "a replica outlived the server"


def _stream_text(url: str, results: list, max_tokens: int) -> None:
    body = {"model": "shardserve-demo", "prompt": f"Story {len(results)}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    results.append(None)
    index = len(results) - 1
    results[index] = http(f"{url}/v1/completions", body, timeout=120)


def _until(check, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    return check()


def test_a_killed_replica_fails_only_its_requests_and_is_restarted():
    """Issue 40: killing one replica of two ended the server and cut the other's streams. Now its own stream
    ends with an error event and [DONE], the other's runs to its end, /health says degraded, new requests
    go to the live replica, and the dead one is back in a new process."""
    proc, url = start_server(*DP2)
    replicas = children(proc.pid, "shardserve.runtime.core.loop")
    streams: list = []
    try:
        assert len(replicas) == 2, replicas
        threads = [threading.Thread(target=_stream_text, args=(url, streams, 600)) for _ in range(2)]
        for thread in threads:
            thread.start()
        assert _wait_running(url, lambda running: running == [1.0, 1.0]) == [1.0, 1.0]
        os.kill(replicas[1], signal.SIGKILL)
        health = _until(lambda: json.loads(http(f"{url}/health")[1] or "{}").get("replicas_down"), 15)
        assert health and "1" in health, health
        status, text = http(f"{url}/v1/completions", {"model": "shardserve-demo", "prompt": "hi", "max_tokens": 4})
        assert status == 200, text
        for thread in threads:
            thread.join(120)
        back = _until(lambda: http(f"{url}/health")[1] == '{"status":"ok"}', 90)
        new = children(proc.pid, "shardserve.runtime.core.loop")
        if back:
            _check_the_load_is_shared(url)
    finally:
        code, out = stop_server(proc)
    ended = sorted(streams, key=lambda answer: '"error"' in answer[1])
    assert [status for status, _ in ended] == [200, 200], ended
    assert '"finish_reason":"length"' in ended[0][1] and '"error"' not in ended[0][1]
    assert '"error"' in ended[1][1] and ended[1][1].rstrip().endswith("data: [DONE]"), ended[1][1][-400:]
    assert back, out[-2000:]
    assert len(new) == 2 and replicas[0] in new and replicas[1] not in new, (replicas, new)
    assert code == 0, out
    assert "replica 1 died" in out and "replica 1 is back" in out


def test_a_replica_that_cannot_start_fails_the_launch(tmp_path):
    from shardserve.launch.demo import DEMO_MODEL_DIR
    from shardserve.runtime.core.client import start_replicas
    from shardserve.runtime import EngineArgs

    with pytest.raises(ValueError, match="max_model_len"):
        start_replicas(EngineArgs(str(DEMO_MODEL_DIR), device="cpu", max_model_len=10**7), 2)


def test_a_stopped_replica_is_reported_dead_within_seconds():
    """Issue 40: a SIGSTOPped engine reported healthy for 58 s. Its heartbeat comes every second, whatever
    its step does: 15 s without one is death."""
    proc, url = start_server("--profile", "demo")
    (replica,) = children(proc.pid, "shardserve.runtime.core.loop")
    try:
        os.kill(replica, signal.SIGSTOP)
        stopped = time.monotonic()
        assert _until(lambda: http(f"{url}/health", timeout=2)[0] == 503 or proc.poll() is not None, 30)
        seen = time.monotonic() - stopped
        out = proc.communicate(timeout=60)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(replica, signal.SIGCONT)
        kill_if_running(proc)
    assert seen < 20, f"reported after {seen:.1f} s"
    assert proc.returncode == 1 and "has sent nothing for 15 s" in out, out[-1500:]
    assert wait_gone([replica], 15) == [], "the stopped replica outlived the server"
