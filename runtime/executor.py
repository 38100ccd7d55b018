"""The engine's single door to the workers: one executor protocol, and its in-process implementation.

The in-process executor runs one worker in this process; the multiprocess and Ray executors of the
tensor/pipeline-parallel runtime implement the same protocol."""

from __future__ import annotations

from abc import ABC, abstractmethod

from shardserve.runtime.config import EngineConfig
from shardserve.runtime.messages import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def available_kv_cache_bytes(self) -> int:
        """The smallest KV budget over all workers (they must hold the same number of blocks)."""

    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one KV block costs on the worker that needs most per block."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the output rank's result comes back."""

    def shutdown(self) -> None:
        pass


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig):
        from shardserve.runtime.worker import Worker  # imports torch models; keep this module light

        self.worker = Worker(config)

    def available_kv_cache_bytes(self) -> int:
        return self.worker.available_kv_cache_bytes()

    def bytes_per_block(self) -> int:
        return self.worker.bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(output)


def make_executor(config: EngineConfig) -> Executor:
    parallel = config.parallel
    if parallel.world_size == 1 and parallel.distributed_executor_backend in (None, "uni"):
        return InProcessExecutor(config)
    raise ValueError(f"tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_size="
                     f"{parallel.pipeline_parallel_size}, distributed_executor_backend="
                     f"{parallel.distributed_executor_backend!r}: this runtime runs one worker in-process "
                     "so far; use sizes 1 and backend None")
