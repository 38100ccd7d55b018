"""A child process of ours (a rank, a server's replica): how it is started, stopped and watched, and
the one framing of the socket between it and its parent.

The parent makes a socketpair (no port, no name), starts `python -P -m MODULE FD PARENT_PID` with the
child's end, and sends the startup record first. Every message either way is one frame:

    | length: 8 bytes, big endian | payload (a pickle) |"""

from __future__ import annotations

import asyncio
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()  # the caller's working directory stays off the path
KILL_WAIT_SECONDS = 1.0
PARENT_POLL_SECONDS = 0.5
_LENGTH = struct.Struct(">Q")


def start_child(module: str, startup: object, env: dict | None = None) -> tuple[subprocess.Popen, socket.socket]:
    """The child's process and the parent's end of its socket, the startup record sent. NOTE: a fresh
    interpreter runs the module, never the caller's main (spawn imports it again: a script on stdin, or
    one without a main guard, breaks or runs twice); it imports shardserve as any fresh interpreter would."""
    parent_end, child_end = socket.socketpair()
    fd = child_end.fileno()
    process = subprocess.Popen([sys.executable, *SAFE_PATH, "-m", module, str(fd), str(os.getpid())],
                               pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
    child_end.close()
    try:
        send_blocking(parent_end, startup)
    except OSError:
        pass  # the child died at once: waiting for it says so
    return process, parent_end


def child_main() -> tuple[socket.socket, object] | None:
    """The child's side of start_child: its socket and startup record, or None if the parent went away
    first. Ctrl-C, and a SIGTERM to the whole process group (systemd's stop), belong to the parent, which
    drains and then stops its children (a stop that cannot wait escalates to SIGKILL)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd, parent_pid = (int(arg) for arg in sys.argv[1:3])
    watch_parent(parent_pid)
    sock = socket.socket(fileno=fd)
    try:
        return sock, recv_blocking(sock)
    except EOFError:
        return None


def watch_parent(parent_pid: int) -> None:
    """Exit once the parent is gone, so no child outlives it. NOTE: polling getppid works whatever thread
    started us (PR_SET_PDEATHSIG fires when the starting *thread* exits, which asyncio.to_thread makes likely)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def stop_process(process: subprocess.Popen, grace: float) -> None:
    """Wait up to `grace` seconds for an exit, then SIGKILL it (its pid alone). NOTE: ranks and replicas
    ignore SIGTERM, which a service manager sends the whole process group: the server drains them."""
    for stop, wait in ((None, grace), (process.kill, KILL_WAIT_SECONDS)):
        if stop is not None:
            stop()
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def send_blocking(sock: socket.socket, message: object) -> None:
    send_payload(sock, pickle.dumps(message))


def send_payload(sock: socket.socket, payload: bytes) -> None:
    """An already pickled message (one pickle for many children)."""
    sock.sendall(_framed(payload))


def frame(message: object) -> bytes:
    return _framed(pickle.dumps(message))


def _framed(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def recv_blocking(sock: socket.socket) -> object:
    """The next message; EOFError when the other side has closed the socket."""
    return pickle.loads(recv_payload(sock))


def recv_payload(sock: socket.socket) -> bytes:
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class FrameReader:
    """A socket read without asyncio and without blocking past `timeout`: every whole message that has
    arrived, waiting at most that long for the first bytes."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = bytearray()
        self.closed = False  # the other side has closed the socket (what came before it is still read)

    def read(self, timeout: float) -> list[object]:
        wait = timeout
        while not self.closed and select.select([self.sock], [], [], wait)[0]:
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
            self.buffer += chunk
            wait = 0.0  # take what else has arrived, without waiting for more
        messages = []
        while len(self.buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self.buffer)
            end = _LENGTH.size + length
            if len(self.buffer) < end:
                break
            messages.append(pickle.loads(self.buffer[_LENGTH.size:end]))
            del self.buffer[:end]
        return messages


async def read_message(reader: asyncio.StreamReader) -> object:
    """The next message; EOFError when the other side has closed the socket."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        return pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise EOFError("the other end closed the socket") from e
