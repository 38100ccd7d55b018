"""Typed calls on the control channel between the engine and its worker ranks, and their replies.

Only these small pickled records cross the channel; tensors move between ranks over
torch.distributed and never through it."""

from __future__ import annotations

import enum
import logging
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.runtime.config import EngineConfig
    from shardserve.runtime.distributed.process_group import Rendezvous
    from shardserve.runtime.distributed.parallel_state import ParallelState


def engine_log_level() -> int | None:
    """The engine process's level for shardserve's logs when its logging is set up (launch does), for
    its ranks to log alike (weight loading progress); None: it shows no logs, neither do they."""
    if not logging.getLogger().handlers:
        return None
    return logging.getLogger("shardserve").getEffectiveLevel()


@dataclass(frozen=True, slots=True)
class RankStartup:
    """What a rank needs to come up: the first record it receives, whatever starts it."""

    config: EngineConfig
    state: ParallelState
    rendezvous: Rendezvous
    num_threads: int  # torch's intra-op threads in this rank
    log_level: int | None = field(default_factory=engine_log_level)  # as made, in the engine


class WorkerMethod(enum.Enum):
    AVAILABLE_KV_CACHE_BYTES = "available_kv_cache_bytes"
    BYTES_PER_BLOCK = "bytes_per_block"
    INITIALIZE_KV_CACHE = "initialize_kv_cache"  # argument: (num_blocks, num_offload_blocks)
    EXECUTE_MODEL = "execute_model"  # argument: SchedulerOutput; only the output rank replies
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class WorkerCall:
    method: WorkerMethod
    argument: object = None


@dataclass(frozen=True, slots=True)
class WorkerReply:
    rank: int
    value: object = None
    error: str | None = None  # a formatted traceback: the rank failed and is exiting


def call_worker(worker, call: WorkerCall) -> object:
    """Run one call on a Worker (in whatever process holds it); the reply's value."""
    if call.method is WorkerMethod.EXECUTE_MODEL:
        return worker.execute(call.argument)
    if call.method is WorkerMethod.AVAILABLE_KV_CACHE_BYTES:
        return worker.available_kv_cache_bytes()
    if call.method is WorkerMethod.BYTES_PER_BLOCK:
        return worker.bytes_per_block
    if call.method is WorkerMethod.INITIALIZE_KV_CACHE:
        num_blocks, num_offload_blocks = typing.cast(tuple[int, int], call.argument)
        return worker.initialize_kv_cache(num_blocks, num_offload_blocks)
    raise ValueError(f"no worker call {call.method}")


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where a rank came up (a ready reply's value): its node and the per-node variables it got."""

    node: str
    env: dict[str, str]

    def describe(self) -> str:
        return self.node + (f" ({' '.join(f'{k}={v}' for k, v in sorted(self.env.items()))})"
                            if self.env else "")
