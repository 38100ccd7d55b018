"""The engine for servers: many concurrent generate() streams over one background step loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shardserve.runtime.engine import LLMEngine
from shardserve.runtime.engine_args import EngineArgs
from shardserve.runtime.outputs import RequestOutput
from shardserve.runtime.sampling_params import SamplingParams

_END = object()  # ends a stream whose request was aborted
HEALTH_CHECK_SECONDS = 0.5  # while idle, how often the workers are checked for life


@dataclass(slots=True)
class _PendingAdd:
    request_id: str
    prompt: str | dict
    params: SamplingParams


class AsyncEngine:
    """NOTE: engine.step() runs in a worker thread so the event loop stays responsive, and every
    other engine call (add, abort, tokenize) runs on the loop between steps: the engine itself is
    never touched by two threads at once."""

    def __init__(self, model: str, **engine_kwargs):
        self.engine_args = EngineArgs.from_kwargs(model, engine_kwargs, "AsyncEngine(...)")
        self.engine = LLMEngine(self.engine_args.create_engine_config())
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: list[tuple[str, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self.error: BaseException | None = None  # why the step loop died (a dead rank, say); it stays dead

    @property
    def kv_cache_info(self):
        return self.engine.kv_cache_info

    async def generate(self, prompt: str | dict, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after every step that changed it, last one finished."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.error!r}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._pending_adds.append(_PendingAdd(request_id, prompt, sampling_params))
        self._ensure_loop()
        finished = False
        try:
            while True:
                item = await stream.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away: free the request's blocks
                self._pending_aborts.append((request_id, asyncio.get_running_loop().create_future()))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Free everything the request holds; returns once that is done. Its stream ends."""
        done = asyncio.get_running_loop().create_future()
        self._pending_aborts.append((request_id, done))
        self._ensure_loop()
        await done

    def start(self) -> None:
        """Start the step loop now (inside the running event loop), so that the workers are watched
        before the first request arrives; otherwise the first request starts it."""
        self._ensure_loop()

    def _ensure_loop(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine is dead: {self.error}") from self.error
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        self._wake.set()

    async def _step_loop(self) -> None:
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                if not (self._pending_adds or self._pending_aborts):
                    await self._idle()
                continue
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as error:
                self._fail(error)
                raise
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put_nowait(output)

    async def _idle(self) -> None:
        """Wait for work; meanwhile notice a worker rank dying, so the engine is known dead at once."""
        try:
            await asyncio.wait_for(self._wake.wait(), HEALTH_CHECK_SECONDS)
        except asyncio.TimeoutError:
            try:
                self.engine.check_health()
            except Exception as error:
                self._fail(error)
                raise

    def _fail(self, error: BaseException) -> None:
        """Hand the failure to every waiting stream; the loop stops."""
        self.error = error
        for stream in self._streams.values():
            stream.put_nowait(error)

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for add in adds:
            try:
                text, token_ids = self._resolve(add.prompt)
                self.engine.add_request(add.request_id, token_ids, add.params, prompt=text)
            except Exception as error:  # bad input fails its own stream only
                stream = self._streams.get(add.request_id)
                if stream is not None:
                    stream.put_nowait(error)
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id, done in aborts:
            self.engine.abort_request(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(_END)
            if not done.done():
                done.set_result(None)

    def _resolve(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenize(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return prompt["prompt"], self.engine.tokenize(prompt["prompt"])

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self.engine.shutdown()
