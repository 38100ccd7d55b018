"""The engine for servers: many concurrent generate() streams over one background step loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shardserve.runtime.engine import LLMEngine
from shardserve.runtime.engine_args import EngineArgs
from shardserve.runtime.input_processor import ProcessedPrompt, PromptType
from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.outputs import EmbeddingRequestOutput, PromptDelta, embedding_output
from shardserve.runtime.pooling_params import PoolingParams
from shardserve.runtime.sampling_params import SamplingParams

_END = object()  # ends a stream whose prompt was aborted
HEALTH_CHECK_SECONDS = 0.5  # while idle, how often the workers are checked for life


@dataclass(slots=True)
class _PendingAdd:
    prompt_id: str
    prompt: ProcessedPrompt
    params: SamplingParams | PoolingParams
    lora: LoRARequest | None = None


class AsyncEngine:
    """NOTE: engine.step() runs in a worker thread so the event loop stays responsive, and every
    other engine call (add, abort) runs on the loop between steps: the engine itself is never
    touched by two threads at once. A prompt not yet processed is processed on the loop at once, with
    the engine's own input processor and tokenizer (one per process), while a step may be detokenizing:
    encoding without truncation or padding and decoding both only read a fast tokenizer, so the two
    threads may share it (tests/runtime/test_async_engine.py runs them side by side)."""

    def __init__(self, model: str, **engine_kwargs):
        self.engine_args = EngineArgs.from_kwargs(model, engine_kwargs, "AsyncEngine(...)")
        self.engine = LLMEngine(self.engine_args.create_engine_config())
        self.input_processor = self.engine.input_processor
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: list[tuple[str, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self.error: BaseException | None = None  # why the step loop died (a dead rank, say); it stays dead

    @property
    def kv_cache_info(self):
        return self.engine.kv_cache_info

    @property
    def sampling_defaults(self) -> dict:
        """The model's generation_config.json sampling fields, for requests that set none."""
        return self.engine.sampling_defaults

    def get_stats(self):
        return self.engine.get_stats()

    async def embed(self, prompt: PromptType | ProcessedPrompt, pooling_params: PoolingParams,
                    prompt_id: str) -> EmbeddingRequestOutput:
        """The prompt's pooled vector, once its prefill has run (a pooling runner's one result per prompt);
        cancelling the await aborts the prompt."""
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.input_processor.process(prompt, pooling_params)
        last = None
        async for delta in self.generate(prompt, pooling_params, prompt_id):
            last = delta
        if last is None or not last.finished:
            raise RuntimeError(f"prompt {prompt_id!r} was aborted before it was pooled")
        return embedding_output(prompt_id, prompt, last)

    async def generate(self, prompt: PromptType | ProcessedPrompt, sampling_params: SamplingParams | PoolingParams,
                       prompt_id: str, lora_request: LoRARequest | None = None) -> AsyncIterator[PromptDelta]:
        """Yield the prompt's delta after every step that advanced it; the last one is finished (with
        PoolingParams, on a pooling runner: one delta, carrying the vector). A prompt not yet processed is
        processed here, so a bad one raises before anything is queued."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.error!r}")
        if prompt_id in self._streams:
            raise ValueError(f"prompt id {prompt_id!r} is already in use")
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.input_processor.process(prompt, sampling_params)
        self.engine.adapter_checks.check(lora_request)  # a bad adapter fails here, before anything is queued
        if isinstance(sampling_params, SamplingParams) and sampling_params.structured_outputs is not None:
            # compiled now, off the loop, not in a step
            await self.input_processor.compile_grammar(sampling_params.structured_outputs)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[prompt_id] = stream
        self._pending_adds.append(_PendingAdd(prompt_id, prompt, sampling_params, lora_request))
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
            self._streams.pop(prompt_id, None)
            if not finished:  # the consumer went away: free the requests' blocks
                self._pending_aborts.append((prompt_id, asyncio.get_running_loop().create_future()))
                assert self._wake is not None  # _ensure_loop made it above
                self._wake.set()

    async def abort(self, prompt_id: str) -> None:
        """Free everything the prompt's requests hold; returns once that is done. Its stream ends."""
        done = asyncio.get_running_loop().create_future()
        self._pending_aborts.append((prompt_id, done))
        self._ensure_loop()
        await done

    def start(self) -> None:
        """Start the step loop now (inside the running event loop), so that the workers are watched
        before the first prompt arrives; otherwise the first prompt starts it."""
        self._ensure_loop()

    def _ensure_loop(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine is dead: {self.error}") from self.error
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        assert self._wake is not None  # made with the loop task
        self._wake.set()

    async def _step_loop(self) -> None:
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                assert self._wake is not None  # made before this loop started
                self._wake.clear()
                if not (self._pending_adds or self._pending_aborts):
                    await self._idle()
                continue
            try:
                deltas = await asyncio.to_thread(self.engine.step)
            except Exception as error:
                self._fail(error)
                raise
            for delta in deltas:
                stream = self._streams.get(delta.prompt_id)
                if stream is not None:
                    stream.put_nowait(delta)

    async def _idle(self) -> None:
        """Wait for work; meanwhile notice a worker rank dying, so the engine is known dead at once."""
        assert self._wake is not None  # made before the step loop started
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
                self.engine.add_request(add.prompt_id, add.prompt, add.params, add.lora)
            except Exception as error:  # a prompt the pool cannot hold fails its own stream only
                stream = self._streams.get(add.prompt_id)
                if stream is not None:
                    stream.put_nowait(error)
        aborts, self._pending_aborts = self._pending_aborts, []
        for prompt_id, done in aborts:
            self.engine.abort_request(prompt_id)
            stream = self._streams.get(prompt_id)
            if stream is not None:
                stream.put_nowait(_END)
            if not done.done():
                done.set_result(None)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self.engine.shutdown()
