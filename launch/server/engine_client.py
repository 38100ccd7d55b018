"""What the server asks of an engine replica: the one interface between HTTP and the engines.

runtime.core.client.EngineCoreClient is its one implementation, for one replica or many: each engine core
runs in a process of its own, and the API process only relays. mypy holds the client to this Protocol
where the launcher hands its replicas to ReplicaSet."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from shardserve.runtime.core.engine import EngineInfo, EngineStats
    from shardserve.runtime.input_processor import ProcessedPrompt
    from shardserve.runtime.lora_request import LoRARequest
    from shardserve.runtime.outputs import PromptDelta
    from shardserve.runtime.pooling_params import PoolingParams
    from shardserve.runtime.sampling_params import SamplingParams


class EngineClient(Protocol):
    index: int  # the replica's number, in logs, errors and metric labels

    info: EngineInfo  # what the engine said when it came up: its model, KV cache, defaults and rules

    @property
    def tokenizer(self) -> Any:
        """What it makes text with (the server's one, shared by every replica); None without one."""

    @property
    def error(self) -> BaseException | None:
        """Why the replica is dead (health), or None; once set it stays."""

    async def open(self, prompt: ProcessedPrompt, sampling_params: SamplingParams | PoolingParams, prompt_id: str,
                   lora_request: LoRARequest | None = None,
                   compile_timeout: float | None = None) -> AsyncGenerator[PromptDelta]:
        """Hand the replica a prompt; return once it has it (under a grammar: compiled within compile_timeout
        seconds, or the error raises here). The iterator returned yields the prompt's deltas, the last one
        finished; closing it early aborts the prompt. With PoolingParams (a replica whose runner is pooling)
        one delta comes, carrying the prompt's vector. With a lora_request, generated with that adapter (the
        server checked it when it was added)."""

    async def abort(self, prompt_id: str) -> None:
        """End the prompt's stream and free what it holds."""

    def get_stats(self) -> EngineStats:
        """The replica's latest scheduler numbers."""

    def start(self) -> None:
        """Watch the replica from now on, busy or not (inside the server's event loop)."""

    async def shutdown(self) -> None:
        """Stop the replica's engine and every process it started."""
