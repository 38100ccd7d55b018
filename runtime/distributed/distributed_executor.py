"""The executor protocol for ranks in other processes: broadcast a call, wait for the output rank,
and turn any rank's death or failure into EngineDeadError after stopping all the others.

Subclasses (mp, ray) only place and start the ranks; each rank is reached through a WorkerHandle."""

from __future__ import annotations

import logging
import pickle
import time
from abc import ABC, abstractmethod

import torch

from shardserve.runtime.config import EngineConfig
from shardserve.runtime.distributed.process_group import Rendezvous, needs_store_after_joining, start_rendezvous
from shardserve.runtime.errors import EngineDeadError
from shardserve.runtime.distributed.executor import Executor
from shardserve.runtime.core.messages import ModelRunnerOutput, SchedulerOutput
from shardserve.runtime.distributed.parallel_state import ParallelState
from shardserve.runtime.distributed.worker_rpc import RankPlacement, WorkerCall, WorkerMethod, WorkerReply

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # how often a wait looks at the other ranks' health
STARTUP_TIMEOUT_SECONDS = 600.0
SHUTDOWN_GRACE_SECONDS = 5.0
ROOT_CAUSE_SECONDS = 1.0  # how long a failure waits to see whether another rank died first


class WorkerHandle(ABC):
    """One rank as the engine sees it: a channel for pickled calls and replies, and a life."""

    @abstractmethod
    def send(self, payload: bytes) -> None: ...

    @abstractmethod
    def poll(self, timeout: float) -> WorkerReply | None:
        """The next reply if one arrives within `timeout` seconds, else None."""

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def stop(self, grace: float) -> None:
        """Wait up to `grace` seconds for a clean exit, then kill."""


