"""Per-GPU memory model: weights, activation peak, overhead, and the KV cache left over."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.graph_memory import GraphShape, cuda_graph_bytes
from shardserve.planner.hardware import GIB, GpuSpec
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.options import RuntimeSettings

# NOTE: outside torch's allocator a CUDA process holds its context, cuBLAS workspaces and
# NCCL's buffers. These are the sizes seen on Hopper-class GPUs with recent drivers; the runtime
# measures the real ones at start-up. CUDA graphs: graph_memory.py, per stage.
CUDA_CONTEXT_BYTES = GIB // 2
NCCL_BASE_BYTES = GIB // 8       # communicator setup, once a process joins a group
NCCL_PEER_BYTES = 64 * 2**20     # channel buffers per tensor-parallel peer
NCCL_PP_BYTES = GIB // 8
CPU_PROCESS_BYTES = GIB // 4


@dataclass(frozen=True)
class StageMemory:
    """One GPU of one pipeline stage (every tensor-parallel rank of a stage is alike)."""

    total_bytes: int
    weights_bytes: int
    activation_bytes: int
    overhead_bytes: int
    kv_budget_bytes: int       # what is left for the KV cache; negative when over budget
    kv_bytes_per_token: int    # this GPU's layers and KV heads
    num_layers: int

    def num_blocks_fit(self, block_size: int) -> int:
        return max(0, self.kv_budget_bytes) // (self.kv_bytes_per_token * block_size)


@dataclass(frozen=True)
class MemoryPlan:
    stages: tuple[StageMemory, ...]
    num_blocks: int
    block_size: int

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, max_model_len: int) -> float:
        return self.kv_cache_tokens / max_model_len

    @property
    def tightest(self) -> StageMemory:
        return min(self.stages, key=lambda s: (s.num_blocks_fit(self.block_size),
                                                 -s.weights_bytes))

    def kv_cache_bytes(self, stage: StageMemory) -> int:
        return self.num_blocks * self.block_size * stage.kv_bytes_per_token


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    return max(1, spec.num_kv_heads // tp)


def activation_bytes_per_token(spec: ModelSpec, tp: int, dtype_bytes: int) -> int:
    """One token's share of a forward's peak activations on one rank."""
    d = spec.head_dim
    qkv = (spec.num_attention_heads // tp + 2 * kv_heads_per_rank(spec, tp)) * d
    if spec.is_moe:
        mlp = 2 * spec.num_experts_per_tok * spec.moe_intermediate_size // tp
        mlp += 2 * (spec.shared_expert_intermediate_size or 0) // tp
    else:
        mlp = (2 if spec.is_gated_mlp else 1) * spec.intermediate_size // tp
    # residual, hidden states and normed input live beside the widest projection output
    return (3 * spec.hidden_size + qkv + mlp) * dtype_bytes


def activation_bytes(spec: ModelSpec, tp: int, settings: RuntimeSettings, is_last: bool) -> int:
    """Peak activations of one forward pass over max_num_batched_tokens, on one rank."""
    peak = settings.max_num_batched_tokens * activation_bytes_per_token(spec, tp, settings.dtype_bytes)
    if is_last:  # logits for the sampled positions, in the dtype and then float32
        peak += settings.max_num_seqs * spec.vocab_size * (settings.dtype_bytes + 4)
    return peak


def overhead_bytes(gpu: GpuSpec, tp: int, pp: int) -> int:
    if gpu.is_cpu:
        return CPU_PROCESS_BYTES
    nccl = NCCL_BASE_BYTES + NCCL_PEER_BYTES * (tp - 1) if tp > 1 else 0
    return CUDA_CONTEXT_BYTES + nccl + (NCCL_PP_BYTES if pp > 1 else 0)


def graph_shape(spec: ModelSpec, tp: int, settings: RuntimeSettings, num_layers: int,
                is_first_stage: bool) -> GraphShape:
    """The decode graphs of one rank of a stage with num_layers layers."""
    return GraphShape(settings.max_num_seqs, settings.max_model_len, settings.block_size, spec.hidden_size,
                      settings.dtype_bytes, num_layers, activation_bytes_per_token(spec, tp, settings.dtype_bytes),
                      is_first_stage)


def plan_memory(spec: ModelSpec, stage_weights: list[float], split: list[int], tp: int,
                gpu: GpuSpec, settings: RuntimeSettings) -> MemoryPlan:
    pp = len(split)
    stages = []
    usable = int(gpu.memory_bytes * settings.gpu_memory_utilization)
    for s, (weights, layers) in enumerate(zip(stage_weights, split)):
        act = activation_bytes(spec, tp, settings, is_last=s == pp - 1)
        over = overhead_bytes(gpu, tp, pp)
        if not gpu.is_cpu:  # NOTE: reserved even under enforce_eager, which the planner is not told of
            over += cuda_graph_bytes(graph_shape(spec, tp, settings, layers, is_first_stage=s == 0))
        budget = usable - int(weights) - act - over
        if settings.kv_cache_memory_bytes is not None:
            budget = min(budget, settings.kv_cache_memory_bytes)
        per_token = 2 * layers * kv_heads_per_rank(spec, tp) * spec.head_dim
        per_token *= settings.kv_dtype_bytes
        stages.append(StageMemory(gpu.memory_bytes, int(weights), act, over, budget,
                                  per_token, layers))
    num_blocks = min(s.num_blocks_fit(settings.block_size) for s in stages)
    return MemoryPlan(tuple(stages), num_blocks, settings.block_size)
