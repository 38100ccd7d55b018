"""A real `shardserve launch` on a free loopback port, shared by the server tests."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import urllib.error
import urllib.request

import pytest

API_KEY = "test-key-123"
MODEL = "shardserve-demo"
AUTH = {"authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, headers: dict | None = None,
         timeout: float = 30.0) -> tuple[int, str]:
    """(status, text) of a GET, or of a POST when a JSON body is given; never raises on 4xx."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={
        "content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        if http(f"{url}/health")[0] == 200:
            return
        time.sleep(0.25)
    raise RuntimeError("server did not become healthy in time")


def start_server(*args: str, env: dict | None = None, own_group: bool = False, program: list[str] | None = None,
                 cwd: str | None = None) -> tuple[subprocess.Popen, str]:
    """`own_group`: the server and its children in a process group of their own (as a service manager
    starts them), which a test may signal as a whole. `program`: the command before `launch` (this
    interpreter's `-m shardserve.launch` unless given); `env` entries set to None are removed."""
    port = free_port()
    environment = {key: value for key, value in {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}.items()
                   if value is not None}
    proc = subprocess.Popen(
        [*(program or [sys.executable, "-m", "shardserve.launch"]), "launch", *args, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=own_group, cwd=cwd,
        env=environment)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def stop_server(proc: subprocess.Popen, stop_signal: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(stop_signal)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


def open_request(url: str, path: str, body: dict, api_key: str | None = None) -> socket.socket:
    """A POST sent on a raw socket (with the key, if any) and left unread: close the socket to disconnect
    the client."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    key = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{key}"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


HI = [{"role": "user", "content": "hi"}]


def complete(server: str, **fields) -> tuple[int, dict]:
    return post(server, "/v1/completions", {"model": MODEL, "prompt": "A list is", "max_tokens": 4} | fields)


def chat(server: str, **fields) -> tuple[int, dict]:
    return post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 4} | fields)


def refused(reply: tuple[int, dict], param: str, *words: str) -> bool:
    """A 400 naming `param`, its message holding each of `words`."""
    code, data = reply
    error = data["error"]
    return code == 400 and error["param"] == param and all(w in error["message"] for w in words)


def kill_if_running(proc: subprocess.Popen) -> None:
    """After a test that expected the server to exit by itself: make sure it did."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def serving(*args: str):
    """A module fixture's server: yields its URL, then stops it and checks that it exited cleanly."""
    proc, url = start_server(*args)
    yield url
    code, out = stop_server(proc)
    assert code == 0, out


@pytest.fixture(scope="session")
def server():
    """The demo with an API key, shared by every module that asks for it (their tests read metrics as deltas)."""
    yield from serving("--profile", "demo", "--api-key", API_KEY)


@pytest.fixture(scope="session")
def open_server():
    """The demo as `launch --profile demo` serves it, no API key; shared like `server`."""
    yield from serving("--profile", "demo")


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def metric(server: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set) on /metrics."""
    text = http(f"{server}/metrics")[1]
    return sum(float(m) for m in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def post(server: str, path: str, body: dict, headers: dict | None = AUTH) -> tuple[int, dict | None]:
    """(status, JSON body) of a POST with the test key."""
    status, text = http(f"{server}{path}", body, headers)
    return status, json.loads(text) if text else None


def stream_chunks(server: str, path: str, body: dict, headers: dict | None = AUTH) -> list[dict]:
    """The JSON chunks of a streamed POST (stream: true is added), [DONE] left out."""
    status, text = http(f"{server}{path}", body | {"stream": True}, headers)
    assert status == 200, text[:300]
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def chat_stream_cut_by_an_error(closed: list):
    """A chat stream as openai_serving writes one that a dead engine ends: a delta, then an error event;
    `closed` gets True once the stream is closed."""
    from shardserve.launch.server.api_error import shutting_down
    from shardserve.launch.openai_api.response_format import error_event, sse

    try:
        yield sse({"choices": [{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}]})
        yield error_event(shutting_down())
        yield "data: [DONE]\n\n"
    finally:
        closed.append(True)
