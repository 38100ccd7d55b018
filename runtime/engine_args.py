"""The runtime's options: the settings table's "engine" layer, shared by LLM, AsyncEngine and launch."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from shardserve.planner.model_source import model_path
from shardserve.planner.settings import (ENGINE, SettingError, check_fields, check_names, default,
                                         resolved_max_num_batched_tokens)
from shardserve.runtime.config import (CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, load_model_config,
                                       resolve_device)


@dataclass(frozen=True)
class EngineArgs:
    """The settings table's "engine" layer (planner/settings.py): fields in table order with the
    table's defaults (tests/planner/test_settings_classes.py keeps them equal), every value checked
    against the table when made. Tensor and pipeline parallel sizes left unset mean one rank each."""

    model: str | None = default("model")
    device: str = default("device")
    tensor_parallel_size: int | None = default("tensor_parallel_size")
    pipeline_parallel_size: int | None = default("pipeline_parallel_size")
    distributed_executor_backend: str | None = default("distributed_executor_backend")
    enable_expert_parallel: bool | None = default("enable_expert_parallel")
    layer_split: tuple[int, ...] | None = default("layer_split")
    max_model_len: int | Literal["auto"] | None = default("max_model_len")
    dtype: str = default("dtype")
    quantization: str | None = default("quantization")
    kv_cache_dtype: str = default("kv_cache_dtype")
    gpu_memory_utilization: float = default("gpu_memory_utilization")
    kv_cache_memory_bytes: int | None = default("kv_cache_memory_bytes")
    block_size: int = default("block_size")
    max_num_seqs: int = default("max_num_seqs")
    max_num_batched_tokens: int | None = default("max_num_batched_tokens")
    enable_prefix_caching: bool = default("enable_prefix_caching")
    enforce_eager: bool = default("enforce_eager")
    async_scheduling: bool = default("async_scheduling")
    seed: int = default("seed")
    chat_template: str | None = default("chat_template")
    generation_config: str = default("generation_config")
    skip_tokenizer_init: bool = default("skip_tokenizer_init")

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict, where: str) -> EngineArgs:
        """`where`(model, **kwargs) as a user wrote it: a name the engine does not act on is refused
        with the setting's name (and the layers that do use it)."""
        check_names(kwargs, ENGINE, where)
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        if not self.model:
            raise SettingError("model: give a local folder with config.json and safetensors")
        device = resolve_device(self.device)
        model = replace(load_model_config(model_path(self.model), self.dtype, self.max_model_len,
                                          self.skip_tokenizer_init, self.enforce_eager, device, self.quantization),
                        chat_template=self.chat_template, generation_config=self.generation_config)
        return EngineConfig(
            model=model,
            cache=CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=resolved_max_num_batched_tokens(
                                          self.max_num_batched_tokens, self.max_num_seqs),
                                      async_scheduling=self.async_scheduling),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size or 1,
                                    pipeline_parallel_size=self.pipeline_parallel_size or 1,
                                    distributed_executor_backend=self.distributed_executor_backend,
                                    layer_split=self.layer_split,
                                    enable_expert_parallel=bool(self.enable_expert_parallel)),
            device=device,
            seed=self.seed,
        )
