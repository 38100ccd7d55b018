"""The bundled inference runtime: paged KV cache, continuous batching, sharded models."""

from shardserve.runtime.errors import EngineDeadError
from shardserve.runtime.input_processor import InvalidPromptError, ProcessedPrompt
from shardserve.runtime.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                                       PromptDelta, RequestOutput, SampleDelta)
from shardserve.runtime.pooling_params import PoolingParams
from shardserve.runtime.sampling_params import SamplingParams


def __getattr__(name):
    # torch-heavy entry points load on first use, so `import shardserve.runtime` stays cheap
    if name == "LLM":
        from shardserve.runtime.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from shardserve.runtime.async_engine import AsyncEngine
        return AsyncEngine
    if name == "EngineArgs":
        from shardserve.runtime.engine_args import EngineArgs
        return EngineArgs
    raise AttributeError(name)


__all__ = ["LLM", "AsyncEngine", "EngineArgs", "EngineDeadError", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "PromptDelta", "SampleDelta", "ProcessedPrompt", "InvalidPromptError",
           "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput"]
