"""A request's prompts, handed to their replicas, and their deltas interleaved as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from shardserve.runtime.outputs import PromptDelta

_DONE = object()  # a prompt's stream has ended


class RequestDeltas:
    """Every prompt's deltas, tagged with the prompt's index (response_builder's Deltas), from streams the
    replicas already hold (ReplicaSet.open). NOTE: once made it must be closed (aclose: what still runs is
    aborted), whether or not anyone read it: the routes close it when their response ends, however it ends."""

    def __init__(self, streams: list[AsyncGenerator[PromptDelta]],
                 as_api_error: Callable[[BaseException], BaseException]):
        self._streams, self._as_api_error = streams, as_api_error
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, stream)) for i, stream in enumerate(streams)]
        self._remaining = len(streams)

    async def _pump(self, prompt_index: int, stream: AsyncIterator[PromptDelta]) -> None:
        try:
            async for delta in stream:
                self._queue.put_nowait((prompt_index, delta))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
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
        """Abort every prompt still running (its stream closed: the replica frees its blocks)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:  # (one whose task never started still waits at its first delta)
            await stream.aclose()
