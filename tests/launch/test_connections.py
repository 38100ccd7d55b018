"""A client that stalls does not hold a connection: headers must come within --request-read-timeout, a body must
not pause longer than it (a 408), and running out of file descriptors is one log line, not a flood."""

import asyncio
import errno
import json
import logging
import socket
import time

import pytest

from shardserve.launch.server.connections import quiet_accept_errors
from tests.launch.conftest import http, serving

READ_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server():
    yield from serving("--profile", "demo", "--request-read-timeout", str(READ_TIMEOUT))


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10 * READ_TIMEOUT)


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a socket timeout if it never does)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.mark.slow
def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    """uvicorn alone waited for the rest of the headers forever (each such connection holds a descriptor)."""
    with connect(server) as sock:
        began = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        assert read_all(sock) == b""  # closed, with nothing to say: no request was made
        assert READ_TIMEOUT * 0.9 < time.monotonic() - began < 5 * READ_TIMEOUT
    assert http(f"{server}/health")[0] == 200


@pytest.mark.slow
def test_a_body_that_stops_arriving_is_a_408(server):
    body = json.dumps({"prompt": "The", "max_tokens": 2}).encode()
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        began = time.monotonic()
        answer = read_all(sock)
        assert time.monotonic() - began < 5 * READ_TIMEOUT
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert "--request-read-timeout" in json.loads(text)["error"]["message"]


@pytest.mark.slow
def test_a_slow_client_that_keeps_sending_is_served(server):
    """The deadline is for the headers; a body that keeps coming, however slowly, is read whole."""
    body = json.dumps({"prompt": "The", "max_tokens": 2}).encode()
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 8):
            time.sleep(READ_TIMEOUT / 4)
            sock.sendall(body[i:i + 8])
        assert read_all(sock).startswith(b"HTTP/1.1 200")


def test_running_out_of_file_descriptors_is_one_log_line(caplog):
    """asyncio's accept loop reports EMFILE at each try (a traceback a try); the server says it once per
    ACCEPT_LOG_SECONDS, and any other error still reaches the loop's handler."""
    loop = asyncio.new_event_loop()
    others: list[dict] = []
    loop.set_exception_handler(lambda _, context: others.append(context))
    quiet_accept_errors(loop, file_limit=1024)
    with caplog.at_level(logging.ERROR, logger="shardserve.launch"):
        for _ in range(100):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE, "Too many open files")})
        loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
    loop.close()
    lines = [r.getMessage() for r in caplog.records if "file descriptors" in r.getMessage()]
    assert len(lines) == 1 and "1024" in lines[0] and not caplog.records[0].exc_info
    assert [context["message"] for context in others] == ["something else"]
