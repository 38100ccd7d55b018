"""Per-GPU memory model: weights, activation peak, overhead, and the KV cache left over."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.graph_memory import GraphShape, cuda_graph_bytes
from shardserve.planner.hardware import GIB, GpuSpec
from shardserve.planner.linear_attention import recurrent_state_bytes, recurrent_state_slots, state_copies
from shardserve.planner.kv_groups import kv_tokens, longest_fitting_len, max_pages_per_request, pages_without_kv
from shardserve.planner.lora import slot_bytes
from shardserve.planner.model_spec import ModelSpec, kv_heads_per_rank
from shardserve.planner.options import RuntimeSettings
from shardserve.planner.rules import offload_blocks

# NOTE: outside torch's allocator a CUDA process holds its context, cuBLAS workspaces and
# NCCL's buffers. These are the sizes seen on Hopper-class GPUs with recent drivers; the runtime
# measures the real ones at start-up. CUDA graphs: graph_memory.py, per stage.
CUDA_CONTEXT_BYTES = GIB // 2
NCCL_BASE_BYTES = GIB // 8       # communicator setup, once a process joins a group
NCCL_PEER_BYTES = 64 * 2**20     # channel buffers per tensor-parallel peer
NCCL_PP_BYTES = GIB // 8
CPU_PROCESS_BYTES = GIB // 4
# NOTE: a stage whose layers are all linear attention caches no KV: it bounds no block count (the other
# stages do); a block count this large is never reached
UNBOUNDED_BLOCKS = 2**40


@dataclass(frozen=True)
class StageMemory:
    """One GPU of one pipeline stage (every tensor-parallel rank of a stage is alike)."""

    total_bytes: int
    weights_bytes: int
    activation_bytes: int
    overhead_bytes: int
    kv_budget_bytes: int       # what is left for the KV cache; negative when over budget
    kv_bytes_per_token: int    # this GPU's layers and KV heads (linear-attention layers cache none)
    num_layers: int
    lora_bytes: int = 0        # the LoRA adapter slots (enable_lora)
    recurrent_state_bytes: int = 0  # linear-attention layers' state, max_num_seqs + 1 rows (before the KV)

    def num_blocks_fit(self, block_size: int) -> int:
        if not self.kv_bytes_per_token:
            return UNBOUNDED_BLOCKS if self.kv_budget_bytes >= 0 else 0
        return max(0, self.kv_budget_bytes) // (self.kv_bytes_per_token * block_size)


@dataclass(frozen=True)
class MemoryPlan:
    stages: tuple[StageMemory, ...]
    num_blocks: int
    block_size: int
    # each KV group's window (planner/kv_groups.py): a page holds a block of a group's layers
    windows: tuple[int | None, ...] = (None,)
    max_chunk: int = 1  # the most tokens a request computes in one step (max_num_batched_tokens)
    num_offload_blocks: int = 0  # the CPU tier's blocks (kv_offloading_size), per replica
    offload_bytes: int = 0  # the host memory they take, per replica

    @property
    def kv_cache_tokens(self) -> int:
        """The pool's pages times block_size: every group's blocks counted as tokens (the serving model's)."""
        return self.num_blocks * self.block_size

    def kv_tokens(self, max_model_len: int) -> int:
        """Tokens the pool holds as requests of max_model_len (kv_groups.kv_tokens)."""
        return kv_tokens(self.num_blocks, self.block_size, self.windows, self.max_chunk, max_model_len)

    @property
    def offload_tokens(self) -> int:
        return self.num_offload_blocks * self.block_size

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.windows)

    def blocks_per_request(self, max_model_len: int) -> int:
        return max_pages_per_request(self.windows, max_model_len, self.block_size, self.max_chunk)

    def max_concurrency(self, max_model_len: int) -> float:
        """Requests of max_model_len tokens the pool holds at once (as the block manager counts)."""
        return self.num_blocks / self.blocks_per_request(max_model_len)

    def longest_fitting_len(self, limit: int, num_requests: int) -> int | None:
        return longest_fitting_len(self.num_blocks, self.block_size, self.windows, self.max_chunk, limit,
                                   num_requests)

    @property
    def tightest(self) -> StageMemory:
        return min(self.stages, key=lambda s: (s.num_blocks_fit(self.block_size),
                                                 -s.weights_bytes))

    def kv_cache_bytes(self, stage: StageMemory) -> int:
        return self.num_blocks * self.block_size * stage.kv_bytes_per_token



