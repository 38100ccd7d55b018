"""How many KV blocks the pool gets, max_model_len auto, the start-up refusal when it cannot fit, and the log."""

from __future__ import annotations

import logging
from dataclasses import replace

from shardserve.planner.kv_groups import longest_fitting_len, max_pages_per_request, pages_without_kv
from shardserve.planner.rules import offload_blocks, offload_size_problem
from shardserve.runtime.config import EngineConfig, KVCacheInfo
from shardserve.runtime.distributed.executor import Executor

logger = logging.getLogger(__name__)


def size_kv_cache(config: EngineConfig, executor: Executor) -> KVCacheInfo:
    available = executor.available_kv_cache_bytes()
    per_block = executor.bytes_per_block()
    block_size = config.cache.block_size
    groups, chunk = config.model.kv_groups, config.scheduler.max_num_batched_tokens
    max_model_len = config.model.max_model_len
    num_blocks = available // per_block if per_block else \
        pages_without_kv(config.scheduler.max_num_seqs, groups.windows, max_model_len, block_size, chunk)
    if config.model.is_max_model_len_auto:
        fitting = longest_fitting_len(num_blocks, block_size, groups.windows, chunk, max_model_len)
        logger.info("max_model_len auto: %s (the model's limit: %d)", fitting, max_model_len)
        max_model_len = fitting or max_model_len  # None: not one token fits, refused below
    needed = max_pages_per_request(groups.windows, max_model_len, block_size, chunk)
    if needed > num_blocks:
        kind = config.model.recurrent_kind
        fitting = longest_fitting_len(num_blocks, block_size, groups.windows, chunk, max_model_len)
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({available / 1024**3:.3f} GiB at {per_block} bytes per "
            f"block of {block_size} tokens); a request of max_model_len={max_model_len} needs {needed}; "
            + (f"set max_model_len <= {fitting} (or auto) " if fitting else "")
            + "or give the KV cache more memory (gpu_memory_utilization, or kv_cache_memory_bytes)"
            + (f", or lower max_num_seqs ({config.scheduler.max_num_seqs}): the {kind} layers' states, a row per "
               "request it may run (and one per token a step verifies with speculative_config), come out of the "
               "same memory" if kind else ""))
    info = KVCacheInfo(num_blocks=num_blocks, block_size=block_size, bytes_per_block=per_block,
                       max_model_len=max_model_len, blocks_per_request=needed,
                       num_offload_blocks=_offload_blocks(config, per_block))
    logger.info("KV cache: %.2f GiB, %d blocks of %d tokens", info.memory_bytes / 1024**3, num_blocks, block_size)
    if info.num_offload_blocks:
        logger.info("CPU tier of the KV cache: %d blocks (%d tokens) in %.2f GiB of host memory", info.num_offload_blocks,
                    info.num_offload_blocks * block_size,
                    info.num_offload_blocks * per_block * config.parallel.world_size / 1024**3)
    logger.info("KV cache size: %d tokens", info.num_tokens)
    if groups.is_hybrid:
        logger.info("a block table per kind of layer (%s): blocks behind a window are freed (at most %d pages "
                    "per request, each a block of %d layers)", ", ".join(_kind(w) for w in groups.windows),
                    needed, groups.group_size)
    elif groups.windows[0] is not None:
        logger.info("every layer attends over %d tokens: blocks behind the window are freed (at most %d "
                    "blocks per request)", groups.windows[0], needed)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len, info.max_concurrency)
    return info


def _kind(window: int | None) -> str:
    return "full attention" if window is None else f"a window of {window}"


def _offload_blocks(config: EngineConfig, per_block: int) -> int:
    """The CPU tier's blocks, by the planner's rule; a size too small for one block is refused."""
    size, num_ranks = config.cache.kv_offloading_size, config.parallel.world_size
    problem = offload_size_problem(size, per_block, num_ranks)
    if problem:
        raise ValueError(problem)
    return offload_blocks(size, per_block, num_ranks)


def with_measured_len(config: EngineConfig, info: KVCacheInfo) -> EngineConfig:
    """The engine's config once the pool is measured: max_model_len auto resolved to its number.
    NOTE: the ranks keep the model's limit, an upper bound for what they size by it (CUDA graph
    block tables, the profiling run); only the scheduler and the input checks need the number."""
    if not config.model.is_max_model_len_auto:
        return config
    return replace(config, model=replace(config.model, max_model_len=info.max_model_len,
                                         is_max_model_len_auto=False))
