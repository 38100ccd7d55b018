"""Per-GPU memory model: weights, activation peak, overhead, and the KV cache left over."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.graph_memory import GraphShape, cuda_graph_bytes
from shardserve.planner.hardware import GIB, GpuSpec
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
    lora_bytes: int = 0        # the LoRA adapter slots (enable_lora)

    def num_blocks_fit(self, block_size: int) -> int:
        return max(0, self.kv_budget_bytes) // (self.kv_bytes_per_token * block_size)


def max_blocks_per_request(num_tokens: int, block_size: int, window: int | None, max_chunk: int) -> int:
    """The most KV blocks one request computing `num_tokens` tokens in chunks of at most `max_chunk`
    holds at once, as runtime/core/block_manager.py allocates them (planner and runtime share this rule).
    Without a window: every block. With one, a step computing tokens [c, c + n) holds blocks
    floor((c - window + 1) / block_size) .. ceil((c + n) / block_size) - 1:

        positions:  0 .. c-w | c-w+1 ........ c-1 | c ..... c+n-1
                    freed    | seen by query c    | this step's chunk
                    (whole blocks only: a block straddling c-w+1 stays)

    The largest count over every c: a chunk starting where freeing has not begun (c < window - 1),
    one whose oldest seen token is the last of its block, or the request's last chunk."""
    full = -(-num_tokens // block_size)
    if window is None or window >= num_tokens:
        return full
    chunk = min(max_chunk, num_tokens)
    unfreed = min(window - 2, num_tokens - chunk)  # the largest full-size chunk's c before freeing starts
    best = -(-(unfreed + chunk) // block_size) if unfreed >= 0 else 0
    last = num_tokens - chunk - window + 1  # the largest c - window + 1 among full-size chunks
    if last >= 0:
        best = max(best, -(-(min(last, block_size - 1) + window - 1 + chunk) // block_size))
    first_short = max(0, num_tokens - chunk + 1)  # chunks from here on are cut short by num_tokens
    if first_short <= num_tokens - 1:
        best = max(best, full - max(0, first_short - window + 1) // block_size)
    return best


def longest_fitting_len(num_blocks: int, block_size: int, window: int | None, max_chunk: int, limit: int,
                        num_requests: int = 1) -> int | None:
    """`--max-model-len auto`: the longest max_model_len, at most `limit` (the model's), for which
    `num_requests` requests fit in `num_blocks` at once; None when not even one token does."""
    def fits(length: int) -> bool:
        return num_requests * max_blocks_per_request(length, block_size, window, max_chunk) <= num_blocks

    if not fits(1):
        return None
    low, high = 1, limit  # fits(low); the count grows with the length, so bisect
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


@dataclass(frozen=True)
class MemoryPlan:
    stages: tuple[StageMemory, ...]
    num_blocks: int
    block_size: int
    window: int | None = None  # the window every layer applies (KV behind it is freed); None: none
    max_chunk: int = 1  # the most tokens a request computes in one step (max_num_batched_tokens)
    num_offload_blocks: int = 0  # the CPU tier's blocks (kv_offloading_size), per replica
    offload_bytes: int = 0  # the host memory they take, per replica

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def offload_tokens(self) -> int:
        return self.num_offload_blocks * self.block_size

    def blocks_per_request(self, max_model_len: int) -> int:
        return max_blocks_per_request(max_model_len, self.block_size, self.window, self.max_chunk)

    def max_concurrency(self, max_model_len: int) -> float:
        """Requests of max_model_len tokens the pool holds at once (as the block manager counts)."""
        return self.num_blocks / self.blocks_per_request(max_model_len)

    def longest_fitting_len(self, limit: int, num_requests: int) -> int | None:
        return longest_fitting_len(self.num_blocks, self.block_size, self.window, self.max_chunk, limit,
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
    return (spec.num_attention_heads // tp + 2 * kv_heads_per_rank(spec, tp)) * spec.head_dim


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
                gpu: GpuSpec, settings: RuntimeSettings, expert_parallel: bool = False) -> MemoryPlan:
    pp = len(split)
    stages = []
    usable = int(gpu.memory_bytes * settings.gpu_memory_utilization)
    for s, (weights, layers) in enumerate(zip(stage_weights, split)):
        act = activation_bytes(spec, tp, settings, is_last=s == pp - 1, expert_parallel=expert_parallel)
        over = overhead_bytes(gpu, tp, pp)
        if not gpu.is_cpu and settings.graphs_captured:
            over += cuda_graph_bytes(graph_shape(spec, tp, settings, layers, s == 0, expert_parallel))
        lora = settings.max_loras * slot_bytes(spec, tp, layers, settings.max_lora_rank, settings.dtype_bytes) \
            if settings.enable_lora else 0
        budget = usable - int(weights) - act - over - lora
        if settings.kv_cache_memory_bytes is not None:
            budget = min(budget, settings.kv_cache_memory_bytes)
        per_token = layers * spec.kv_values_per_layer(tp) * settings.kv_dtype_bytes
        stages.append(StageMemory(gpu.memory_bytes, int(weights), act, over, budget,
                                  per_token, layers, lora))
    num_blocks = min(s.num_blocks_fit(settings.block_size) for s in stages)
    rank_block = max(s.kv_bytes_per_token for s in stages) * settings.block_size
    offloaded = offload_blocks(settings.kv_offloading_size, rank_block, tp * pp)
    return MemoryPlan(tuple(stages), num_blocks, settings.block_size, spec.uniform_sliding_window,
                      settings.max_num_batched_tokens, offloaded, offloaded * rank_block * tp * pp)
