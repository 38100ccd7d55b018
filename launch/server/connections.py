"""The HTTP server's connections: a client sends a request's headers within --request-read-timeout seconds or is
disconnected (uvicorn waits for them forever: 500 half-sent requests held 500 file descriptors), the process may
open as many files as its hard limit allows, and running out of them is one log line every few seconds (asyncio's
accept loop logged a traceback at each try: megabytes a second)."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time

logger = logging.getLogger("shardserve.launch")

OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_LOG_SECONDS = 10.0  # at most one line this often while connections cannot be accepted


def http_protocol(read_timeout: float):
    """uvicorn's h11 protocol, with a deadline for each request's headers: from the connection's start, and from
    the first bytes of each next request on a kept-alive connection (an idle one is uvicorn's keep-alive's)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer = self.loop.call_later(read_timeout, self._headers_late)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._has_request():
                self._stop_timer()
            elif self.header_timer is None and not self.transport.is_closing():  # a next request began
                self.header_timer = self.loop.call_later(read_timeout, self._headers_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def _has_request(self) -> bool:
            """Whether a request's headers have all come and its response is not done."""
            return self.cycle is not None and not self.cycle.response_complete

        def _headers_late(self) -> None:
            self.header_timer = None
            if not self._has_request() and not self.transport.is_closing():
                self.transport.close()

        def _stop_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

    return HeaderDeadline


def raise_file_limit() -> int:
    """The process's soft limit on open files raised to its hard limit (each connection holds one); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may forbid it: the limit stays as it was
            pass
    return soft


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, file_limit: int) -> None:
    """Running out of file descriptors (new connections wait in the listen queue meanwhile) is logged once per
    ACCEPT_LOG_SECONDS in one line; every other error of the loop goes to the handler it had."""
    previous = loop.get_exception_handler()
    last_logged = [float("-inf")]

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        error = context.get("exception")
        if isinstance(error, OSError) and error.errno in OUT_OF_FILES:
            now = time.monotonic()
            if now - last_logged[0] >= ACCEPT_LOG_SECONDS:
                last_logged[0] = now
                logger.error("out of file descriptors (%s; the limit is %d): new connections wait until some "
                             "close", error.strerror, file_limit)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