def attention_width_per_token(spec: ModelSpec, tp: int) -> int:
    """One token's attention activations on a rank: q, k and v; under MLA the query, the cache entry,
    the absorbed query and the latent output of each head (attention/mla.py)."""
    if spec.mla:
        m = spec.mla
        return spec.num_attention_heads // tp * (m.qk_nope_head_dim + m.qk_rope_head_dim + 2 * m.cache_width) \
            + m.cache_width
    gate = spec.num_attention_heads // tp if spec.has_attention_output_gate else 0  # q_proj's output gate
    width = (spec.num_attention_heads // tp + gate + 2 * kv_heads_per_rank(spec, tp)) * spec.head_dim
    if spec.linear_attention:  # the widest of the two kinds of layer (Gated DeltaNet: q, k, v, z, b, a)
        width = max(width, spec.linear_attention.projection_width(tp))
    return width


def activation_bytes_per_token(spec: ModelSpec, tp: int, dtype_bytes: int, expert_parallel: bool = False) -> int:
    """One token's share of a forward's peak activations on one rank."""
    qkv = attention_width_per_token(spec, tp)
    if spec.is_moe:
        # the fused MoE kernel's buffers, a row per (token, k) pair: SiLU(gate) * up over the rank's
        # features of an expert (all of them when experts are whole per rank) and the down output
        assert spec.moe_intermediate_size is not None and spec.num_experts_per_tok is not None
        width = spec.moe_intermediate_size if expert_parallel else spec.moe_intermediate_size // tp
        mlp = spec.num_experts_per_tok * (width + spec.hidden_size)
        mlp += 2 * (spec.shared_expert_intermediate_size or 0) // tp
    else:
        mlp = (2 if spec.is_gated_mlp else 1) * spec.intermediate_size // tp
    # residual, hidden states and normed input live beside the widest projection output
    return (3 * spec.hidden_size + qkv + mlp) * dtype_bytes


def activation_bytes(spec: ModelSpec, tp: int, settings: RuntimeSettings, is_last: bool,
                     expert_parallel: bool = False) -> int:
    """Peak activations of one forward pass over max_num_batched_tokens, on one rank."""
    per_token = activation_bytes_per_token(spec, tp, settings.dtype_bytes, expert_parallel)
    peak = settings.max_num_batched_tokens * per_token
    if is_last:  # logits for the sampled positions, in the dtype and then float32
        peak += settings.max_num_seqs * spec.vocab_size * (settings.dtype_bytes + 4)
    return peak


def overhead_bytes(gpu: GpuSpec, tp: int, pp: int) -> int:
    if gpu.is_cpu:
        return CPU_PROCESS_BYTES
    nccl = NCCL_BASE_BYTES + NCCL_PEER_BYTES * (tp - 1) if tp > 1 else 0
    return CUDA_CONTEXT_BYTES + nccl + (NCCL_PP_BYTES if pp > 1 else 0)


def graph_shape(spec: ModelSpec, tp: int, settings: RuntimeSettings, num_layers: int,
                is_first_stage: bool, expert_parallel: bool = False) -> GraphShape:
    """The decode graphs of one rank of a stage with num_layers layers."""
    per_token = activation_bytes_per_token(spec, tp, settings.dtype_bytes, expert_parallel)
    return GraphShape(settings.max_num_seqs, settings.max_model_len, settings.block_size, spec.hidden_size,
                      settings.dtype_bytes, num_layers, per_token, is_first_stage)


def plan_memory(spec: ModelSpec, stage_weights: list[float], split: list[int], tp: int,
                gpu: GpuSpec, settings: RuntimeSettings, expert_parallel: bool = False,
                draft: tuple[int, int] = (0, 0)) -> MemoryPlan:
    """`draft`: a draft model's (weights bytes, KV bytes per token) on each rank of the first stage."""
    pp = len(split)
    stages = []
    usable = int(gpu.memory_bytes * settings.gpu_memory_utilization)
    starts = [sum(split[:s]) for s in range(pp)]
    for s, (weights, layers) in enumerate(zip(stage_weights, split)):
        weights += draft[0] if s == 0 else 0
        owned = range(starts[s], starts[s] + layers)
        state = recurrent_state_bytes(spec, tp, owned, recurrent_state_slots(settings.max_num_seqs)
                                      * state_copies(settings.num_drafts), settings.dtype_bytes)
        act = activation_bytes(spec, tp, settings, is_last=s == pp - 1, expert_parallel=expert_parallel)
        over = overhead_bytes(gpu, tp, pp)
        if not gpu.is_cpu and settings.graphs_captured:
            over += cuda_graph_bytes(graph_shape(spec, tp, settings, layers, s == 0, expert_parallel))
        lora = settings.max_loras * slot_bytes(spec, tp, layers, settings.max_lora_rank, settings.dtype_bytes) \
            if settings.enable_lora else 0
        budget = usable - int(weights) - act - over - lora - state
        if settings.kv_cache_memory_bytes is not None:  # (the cache as vLLM counts it: the state too)
            budget = min(budget, settings.kv_cache_memory_bytes - state)
        # a page spans the KV tensors of the stage's attention layers (one per layer, or a group's slots)
        per_token = spec.kv_groups.tensors_on(owned) * spec.kv_values_per_layer(tp) * settings.kv_dtype_bytes
        per_token += draft[1] if s == 0 else 0
        stages.append(StageMemory(gpu.memory_bytes, int(weights), act, over, budget,
                                  per_token, layers, lora, state))
    num_blocks = min(s.num_blocks_fit(settings.block_size) for s in stages)
    if num_blocks == UNBOUNDED_BLOCKS:  # no layer keeps KV: pages cost nothing (as the runtime sizes them)
        num_blocks = pages_without_kv(settings.max_num_seqs, spec.kv_groups.windows, settings.max_model_len,
                                      settings.block_size, settings.max_num_batched_tokens)
    rank_block = max(s.kv_bytes_per_token for s in stages) * settings.block_size
    offloaded = offload_blocks(settings.kv_offloading_size, rank_block, tp * pp) if rank_block else 0
    return MemoryPlan(tuple(stages), num_blocks, settings.block_size, spec.kv_groups.windows,
                      settings.max_num_batched_tokens, offloaded, offloaded * rank_block * tp * pp)
