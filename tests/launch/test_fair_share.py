"""What one client's request may cost the others (issue 40): a fan-out waits behind another client's single
request, not in front of it, and a request with no room on the engines gets a 503 with Retry-After."""

import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.launch.conftest import MODEL, http, metric, serving

pytestmark = pytest.mark.slow  # every test here starts a process

MAX_NUM_SEQS = 8  # the one replica's: one client may hold 7 of them (all but a sixteenth, at least one)
QUEUE_TIMEOUT = 1.0
RUNNING = "vllm:num_requests_running"


@pytest.fixture(scope="module")
def server():
    yield from serving("--profile", "demo", "--max-num-seqs", str(MAX_NUM_SEQS), "--queue-timeout", str(QUEUE_TIMEOUT))


def timed(url: str, body: dict, answers: dict, name: str) -> None:
    began = time.monotonic()
    status, text = http(f"{url}/v1/completions", body, timeout=120)
    answers[name] = (status, text, time.monotonic() - began)


def fan_out(user: str, num_prompts: int, n: int, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": [f"Story {i}" for i in range(num_prompts)], "n": n, "max_tokens": max_tokens,
            "temperature": 1.0, "seed": 1, "ignore_eos": True, "user": user}


def until(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not check():
        time.sleep(0.05)
    return check()


def test_a_fan_out_waits_behind_another_clients_single_request(server):
    """16 sequences from one client (4 prompts x n=4) on a replica that runs 8: another client's 1-token
    request runs beside them at once; first come first served, it waited for two rounds of them."""
    answers: dict = {}
    big = threading.Thread(target=timed, args=(server, fan_out("a", 4, 4, 150), answers, "fan-out"))
    big.start()
    assert until(lambda: metric(server, RUNNING) >= 4, 10)  # (a prompt's n=4 at a time: 4, not 8, fit in 7)
    timed(server, {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": "b"}, answers, "probe")
    big.join()
    (status, text, probe), (big_status, _, fan) = answers["probe"], answers["fan-out"]
    assert status == 200 and big_status == 200, text
    assert probe < fan / 4, f"the probe took {probe:.2f} s beside a fan-out of {fan:.2f} s"


def test_a_request_with_no_room_is_a_503_with_retry_after(server):
    """Client a holds 7 sequences, client b the last one: client c's request waits with nothing running,
    and after --queue-timeout it is refused (a and b run on)."""
    answers: dict = {}
    # 900 tokens: neither a nor b ends within the timeout (200 on an idle machine did, and c found room)
    threads = [threading.Thread(target=timed, args=(server, fan_out(user, 1, n, 900), answers, user))
               for user, n in (("a", MAX_NUM_SEQS - 1), ("b", 1))]
    threads[0].start()
    assert until(lambda: metric(server, RUNNING) == MAX_NUM_SEQS - 1, 10)
    threads[1].start()
    assert until(lambda: metric(server, RUNNING) == MAX_NUM_SEQS, 10)
    request = urllib.request.Request(f"{server}/v1/completions", data=(
        b'{"model": "%s", "prompt": "hi", "max_tokens": 1, "user": "c"}' % MODEL.encode()),
        headers={"content-type": "application/json"})
    began = time.monotonic()
    try:
        urllib.request.urlopen(request, timeout=30)
        refused = None
    except urllib.error.HTTPError as error:
        refused = error
    waited = time.monotonic() - began
    for thread in threads:
        thread.join()
    assert refused is not None and refused.code == 503, "client c was served with no room"
    assert refused.headers["Retry-After"] == "1" and "--queue-timeout" in refused.read().decode()
    assert QUEUE_TIMEOUT <= waited < QUEUE_TIMEOUT + 2
    assert [answers[user][0] for user in ("a", "b")] == [200, 200]