def rank_states(parallel_size: tuple[int, int], layer_split: tuple[int, ...],
                enable_expert_parallel: bool = False) -> list[ParallelState]:
    """Global rank order: rank = pp_rank * tp_size + tp_rank (see parallel_state)."""
    tp_size, pp_size = parallel_size
    return [ParallelState(rank % tp_size, tp_size, rank // tp_size, pp_size, layer_split, enable_expert_parallel)
            for rank in range(tp_size * pp_size)]


class DistributedExecutor(Executor):
    def __init__(self, config: EngineConfig, layer_split: tuple[int, ...]):
        parallel = config.parallel
        self.config = config
        self.states = rank_states((parallel.tensor_parallel_size, parallel.pipeline_parallel_size), layer_split,
                                  parallel.enable_expert_parallel)
        self.output_rank = next(s.global_rank for s in self.states if s.is_output_rank)
        self.store: torch.distributed.TCPStore | None  # the rendezvous server, while it is held
        self.store, rendezvous = start_rendezvous(self.rendezvous_host(), parallel.world_size)
        self.handles: list[WorkerHandle] = []
        self.is_dead = False
        try:
            self.handles = self.start_workers(rendezvous)
            # every rank reports ready, with its RankPlacement (None: a process of this host)
            self.placements: list[RankPlacement | None] = self._gather(self.handles, STARTUP_TIMEOUT_SECONDS)
        except BaseException:
            self.shutdown()
            raise
        self._after_joining(rendezvous)
        for state, placement in zip(self.states, self.placements):
            first, count = sum(layer_split[:state.pp_rank]), layer_split[state.pp_rank]
            logger.info("rank %d (tp %d/%d, pp %d/%d, layers %d-%d) runs on %s", state.global_rank, state.tp_rank,
                        state.tp_size, state.pp_rank, state.pp_size, first, first + count - 1,
                        placement.describe() if placement else "this host")

    def _after_joining(self, rendezvous: Rendezvous) -> None:
        """Every rank has joined: stop the store where the ranks are done with it."""
        where = f"{rendezvous.host}:{rendezvous.port}"
        if needs_store_after_joining(torch.device(self.config.device)):
            logger.info("the rendezvous store on %s stays open while the engine runs (its backend uses it)", where)
        else:
            self.store = None  # the server stops, its port closes
            logger.info("every rank joined: the rendezvous store on %s is closed", where)

    @abstractmethod
    def rendezvous_host(self) -> str:
        """An address of this process every rank can reach."""

    @abstractmethod
    def start_workers(self, rendezvous: Rendezvous) -> list[WorkerHandle]:
        """Start one rank per entry of self.states, in global rank order."""

    def available_kv_cache_bytes(self) -> int:
        return min(self._call_all(WorkerCall(WorkerMethod.AVAILABLE_KV_CACHE_BYTES)))

    def bytes_per_block(self) -> int:
        return max(self._call_all(WorkerCall(WorkerMethod.BYTES_PER_BLOCK)))

    def initialize_kv_cache(self, num_blocks: int, num_offload_blocks: int = 0) -> None:
        self._call_all(WorkerCall(WorkerMethod.INITIALIZE_KV_CACHE, (num_blocks, num_offload_blocks)))

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit_batch(output)
        return self.collect_batch()

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    def submit_batch(self, output: SchedulerOutput) -> None:
        """Every rank queues it; the first stage starts at once, later stages when data arrives."""
        self._broadcast(WorkerCall(WorkerMethod.EXECUTE_MODEL, output))

    def collect_batch(self) -> ModelRunnerOutput:
        """Only the output rank replies to a step, in submission order."""
        return self._gather([self.handles[self.output_rank]], None)[0]

    def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError("the engine's workers have stopped")
        self._check_health(skip=[])

    def _call_all(self, call: WorkerCall) -> list:
        self._broadcast(call)
        return self._gather(self.handles, None)

    def _broadcast(self, call: WorkerCall) -> None:
        if self.is_dead:
            raise EngineDeadError("the engine's workers have stopped")
        payload = pickle.dumps(call)  # pickled once, sent to every rank
        try:
            for handle in self.handles:
                handle.send(payload)
        except (OSError, EOFError) as error:
            self._die(f"a worker's control channel broke ({error!r})")

    def _gather(self, waiting: list[WorkerHandle], timeout: float | None) -> list:
        """Replies of `waiting`, in order; meanwhile any rank dying or failing kills the engine."""
        replies: dict[int, WorkerReply] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < len(waiting):
            for index, handle in enumerate(waiting):
                if index not in replies:
                    reply = handle.poll(POLL_SECONDS / len(waiting))
                    if reply is not None:
                        self._check_reply(reply)
                        replies[index] = reply
            self._check_health(skip=waiting)
            if deadline is not None and time.monotonic() > deadline:
                self._die(f"workers did not answer within {timeout:.0f} s")
        return [replies[i].value for i in range(len(waiting))]

    def _check_reply(self, reply: WorkerReply) -> None:
        if reply.error is not None:
            self._die(f"rank {reply.rank} failed:\n{reply.error}")

    def _check_health(self, skip: list[WorkerHandle]) -> None:
        for rank, handle in enumerate(self.handles):
            if handle not in skip:
                reply = handle.poll(0)
                if reply is not None:  # a rank that owes no reply only speaks when it fails
                    self._check_reply(reply)
                    self._die(f"rank {rank} answered out of turn")
            if not handle.is_alive():
                self._die(f"rank {rank} ({self.states[rank]}) exited unexpectedly")

    def _exited_ranks(self) -> list[int]:
        """Ranks found dead. A survivor's error (its collective broke) often arrives before the
        death is visible, so look a moment longer before naming no one."""
        deadline = time.monotonic() + ROOT_CAUSE_SECONDS
        while True:
            exited = [rank for rank, handle in enumerate(self.handles) if not handle.is_alive()]
            if exited or time.monotonic() > deadline:
                return exited
            for handle in self.handles:
                handle.poll(POLL_SECONDS / len(self.handles))  # lets a handle notice its rank's death

    def _die(self, reason: str) -> None:
        exited = self._exited_ranks()
        if exited:  # name the root cause: a survivor's failed collective is only the symptom
            reason = f"ranks {exited} exited; {reason}"
        logger.error("engine dead: %s", reason)
        self.is_dead = True
        for handle in self.handles:
            handle.stop(grace=0.0)
        raise EngineDeadError(reason)

    def shutdown(self) -> None:
        if not self.is_dead:
            payload = pickle.dumps(WorkerCall(WorkerMethod.SHUTDOWN))
            for handle in self.handles:
                try:
                    handle.send(payload)
                except (OSError, EOFError):
                    pass
        self.is_dead = True
        for handle in self.handles:
            handle.stop(grace=SHUTDOWN_GRACE_SECONDS)
