"""The typed messages between the API server and a replica's process.

One stream socket (runtime/child_process.py: a socketpair made at start, no port, no name, and its
framing) carries pickles:

    server -> replica:  ReplicaStartup, then AddPrompt | AbortPrompt | StopReplica
    replica -> server:  ReplicaReady | ReplicaFailed, then DeltaBatch | PromptFailed | StatsMessage
                        | EngineFailed (the replica's engine died; its process exits after)"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.runtime.engine import EngineInfo, EngineStats
    from shardserve.runtime.engine_args import EngineArgs
    from shardserve.runtime.input_processor import ProcessedPrompt
    from shardserve.runtime.lora_request import LoRARequest
    from shardserve.runtime.outputs import PromptDelta
    from shardserve.runtime.pooling_params import PoolingParams
    from shardserve.runtime.sampling_params import SamplingParams

@dataclass(frozen=True, slots=True)
class ReplicaStartup:
    """The first message: the settings the replica's engine is built from (checked in the server's
    process, before any replica started)."""

    index: int
    args: EngineArgs


@dataclass(frozen=True, slots=True)
class ReplicaReady:
    """The engine is up: what the server needs to process prompts for it and report on it."""

    info: EngineInfo


@dataclass(frozen=True, slots=True)
class ReplicaFailed:
    """The engine could not be built; the process exits."""

    error: BaseException
    traceback: str


@dataclass(frozen=True, slots=True)
class AddPrompt:
    """A prompt to generate from (SamplingParams) or to pool (PoolingParams: one DeltaBatch entry comes
    back, its sample carrying the vector)."""

    prompt_id: str
    prompt: ProcessedPrompt
    params: SamplingParams | PoolingParams
    lora: LoRARequest | None = None  # the adapter to generate with; None: the base model


@dataclass(frozen=True, slots=True)
class AbortPrompt:
    prompt_id: str


@dataclass(frozen=True, slots=True)
class StopReplica:
    """Shut the engine (and its ranks) down and exit."""


@dataclass(frozen=True, slots=True)
class DeltaBatch:
    """The deltas of every prompt that advanced in one engine step (one write, one pickle)."""

    deltas: list[PromptDelta]


@dataclass(frozen=True, slots=True)
class PromptFailed:
    """The prompt's stream ended with this error (a prompt the pool cannot hold, a dead engine)."""

    prompt_id: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class StatsMessage:
    """Sent every STATS_SECONDS: the scheduler's numbers for /metrics, and a sign of life."""

    stats: EngineStats


@dataclass(frozen=True, slots=True)
class EngineFailed:
    reason: str


def portable_error(error: BaseException) -> BaseException:
    """The error itself when it survives pickling, else one of its kind (a ValueError stays a
    request's fault) carrying its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        kind = ValueError if isinstance(error, ValueError) else RuntimeError
        return kind(f"{type(error).__name__}: {error}")
