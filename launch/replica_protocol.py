"""The typed messages between the API server and a replica's process, and their framing on the socket.

One stream socket (a socketpair made at start; no port, no name) carries length-prefixed pickles:

    server -> replica:  ReplicaStartup, then AddPrompt | AbortPrompt | StopReplica
    replica -> server:  ReplicaReady | ReplicaFailed, then DeltaBatch | PromptFailed | StatsMessage
                        | EngineFailed (the replica's engine died; its process exits after)

    frame: | length: 8 bytes, big endian | pickle of one message |"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.runtime.config import KVCacheInfo, ModelConfig
    from shardserve.runtime.engine import EngineStats
    from shardserve.runtime.input_processor import ProcessedPrompt
    from shardserve.runtime.lora_request import LoRARequest
    from shardserve.runtime.outputs import PromptDelta
    from shardserve.runtime.pooling_params import PoolingParams
    from shardserve.runtime.sampling_params import SamplingParams

_LENGTH = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class ReplicaStartup:
    """The first message: what the replica's AsyncEngine is built from."""

    index: int
    model: str
    engine_kwargs: dict


@dataclass(frozen=True, slots=True)
class ReplicaReady:
    """The engine is up: what the server needs to process prompts and report on this replica."""

    model_config: ModelConfig
    sampling_defaults: dict
    kv_cache_info: KVCacheInfo
    stats: EngineStats


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


def frame(message: object) -> bytes:
    payload = pickle.dumps(message)
    return _LENGTH.pack(len(payload)) + payload


def send_blocking(sock: socket.socket, message: object) -> None:
    sock.sendall(frame(message))


def recv_blocking(sock: socket.socket) -> object:
    """The next message; EOFError when the other side has closed the socket."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    return pickle.loads(_recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the replica socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


async def read_message(reader: asyncio.StreamReader) -> object:
    """The next message; EOFError when the other side has closed the socket."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        return pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise EOFError("the other end closed the replica socket") from e
