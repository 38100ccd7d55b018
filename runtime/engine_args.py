"""The runtime's options: the settings table's "engine" layer, shared by LLM, AsyncEngine and launch."""

from __future__ import annotations

from dataclasses import replace

from shardserve.planner.model_source import model_path
from shardserve.planner.settings import ENGINE, SettingError, check_names, resolved_max_num_batched_tokens, settings_dataclass
from shardserve.runtime.config import (CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, load_model_config,
                                       resolve_device)


class EngineArgs(settings_dataclass(ENGINE, "EngineArgsFields")):
    """Every field, default and check comes from planner/settings.py; tensor and pipeline parallel
    sizes left unset mean one rank each."""

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
