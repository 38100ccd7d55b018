"""How many KV blocks the pool gets, the start-up refusal when max_model_len cannot fit, and the log."""

from __future__ import annotations

import logging

from shardserve.runtime.config import EngineConfig, KVCacheInfo
from shardserve.runtime.executor import Executor

logger = logging.getLogger(__name__)


def size_kv_cache(config: EngineConfig, executor: Executor) -> KVCacheInfo:
    available = executor.available_kv_cache_bytes()
    per_block = executor.bytes_per_block()
    block_size = config.cache.block_size
    max_model_len = config.model.max_model_len
    num_blocks = available // per_block
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens ({available / 1024**3:.3f} GiB at "
            f"{per_block} bytes per block of {block_size}), fewer than max_model_len={max_model_len}; "
            f"set max_model_len <= {num_blocks * block_size} or give the KV cache more memory "
            "(gpu_memory_utilization, or kv_cache_memory_bytes)")
    info = KVCacheInfo(num_blocks=num_blocks, block_size=block_size, bytes_per_block=per_block,
                       max_model_len=max_model_len)
    logger.info("KV cache: %.2f GiB, %d blocks of %d tokens", info.memory_bytes / 1024**3, num_blocks, block_size)
    logger.info("KV cache size: %d tokens", info.num_tokens)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len, info.max_concurrency)
    return info
