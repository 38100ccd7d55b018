"""How a route answers: its request prepared off the event loop, then as an event stream (counted, and closed
at once when its client leaves) or whole, cancelled the moment its client goes away."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from shardserve.launch.openai_api.response_format import ErrorEvent
from shardserve.launch.openai_api.request_deltas import RequestDeltas
from shardserve.launch.server.metrics import ServerMetrics

Opened = RequestDeltas | list[RequestDeltas] | None  # what a request opened (None: nothing, an embedding's)


async def off_loop(prepare, body):
    """NOTE: a request's text is rendered (chat template) and tokenized in a worker thread: a text near the
    body limit takes seconds to tokenize, and on the event loop every stream would wait that long. A fast
    tokenizer lets go of the GIL while it encodes, so the loop goes on meanwhile."""
    return await asyncio.to_thread(prepare, body)


class _EventStream(StreamingResponse):
    """NOTE: a client's departure cancels the response wherever it waits; closing the events here unwinds
    their generators at once, and closing what the request opened aborts its prompts in the engine (even
    if the events were never read), rather than whenever the garbage collector finds them."""

    def __init__(self, events, opened: Opened):
        super().__init__(events, media_type="text/event-stream")
        self.opened = opened

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await _close(self.opened)


def streaming(events, metrics: ServerMetrics, opened: Opened) -> StreamingResponse:
    """`events`, counted; `opened`: what the request opened (serving.open), closed when the response ends."""
    async def counted():
        outcome, ended_by = "aborted", None
        try:
            async for event in events:
                if isinstance(event, ErrorEvent):  # ended by an error event (a drain, a dead engine)
                    ended_by = event.outcome
                yield event
            outcome = ended_by or "success"
        finally:
            metrics.outcome(outcome)
            await events.aclose()
    return _EventStream(counted(), opened)


async def until_disconnect(coro, request: Request, metrics: ServerMetrics, opened: Opened):
    """Run a non-streaming request; the moment its client goes away, cancel it and close what it opened
    (serving.open): its prompts are aborted and their blocks freed."""
    task = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
        await _close(opened)  # the abort is on its way to the engine
    if task.cancelled():
        metrics.outcome("aborted")
        return Response(status_code=499)  # nobody reads it
    result = task.result()  # re-raises APIError for the handler
    metrics.outcome("success")
    return result


async def _close(opened: Opened) -> None:
    for deltas in opened if isinstance(opened, list) else [opened]:
        if deltas is not None:
            await deltas.aclose()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone: once the body is read, receive() has nothing else to say."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
