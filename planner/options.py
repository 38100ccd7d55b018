"""Planner options, named as vLLM names them, and the runtime settings they resolve to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardserve.planner.errors import PlanError
from shardserve.planner.hardware import GpuSpec
from shardserve.planner.lora import lora_problem
from shardserve.planner.model_spec import DTYPE_BYTES, ModelSpec, canonical_dtype
from shardserve.planner.rules import (fp8_kv_problem, offload_groups_problem, offload_problem, offload_size_problem,
                                     prefix_caching_problem,
                                     resolved_prefix_caching)
from shardserve.planner.speculative import HEAD_METHODS, SpeculativeConfig, resolve, tokens_per_step
from shardserve.planner.workload import Targets, Workload
from shardserve.planner.settings import (DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN,
                                         SettingError, check_fields, default, resolved_max_num_batched_tokens)


@dataclass(frozen=True)
class PlanOptions:
    """The planner's options: the settings table's "plan" layer (planner/settings.py), in table order
    with the table's defaults (tests/planner/test_settings_classes.py keeps them equal), each value
    checked against the table when made."""

    tensor_parallel_size: int | None = default("tensor_parallel_size")
    pipeline_parallel_size: int | None = default("pipeline_parallel_size")
    data_parallel_size: int | None = default("data_parallel_size")
    distributed_executor_backend: str | None = default("distributed_executor_backend")
    enable_expert_parallel: bool | None = default("enable_expert_parallel")
    max_model_len: int | Literal["auto"] | None = default("max_model_len")
    dtype: str = default("dtype")
    quantization: str | None = default("quantization")
    kv_cache_dtype: str = default("kv_cache_dtype")
    gpu_memory_utilization: float = default("gpu_memory_utilization")
    kv_cache_memory_bytes: int | None = default("kv_cache_memory_bytes")
    block_size: int = default("block_size")
    max_num_seqs: int = default("max_num_seqs")
    max_num_batched_tokens: int | None = default("max_num_batched_tokens")
    enable_prefix_caching: bool | None = default("enable_prefix_caching")
    kv_offloading_size: float | None = default("kv_offloading_size")
    enable_lora: bool = default("enable_lora")
    max_loras: int = default("max_loras")
    max_lora_rank: int = default("max_lora_rank")
    enforce_eager: bool = default("enforce_eager")
    speculative_config: str | None = default("speculative_config")
    target_concurrency: int = default("target_concurrency")
    input_len: int | None = default("input_len")
    output_len: int | None = default("output_len")
    prefix_len: int = default("prefix_len")
    concurrency: float | None = default("concurrency")
    request_rate: float | None = default("request_rate")
    draft_acceptance_rate: float | None = default("draft_acceptance_rate")
    ttft_ms: float | None = default("ttft_ms")
    tpot_ms: float | None = default("tpot_ms")
    target_percentile: int = default("target_percentile")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class RuntimeSettings:
    """What the runtime will run with, resolved from the options, the model and the GPU."""

    dtype: str
    quantization: str | None  # the --quantization override
    kv_cache_dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None
    enforce_eager: bool = False
    is_max_model_len_auto: bool = False  # max_model_len is the model's limit until a layout fits it
    kv_offloading_size: float | None = None  # GiB of host memory per replica for the CPU tier
    enable_lora: bool = False
    max_loras: int = default("max_loras")  # adapter slots on every rank (with enable_lora)
    max_lora_rank: int = default("max_lora_rank")  # each slot's rank
    speculative: SpeculativeConfig | None = None  # speculative_config, parsed
    draft_acceptance_rate: float | None = None  # with speculative: the rate given, or its method's default

    @property
    def tokens_per_step(self) -> float:
        """A decoding request's tokens per forward: 1, or with speculation 1 + a + ... + a^k."""
        if self.speculative is None or self.draft_acceptance_rate is None:
            return 1.0
        return tokens_per_step(self.speculative.num_speculative_tokens, self.draft_acceptance_rate)

    @property
    def num_drafts(self) -> int:
        """The drafts each decoding request verifies per step (0: no speculation)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    @property
    def graphs_captured(self) -> bool:
        """Decode CUDA graphs on a GPU (LoRA steps run eagerly: their adapters change per batch; with an EAGLE-3
        head or MTP layer every step does: it reads the hidden states each step's layers take)."""
        head = self.speculative is not None and self.speculative.method in HEAD_METHODS
        return not self.enforce_eager and not self.enable_lora and not head

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_dtype_bytes(self) -> int:
        return 1 if self.is_fp8_kv else DTYPE_BYTES[self.dtype]

    @property
    def is_fp8_kv(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")


def resolve_settings(options: PlanOptions, spec: ModelSpec, gpu: GpuSpec) -> RuntimeSettings:
    dtype = _resolve_dtype(options.dtype, spec, gpu)
    is_fp8_kv = options.kv_cache_dtype.startswith("fp8")
    prefix_caching = resolved_prefix_caching(options.enable_prefix_caching, spec.recurrent_kind)
    problem = (fp8_kv_problem(options.kv_cache_dtype, gpu.name, gpu.has_fp8 or gpu.is_cpu)
               or prefix_caching_problem(options.enable_prefix_caching, spec.recurrent_kind)
               or offload_problem(prefix_caching, options.kv_offloading_size)
               or offload_groups_problem(options.kv_offloading_size, spec.kv_groups.windows)
               or (lora_problem(spec.architecture, options.max_loras, None) if options.enable_lora else None))
    if problem:
        raise PlanError(problem)
    is_auto = options.max_model_len == "auto"
    max_len = spec.max_context_len if options.max_model_len == "auto" else options.max_model_len or spec.max_context_len
    if max_len > spec.max_context_len:
        raise PlanError(f"max_model_len {max_len} is beyond the model's "
                        f"{spec.max_context_len} positions: lower --max-model-len")
    batched = resolved_max_num_batched_tokens(options.max_num_batched_tokens, options.max_num_seqs)
    kv_pool = options.kv_cache_memory_bytes
    if gpu.is_cpu and kv_pool is None:
        kv_pool = DEFAULT_CPU_KV_CACHE_BYTES
    kv_bytes = 1 if is_fp8_kv else DTYPE_BYTES[dtype]  # a block of every layer and KV head: the least a tier needs
    problem = offload_size_problem(options.kv_offloading_size, options.block_size * spec.kv_bytes_per_token(kv_bytes), 1)
    if problem:
        raise PlanError(problem)
    return RuntimeSettings(
        dtype=dtype, quantization=options.quantization, kv_cache_dtype=options.kv_cache_dtype if is_fp8_kv else dtype,
        max_model_len=max_len, max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=batched, block_size=options.block_size,
        gpu_memory_utilization=options.gpu_memory_utilization,
        enable_prefix_caching=prefix_caching, kv_cache_memory_bytes=kv_pool,
        enforce_eager=options.enforce_eager, is_max_model_len_auto=is_auto,
        kv_offloading_size=options.kv_offloading_size, enable_lora=options.enable_lora,
        max_loras=options.max_loras, max_lora_rank=options.max_lora_rank,
        **_speculation(options))


def _speculation(options: PlanOptions) -> dict:
    """RuntimeSettings' speculative and draft_acceptance_rate, or a PlanError naming the setting to change."""
    try:
        config, rate = resolve(options.speculative_config, options.draft_acceptance_rate)
    except ValueError as e:
        raise PlanError(str(e)) from None
    return {"speculative": config, "draft_acceptance_rate": rate}


def _resolve_dtype(requested: str, spec: ModelSpec, gpu: GpuSpec) -> str:
    if requested == "auto":
        if gpu.is_cpu:
            return "float32"  # the CPU runtime computes in float32
        return "bfloat16" if gpu.has_bf16 else "float16"
    dtype = canonical_dtype(requested)
    if dtype == "bfloat16" and not gpu.has_bf16:
        raise PlanError(f"{gpu.name} has no bfloat16 support: use --dtype float16")
    return dtype


def resolve_workload(options: PlanOptions, max_model_len: int) -> Workload:
    """The traffic a plan is for: the options' lengths and load, defaults fitted to max_model_len.
    Without --concurrency or --request-rate, full batches (concurrency None)."""
    if options.concurrency is not None and options.request_rate is not None:
        raise SettingError("concurrency and request_rate both given: a closed loop of --concurrency "
                           "requests or --request-rate arrivals per second, not both")
    input_len = options.input_len or min(DEFAULT_INPUT_LEN, max(1, max_model_len * 3 // 4))
    output_len = options.output_len or max(1, min(DEFAULT_OUTPUT_LEN, max_model_len - input_len))
    if input_len + output_len > max_model_len:
        raise SettingError(f"input_len {input_len} + output_len {output_len} = {input_len + output_len} tokens "
                           f"is beyond max_model_len {max_model_len}: shorten them or raise --max-model-len")
    if options.prefix_len >= input_len:
        raise SettingError(f"prefix_len {options.prefix_len} must be below input_len {input_len} (the shared "
                           "prefix is part of every prompt)")
    return Workload(input_len, output_len, options.prefix_len, options.concurrency, options.request_rate,
                    options.target_percentile)


def resolve_targets(options: PlanOptions) -> Targets:
    return Targets(options.ttft_ms, options.tpot_ms)
