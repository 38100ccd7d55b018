"""The user-facing engine options (vLLM's names), shared by LLM, AsyncEngine and the launcher."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.runtime.config import (CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, load_model_config,
                                       resolve_device)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class EngineArgs:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False  # on CUDA, False captures decode steps in CUDA graphs
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def create_engine_config(self) -> EngineConfig:
        model = load_model_config(self.model, self.dtype, self.max_model_len, self.skip_tokenizer_init,
                                  self.enforce_eager)
        return EngineConfig(
            model=model,
            cache=CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              enable_prefix_caching=self.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens
                                      or DEFAULT_MAX_NUM_BATCHED_TOKENS),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    pipeline_parallel_size=self.pipeline_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend),
            device=resolve_device(self.device),
            seed=self.seed,
        )
