"""A client that goes away, streaming or not, frees its engine request and its in-flight slot at once."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.launch.conftest import MODEL, http, metric, open_request, serving

pytestmark = pytest.mark.slow  # every test here starts a process

LIMIT = 4  # --max-queued-requests: API requests in flight before a 503
LONG = {"model": MODEL, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
RUNNING, KV = "vllm:num_requests_running", "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def server():
    yield from serving("--profile", "demo", "--max-queued-requests", str(LIMIT), "--root-path", "/llm")


def wait_for(condition, timeout: float) -> float:
    """Seconds until condition() held (polled every 50 ms), or inf after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return time.monotonic() - start
        time.sleep(0.05)
    return float("inf")


def is_idle(url: str) -> bool:
    return metric(url, RUNNING) == 0 and metric(url, KV) == 0


def test_every_api_route_counts_against_the_limit_under_any_root_path(server):
    """Issue 40: /invocations, /tokenize and every route under --root-path were not counted at all."""
    socks = [open_request(server, "/llm/v1/completions", LONG | {"stream": True}) for _ in range(LIMIT)]
    try:
        assert wait_for(lambda: metric(server, RUNNING) == LIMIT, 5) < 5
        for path, body in (("/llm/v1/completions", LONG | {"max_tokens": 1}), ("/invocations", LONG),
                           ("/llm/invocations", LONG), ("/tokenize", {"model": MODEL, "prompt": "hi"})):
            assert http(f"{server}{path}", body)[0] == 503, path
    finally:
        for sock in socks:
            sock.close()
    assert wait_for(lambda: is_idle(server), 3) < 1.0


def test_a_non_streaming_request_whose_client_times_out_is_aborted_within_a_second(server):
    # as `curl -m 1`: the client gives up after a second and closes its connection
    timed_out = threading.Thread(target=http, args=(f"{server}/v1/completions", LONG), kwargs={"timeout": 1.0})
    timed_out.start()
    assert wait_for(lambda: metric(server, RUNNING) == 1, 5) < 5
    timed_out.join()
    assert wait_for(lambda: is_idle(server), 3) < 1.0


def test_a_stream_whose_client_goes_away_is_aborted_within_a_second(server):
    sock = open_request(server, "/v1/completions", LONG | {"stream": True})
    received = b""
    while b"data: " not in received:  # headers first, then the first events
        received += sock.recv(65536)
    sock.close()
    assert wait_for(lambda: is_idle(server), 3) < 1.0


def test_slots_of_disconnected_clients_admit_as_many_new_requests_at_once(server):
    socks = [open_request(server, "/v1/completions", LONG | {"stream": i % 2 == 0}) for i in range(LIMIT)]
    assert wait_for(lambda: metric(server, RUNNING) == LIMIT, 5) < 5
    assert http(f"{server}/v1/completions", LONG | {"max_tokens": 1})[0] == 503  # the limit holds
    for sock in socks:
        sock.close()
    short = LONG | {"max_tokens": 4}
    with ThreadPoolExecutor(LIMIT) as pool:
        statuses = list(pool.map(lambda _: http(f"{server}/v1/completions", short)[0], range(LIMIT)))
    assert statuses == [200] * LIMIT
    assert wait_for(lambda: is_idle(server), 3) < 1.0
