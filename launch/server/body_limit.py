"""ASGI middleware: a request body larger than max_request_body_bytes is answered 413 before it is parsed, and
one that stops arriving for --request-read-timeout seconds is a 408."""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from shardserve.launch.server.metrics import ServerMetrics
from shardserve.launch.openai_api.protocol import APIError

MAX_DRAIN_BYTES = 64 << 20  # the most of a refused body read (and dropped) before the 413 goes out


class BodyLimit:
    """A body declared larger than `limit` (Content-Length) is refused unparsed, its bytes dropped as they
    come; any other is read whole before the app runs, up to the limit (a chunked one is refused once it
    passes it), and reaches the app unchanged. A body whose next piece takes longer than `read_timeout`
    seconds is a 408 (the connection closes).

    NOTE: the refused body is read to its end (up to MAX_DRAIN_BYTES) before the answer: a client that
    asked for the connection to close after the answer (urllib does) would otherwise see it reset
    mid-upload, never the 413. A client that sent 'Expect: 100-continue' is answered at once."""

    def __init__(self, app, limit: int, read_timeout: float, metrics: ServerMetrics):
        self.app, self.limit, self.read_timeout, self.metrics = app, limit, read_timeout, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send, has_more=True)
        messages, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:
                return await self._answer(APIError(408, f"the request body stopped arriving for {self.read_timeout:g} "
                                                   "s (--request-read-timeout)", error_type="invalid_request_error",
                                                   headers={"connection": "close"}),
                                          scope, receive, send)
            messages.append(message)
            size += len(message.get("body", b""))
            has_more = message["type"] == "http.request" and message.get("more_body", False)
            if size > self.limit:
                return await self._refuse(scope, receive, send, has_more)
            if not has_more:
                return await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope, receive, send, has_more: bool) -> None:
        error = APIError(413, f"the request body is larger than {self.limit} bytes, the server's limit "
                         "(--max-request-body-bytes)", error_type="invalid_request_error")
        if has_more and dict(scope["headers"]).get(b"expect", b"").lower() != b"100-continue":
            await _drain(receive, self.read_timeout)
        await self._answer(error, scope, receive, send)

    async def _answer(self, error: APIError, scope, receive, send) -> None:
        self.metrics.outcome(error.outcome)
        await JSONResponse(error.body(), error.status, headers=error.headers)(scope, receive, send)


async def _drain(receive, read_timeout: float) -> None:
    """Read the rest of a body and drop it; past MAX_DRAIN_BYTES the connection's close cuts it off."""
    size = 0
    while size <= MAX_DRAIN_BYTES:
        try:
            message = await asyncio.wait_for(receive(), read_timeout)
        except asyncio.TimeoutError:
            return
        size += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _replay(messages: list[dict], receive):
    """A receive that hands back the messages already read, then the client's own."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()
    return replayed
