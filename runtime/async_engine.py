"""The engine for asyncio programs: many concurrent generate() streams over an engine core on a thread of
this process, through the same client a server's replicas use (runtime/core/client.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from shardserve.runtime.core.client import EngineCoreClient
from shardserve.runtime.core.engine import EngineCore
from shardserve.runtime.engine_args import EngineArgs
from shardserve.runtime.input_processor import ProcessedPrompt, PromptType
from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.outputs import EmbeddingRequestOutput, PromptDelta, embedding_output
from shardserve.runtime.pooling_params import PoolingParams
from shardserve.runtime.sampling_params import SamplingParams


class AsyncEngine:
    """NOTE: the engine is built here, in the caller's thread (a bad setting raises from the constructor);
    its core loop runs on a thread of its own from the first prompt (or start()), and every other call
    goes to it as a message. The core's thread works on token ids only: prompts are processed and
    outputs made text here, on the event loop, with the engine's own input processor and tokenizer."""

    def __init__(self, model: str, **engine_kwargs):
        self.engine_args = EngineArgs.from_kwargs(model, engine_kwargs, "AsyncEngine(...)")
        self.engine = EngineCore(self.engine_args.create_engine_config())
        self.input_processor = self.engine.input_processor
        self.client = EngineCoreClient.in_thread(self.engine)

    @property
    def error(self) -> BaseException | None:
        """Why the core died (a dead rank, say); it stays dead."""
        return self.client.error

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
        processed here, so a bad one raises before anything is queued; closing the iterator early aborts it."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.error!r}")
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.input_processor.process(prompt, sampling_params)
        self.engine.adapter_checks.check(lora_request)  # a bad adapter fails here, before anything is queued
        async for delta in self.client.generate(prompt, sampling_params, prompt_id, lora_request):
            yield delta

    async def abort(self, prompt_id: str) -> None:
        """Free everything the prompt's requests hold (between two steps); its stream ends."""
        await self.client.abort(prompt_id)

    def start(self) -> None:
        """Start the core's loop now (inside the running event loop), so that the workers are watched
        before the first prompt arrives; otherwise the first prompt starts it."""
        self.client.start()

    async def shutdown(self) -> None:
        await self.client.shutdown()
