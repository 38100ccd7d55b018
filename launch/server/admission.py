"""Admission of API requests: the in-flight limit, the client's departure, and the drain at shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi.responses import JSONResponse

from shardserve.launch.server.fair_share import RETRY_AFTER_SECONDS
from shardserve.launch.server.metrics import ServerMetrics
from shardserve.launch.server.request_checks import API_PATHS, app_path
from shardserve.launch.openai_api.protocol import APIError, shutting_down


class Admission:
    """What the API routes hold: the count the limit is checked against, and whether the server is
    draining (SIGTERM: in-flight requests may finish, new ones are refused)."""

    def __init__(self, limit: int, metrics: ServerMetrics):
        self.limit, self.metrics = limit, metrics
        self.num_in_flight = 0
        self.is_draining = False

    def refusal(self) -> APIError | None:
        if self.is_draining:
            return shutting_down()
        if self.num_in_flight >= self.limit:
            return APIError(503, f"server overloaded: {self.num_in_flight} requests in flight; retry later",
                            error_type="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return None


class InFlightLimit:
    """ASGI middleware over the API routes (every POST to request_checks.API_PATHS, under any --root-path):
    answers 503 while draining or beyond the limit; counts a request from arrival until its response is
    sent or its client has gone, whichever is first.

    NOTE: counting here, not in the engine, closes the race where a burst passes the check before any of
    its requests has reached a replica. A client's departure frees its slot the moment the connection
    says so, not when the request has finished unwinding, so that a client that closes N connections and
    opens N new ones is never refused."""

    def __init__(self, app, admission: Admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not app_path(scope).startswith(API_PATHS):
            return await self.app(scope, receive, send)
        admission = self.admission
        refusal = admission.refusal()
        if refusal is not None:
            admission.metrics.outcome(refusal.outcome)
            return await JSONResponse(refusal.body(), refusal.status, headers=refusal.headers)(scope, receive, send)
        admission.num_in_flight += 1
        is_counted = True

        def release() -> None:
            nonlocal is_counted
            if is_counted:
                is_counted = False
                admission.num_in_flight -= 1

        client = Client(receive, release)
        try:
            await self.app(scope, client.receive, send)
        finally:
            client.close()
            release()


class Client:
    """One request's client as its `receive` shows it. Once the body has arrived, a watcher waits on the
    connection for the disconnect (the server reports it the moment the socket closes); the app's later
    receive() calls wait on that watcher, so the connection has one reader.

    NOTE: an app learns of a departure by awaiting receive() (Starlette's streams do; so does
    responding.until_disconnect): no polling, so an abort starts as soon as the client has gone."""

    def __init__(self, receive, on_gone: Callable[[], None]):
        self._receive, self._on_gone = receive, on_gone
        self.gone = asyncio.Event()
        self._watcher: asyncio.Task | None = None

    async def receive(self) -> dict:
        if self._watcher is not None:
            await self.gone.wait()
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self._left()
        elif not message.get("more_body", False):  # the body is complete: from now on, only a disconnect
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return message

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._left()

    def _left(self) -> None:
        if not self.gone.is_set():
            self.gone.set()
            self._on_gone()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
