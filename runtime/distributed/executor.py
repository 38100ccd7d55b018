"""The engine's single door to the workers: one executor protocol, its in-process implementation, and
the choice among executors.

The in-process executor runs one worker in this process; the mp and Ray executors
(distributed_executor.py) implement the same protocol for ranks in other processes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from shardserve.runtime.config import EngineConfig
from shardserve.runtime.core.messages import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    is_dead: bool = False  # set once a worker has died; the executor is unusable after
    @abstractmethod
    def available_kv_cache_bytes(self) -> int:
        """The smallest KV budget over all workers (they must hold the same number of blocks)."""

    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one KV block costs on the worker that needs most per block."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, num_offload_blocks: int = 0) -> None:
        """The GPU pool on every worker, and the CPU tier's share of each (0: no tier)."""

    @abstractmethod
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the output rank's result comes back."""

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine may have in flight: one per pipeline stage where stages are processes."""
        return 1

    def submit_batch(self, output: SchedulerOutput) -> None:
        """Start a step without waiting (only where max_concurrent_batches > 1)."""
        raise NotImplementedError

    def collect_batch(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step, once it is done."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker has died (called between steps, e.g. while idle)."""

    def shutdown(self) -> None:
        pass


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig):
        from shardserve.runtime.distributed.parallel_state import ParallelState, set_parallel_state
        from shardserve.runtime.worker.worker import Worker  # imports torch models; keep this module light

        set_parallel_state(ParallelState())
        self.async_scheduling = config.scheduler.async_scheduling
        self.worker = Worker(config)
        self._submitted: deque = deque()  # the worker's results of submitted steps, oldest first

    def available_kv_cache_bytes(self) -> int:
        return self.worker.available_kv_cache_bytes()

    def bytes_per_block(self) -> int:
        return self.worker.bytes_per_block

    def initialize_kv_cache(self, num_blocks: int, num_offload_blocks: int = 0) -> None:
        self.worker.initialize_kv_cache(num_blocks, num_offload_blocks)

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = self.worker.execute(output)
        assert result is not None  # the only rank is the output rank
        return result

    @property
    def max_concurrent_batches(self) -> int:
        """Two with async scheduling: the next step is queued on the device before the last is read."""
        return 2 if self.async_scheduling else 1

    def submit_batch(self, output: SchedulerOutput) -> None:
        self._submitted.append(self.worker.submit(output))

    def collect_batch(self) -> ModelRunnerOutput:
        result = self.worker.collect(self._submitted.popleft())
        assert result is not None  # the only rank is the output rank
        return result

    def shutdown(self) -> None:
        self.worker.release()
