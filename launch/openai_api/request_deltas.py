"""A request's prompts, handed to their replicas, and their deltas interleaved as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

from shardserve.runtime.outputs import PromptDelta

_DONE = object()  # a prompt's stream has ended
Opener = Callable[[], Awaitable[AsyncGenerator[PromptDelta]]]  # hands one prompt to a replica (ReplicaSet.open)


class RequestDeltas:
    """Every prompt's deltas, tagged with the prompt's index (response_builder's Deltas). Each prompt is
    opened and read by a task of its own from the start, so a prompt that waits for room on the engines
    (launch/server/fair_share.py) waits while the request's earlier prompts run and end. NOTE: once made
    it must be closed (aclose: what still runs is aborted), whether or not anyone read it: the routes
    close it when their response ends, however it ends."""

    def __init__(self, openers: list[Opener], as_api_error: Callable[[BaseException], BaseException]):
        self._as_api_error = as_api_error
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._opened = [loop.create_future() for _ in openers]
        self._tasks = [asyncio.create_task(self._pump(i, opener)) for i, opener in enumerate(openers)]
        self._remaining = len(openers)

    async def opened(self) -> None:
        """Until every prompt is in a replica's hands; the first failure to get there raises (as it is)."""
        results = await asyncio.gather(*self._opened, return_exceptions=True)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise error

    async def _pump(self, prompt_index: int, opener: Opener) -> None:
        opened = self._opened[prompt_index]
        try:
            stream = await opener()
            opened.set_result(None)
            try:
                async for delta in stream:
                    self._queue.put_nowait((prompt_index, delta))
            finally:
                await stream.aclose()
        except BaseException as e:  # noqa: BLE001 - handed to opened() or to the consumer
            if not opened.done():
                opened.set_exception(e)
            else:
                self._queue.put_nowait(e)
        finally:
            self._queue.put_nowait(_DONE)

    def __aiter__(self) -> RequestDeltas:
        return self

    async def __anext__(self) -> tuple[int, PromptDelta]:
        while self._remaining:
            item = await self._queue.get()
            if item is _DONE:
                self._remaining -= 1
            elif isinstance(item, BaseException):
                self._remaining = 0
                await self.aclose()
                raise self._as_api_error(item)
            else:
                return item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Abort every prompt still running or waiting (its stream closed: the replica frees its blocks)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for opened in self._opened:
            if opened.done() and not opened.cancelled():
                opened.exception()  # (retrieved: a failure opened() did not raise is no error to log)
