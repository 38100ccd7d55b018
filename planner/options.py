"""Planner options, named as vLLM names them, and the runtime settings they resolve to."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.errors import PlanError
from shardserve.planner.hardware import GIB, GpuSpec
from shardserve.planner.model_spec import DTYPE_BYTES, ModelSpec, canonical_dtype

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_CPU_KV_CACHE_BYTES = 2 * GIB  # the runtime's default pool on CPU


@dataclass(frozen=True)
class PlanOptions:
    max_model_len: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    distributed_executor_backend: str | None = None
    target_concurrency: int = 1
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # CPU only: the KV pool per rank

    def validate(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanError(f"gpu_memory_utilization {self.gpu_memory_utilization} must be in "
                            "(0, 1]; 0.9 leaves 10% for other processes")
        if self.block_size not in (1, 8, 16, 32, 64, 128):
            raise PlanError(f"block_size {self.block_size} must be one of 1, 8, 16, 32, 64, 128")
        for name in ("max_model_len", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size", "data_parallel_size", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PlanError(f"{name} must be at least 1 (got {value})")
        if self.max_num_seqs < 1 or self.target_concurrency < 1:
            raise PlanError("max_num_seqs and target_concurrency must be at least 1")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise PlanError(f"kv_cache_dtype {self.kv_cache_dtype!r}: use auto or fp8")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise PlanError(f"distributed_executor_backend {self.distributed_executor_backend!r}:"
                            " use mp or ray")


@dataclass(frozen=True)
class RuntimeSettings:
    """What the runtime will run with, resolved from the options, the model and the GPU."""

    dtype: str
    kv_cache_dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_dtype_bytes(self) -> int:
        return 1 if self.kv_cache_dtype == "fp8" else DTYPE_BYTES[self.dtype]


def resolve_settings(options: PlanOptions, spec: ModelSpec, gpu: GpuSpec) -> RuntimeSettings:
    dtype = _resolve_dtype(options.dtype, spec, gpu)
    if options.kv_cache_dtype == "fp8" and not (gpu.has_fp8 or gpu.is_cpu):
        raise PlanError(f"kv_cache_dtype fp8 needs a GPU with fp8 support; {gpu.name} has none")
    max_len = options.max_model_len or spec.max_position_embeddings
    if max_len > spec.max_position_embeddings:
        raise PlanError(f"max_model_len {max_len} is beyond the model's "
                        f"{spec.max_position_embeddings} positions: lower --max-model-len")
    batched = options.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                    options.max_num_seqs)
    if batched < options.max_num_seqs:
        raise PlanError(f"max_num_batched_tokens {batched} is below max_num_seqs "
                        f"{options.max_num_seqs}: raise it or lower --max-num-seqs")
    kv_pool = options.kv_cache_memory_bytes
    if gpu.is_cpu and kv_pool is None:
        kv_pool = DEFAULT_CPU_KV_CACHE_BYTES
    return RuntimeSettings(
        dtype=dtype, kv_cache_dtype=options.kv_cache_dtype if options.kv_cache_dtype == "fp8"
        else dtype, max_model_len=max_len, max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=batched, block_size=options.block_size,
        gpu_memory_utilization=options.gpu_memory_utilization,
        enable_prefix_caching=options.enable_prefix_caching, kv_cache_memory_bytes=kv_pool)


def _resolve_dtype(requested: str, spec: ModelSpec, gpu: GpuSpec) -> str:
    if requested == "auto":
        if gpu.is_cpu:
            return "float32"  # the CPU runtime computes in float32
        return "bfloat16" if gpu.has_bf16 else "float16"
    dtype = canonical_dtype(requested)
    if dtype == "bfloat16" and not gpu.has_bf16:
        raise PlanError(f"{gpu.name} has no bfloat16 support: use --dtype float16")
    return dtype
