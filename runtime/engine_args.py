"""The runtime's options: the settings table's "engine" layer, shared by LLM, AsyncEngine and launch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Literal

from shardserve.planner.errors import PlanError
from shardserve.planner.hub import HubOptions
from shardserve.planner.model_source import local_weights, model_path
from shardserve.planner.lora import lora_problem
from shardserve.planner.rules import (offload_groups_problem, offload_problem, prefix_caching_problem,
                                     resolved_prefix_caching)
from shardserve.planner.settings import (ENGINE, SettingError, check_fields, check_names, default,
                                         resolved_max_num_batched_tokens)
from shardserve.planner.speculative import (SpeculativeConfig, draft_layout_problem, draft_pair_problem,
                                            eagle3_problem, mtp_problem, speculative_problem)
from shardserve.runtime.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig,
                                       SchedulerConfig, load_model_config, resolve_device)
from shardserve.runtime.pooling_params import PoolerConfig, pooler_config


@dataclass(frozen=True)
class EngineArgs:
    """The settings table's "engine" layer (planner/settings.py): fields in table order with the
    table's defaults (tests/planner/test_settings_classes.py keeps them equal), every value checked
    against the table when made. Tensor and pipeline parallel sizes left unset mean one rank each."""

    model: str | None = default("model")
    download_dir: str | None = default("download_dir")
    revision: str | None = default("revision")
    hf_token: str | None = field(default=default("hf_token"), repr=False)  # never in a log line
    device: str = default("device")
    tensor_parallel_size: int | None = default("tensor_parallel_size")
    pipeline_parallel_size: int | None = default("pipeline_parallel_size")
    distributed_executor_backend: str | None = default("distributed_executor_backend")
    enable_expert_parallel: bool | None = default("enable_expert_parallel")
    layer_split: tuple[int, ...] | None = default("layer_split")
    max_model_len: int | Literal["auto"] | None = default("max_model_len")
    dtype: str = default("dtype")
    quantization: str | None = default("quantization")
    load_format: str = default("load_format")
    kv_cache_dtype: str = default("kv_cache_dtype")
    gpu_memory_utilization: float = default("gpu_memory_utilization")
    kv_cache_memory_bytes: int | None = default("kv_cache_memory_bytes")
    block_size: int = default("block_size")
    max_num_seqs: int = default("max_num_seqs")
    max_num_batched_tokens: int | None = default("max_num_batched_tokens")
    enable_chunked_prefill: bool = default("enable_chunked_prefill")
    enable_prefix_caching: bool | None = default("enable_prefix_caching")
    kv_offloading_size: float | None = default("kv_offloading_size")
    enable_lora: bool = default("enable_lora")
    max_loras: int = default("max_loras")
    max_lora_rank: int = default("max_lora_rank")
    max_cpu_loras: int | None = default("max_cpu_loras")
    enforce_eager: bool = default("enforce_eager")
    async_scheduling: bool = default("async_scheduling")
    speculative_config: str | None = default("speculative_config")
    seed: int = default("seed")
    chat_template: str | None = default("chat_template")
    generation_config: str = default("generation_config")
    runner: str = default("runner")
    pooling_type: str | None = default("pooling_type")
    normalize: bool | None = default("normalize")
    skip_tokenizer_init: bool = default("skip_tokenizer_init")

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict, where: str) -> EngineArgs:
        """`where`(model, **kwargs) as a user wrote it: a name the engine does not act on is refused
        with the setting's name (and the layers that do use it)."""
        check_names(kwargs, ENGINE, where)
        return cls(model=model, **kwargs)

    def _pooler_config(self, folder: str) -> PoolerConfig | None:
        """runner pooling: the pooling a request gets by default; None for a generating engine (which
        refuses pooling settings by name rather than ignore them)."""
        if self.runner == "pooling":
            return pooler_config(folder, self.pooling_type, self.normalize)
        for name in ("pooling_type", "normalize"):
            if getattr(self, name) is not None:
                raise SettingError(f"{name} applies to runner='pooling' (--runner pooling); this engine's runner "
                                   f"is {self.runner!r}")
        return None

    @property
    def hub(self) -> HubOptions:
        return HubOptions.of(self)

    def local_folder(self) -> str:
        """The model's folder: as given, else a Hub id's snapshot in the Hugging Face cache, downloaded as
        `launch` downloads it when the cache lacks it (the same files and errors; load_format dummy: config
        and tokenizer only)."""
        if not self.model:
            raise SettingError("model: give a local folder with config.json and safetensors, or a Hub id")
        folder = model_path(self.model)
        return folder if os.path.isdir(folder) else str(local_weights(self.model, self.hub, self.load_format))

    def create_engine_config(self) -> EngineConfig:
        folder = self.local_folder()
        device = resolve_device(self.device)
        loaded = load_model_config(folder, self.dtype, self.max_model_len, self.skip_tokenizer_init,
                                   self.enforce_eager, device, self.quantization)
        kind = loaded.recurrent_kind
        prefix_caching = resolved_prefix_caching(self.enable_prefix_caching, kind)
        problem = (prefix_caching_problem(self.enable_prefix_caching, kind)
                   or offload_problem(prefix_caching, self.kv_offloading_size)
                   or offload_groups_problem(self.kv_offloading_size, loaded.kv_groups.windows))
        if problem:
            raise SettingError(problem)
        model = replace(loaded, chat_template=self.chat_template, generation_config=self.generation_config,
                        load_format=self.load_format, hub=self.hub,
                        pooler=self._pooler_config(loaded.model))
        speculative = self._speculative(model)
        return EngineConfig(
            model=model,
            cache=CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              enable_prefix_caching=prefix_caching,
                              kv_offloading_size=self.kv_offloading_size,
                              kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=resolved_max_num_batched_tokens(
                                          self.max_num_batched_tokens, self.max_num_seqs),
                                      async_scheduling=self.async_scheduling,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      speculative=speculative),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size or 1,
                                    pipeline_parallel_size=self.pipeline_parallel_size or 1,
                                    distributed_executor_backend=self.distributed_executor_backend,
                                    layer_split=self.layer_split,
                                    enable_expert_parallel=bool(self.enable_expert_parallel)),
            device=device,
            seed=self.seed,
            lora=self._lora_config(model),
            draft=self._draft_model(speculative, model, device),
        )

    def _draft_model(self, spec: SpeculativeConfig | None, model: ModelConfig, device: str) -> ModelConfig | None:
        """speculative_config's draft model (method draft_model) or EAGLE-3 head (eagle3): its config read as the
        target's, in the target's dtype, for its max_model_len (the model's own for its MTP layer, method mtp); a
        SettingError names what keeps it from drafting for this target."""
        if spec is None or spec.method == "ngram":
            return None
        problem = draft_layout_problem(spec.method, self.pipeline_parallel_size or 1, self.kv_offloading_size)
        if spec.method == "mtp":  # the model's own layer, from its folder
            problem = problem or mtp_problem(model.architecture, model.hf_config.to_dict())
        if problem:
            raise SettingError(problem)
        if spec.model is None:
            return model
        is_head = spec.method == "eagle3"
        try:
            folder = str(local_weights(spec.model, self.hub, self.load_format))
            # (a head's own positions do not bound the model's: its one layer rotates with its config's rope)
            draft = load_model_config(folder, str(model.dtype).removeprefix("torch."),
                                      None if is_head else model.max_model_len, True, True, device)
        except (ValueError, PlanError) as e:
            raise SettingError(f"speculative_config: the draft model {spec.model}: {e}") from None
        if is_head:
            problem = eagle3_problem(draft.hf_config.to_dict(), model.vocab_size, model.hf_config.hidden_size,
                                     model.num_layers, model.architecture, model.kv_groups.num_groups)
        else:
            problem = draft_pair_problem(draft.vocab_size, model.vocab_size, max(
                draft.kv_groups.num_groups, model.kv_groups.num_groups), draft.recurrent_kind)
        if problem:
            raise SettingError(f"speculative_config: the draft model {spec.model} cannot draft here: {problem}")
        return replace(draft, load_format=self.load_format, hub=self.hub, max_model_len=model.max_model_len)

    def _speculative(self, model: ModelConfig) -> SpeculativeConfig | None:
        """speculative_config, or a SettingError naming what it cannot run with."""
        try:
            spec = SpeculativeConfig.parse(self.speculative_config)
        except ValueError as e:
            raise SettingError(str(e)) from None
        problem = None if spec is None else speculative_problem(self.async_scheduling,
                                                                model.runner == "pooling")
        if problem:
            raise SettingError(problem)
        return spec

    def _lora_config(self, model: ModelConfig) -> LoRAConfig | None:
        """enable_lora's slots; its settings without it are refused by name rather than ignored."""
        if not self.enable_lora:
            for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                if getattr(self, name) != default(name):
                    raise SettingError(f"{name} applies with enable_lora=True (--enable-lora)")
            return None
        problem = lora_problem(model.architecture, self.max_loras, self.max_cpu_loras) or (
            "enable_lora serves generation, not runner='pooling'" if model.runner == "pooling" else None)
        if problem:
            raise SettingError(problem)
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)
