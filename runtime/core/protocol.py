"""The typed messages between an engine core's client and its loop.

One stream socket (runtime/distributed/child_process.py: a socketpair, no port, no name, and its framing) carries
pickles:

    client -> core:  CoreStartup (a core in a process of its own), then AddPrompt | AbortPrompt | StopRequests
                     | StopCore
    core -> client:  CoreReady | CoreStartFailed, then PromptAdded | StepUpdates | PromptFailed | StatsMessage
                     | Alive | EngineFailed (the engine died; its loop ends after)"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.runtime.core.engine import EngineInfo, EngineStats
    from shardserve.runtime.engine_args import EngineArgs
    from shardserve.runtime.input_processor import ProcessedPrompt
    from shardserve.runtime.lora_request import LoRARequest
    from shardserve.runtime.core.messages import RequestUpdate
    from shardserve.runtime.pooling_params import PoolingParams
    from shardserve.runtime.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class CoreStartup:
    """The first message to a core's process: the settings its engine is built from (checked by the
    client, before any process started); index: the server's replica number, for logs."""

    index: int
    args: EngineArgs


@dataclass(frozen=True, slots=True)
class CoreReady:
    """The engine is up: what its client needs to process prompts for it and report on it."""

    info: EngineInfo


@dataclass(frozen=True, slots=True)
class CoreStartFailed:
    """The engine could not be built; the process exits."""

    error: BaseException
    traceback: str


@dataclass(frozen=True, slots=True)
class AddPrompt:
    """A prompt to generate from (SamplingParams) or to pool (PoolingParams: one RequestUpdate comes
    back, carrying the vector)."""

    prompt_id: str
    prompt: ProcessedPrompt
    params: SamplingParams | PoolingParams
    lora: LoRARequest | None = None  # the adapter to generate with; None: the base model
    compile_timeout: float | None = None  # the longest its grammar may take to compile; None: no limit


@dataclass(frozen=True, slots=True)
class PromptAdded:
    """A prompt under a grammar is in the engine, its grammar compiled (a prompt without one is in the engine
    the moment the core reads it: nothing is said). A grammar that fails to compile, or takes longer than
    compile_timeout, is a PromptFailed instead."""

    prompt_id: str


@dataclass(frozen=True, slots=True)
class AbortPrompt:
    prompt_id: str


@dataclass(frozen=True, slots=True)
class StopRequests:
    """Samples whose text a stop string ended (the client found it): the core finishes them as stopped."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StopCore:
    """Shut the engine (and its ranks) down; the loop ends (its process exits)."""


@dataclass(frozen=True, slots=True)
class StepUpdates:
    """What every request that advanced in one engine step gained, in token ids (one write, one pickle): the
    client makes text of them."""

    updates: list[RequestUpdate]


@dataclass(frozen=True, slots=True)
class PromptFailed:
    """The prompt's stream ended with this error (a prompt the pool cannot hold, a dead engine, an adapter
    whose weights its ranks could not read: the step's other prompts run on)."""

    prompt_id: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class StatsMessage:
    """Sent every STATS_SECONDS: the scheduler's numbers for /metrics, and a sign of life."""

    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Alive:
    """The core's process runs: sent every HEARTBEAT_SECONDS from a thread of its own, whatever a step is
    doing, so a long step is not silence and a stopped or frozen process is."""


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
