"""The CPU tier of the KV cache on a rank (kv_offloading_size): its blocks in host memory, and the step's copies
between them and the pool (runtime/core/kv_offload.py decides them)."""

from __future__ import annotations

import logging
import math

import torch

from shardserve.runtime.core.kv_offload import available_host_bytes

logger = logging.getLogger(__name__)


def host_tier(kv_cache: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[num_slots, layers, 2, block_size, kv_heads, head_dim] in host memory, like the pool's blocks
    (pinned beside a GPU, so copies run on the stream without blocking the host)."""
    layers, two, _, block_size, heads, head_dim = kv_cache.shape
    shape = (num_slots, layers, two, block_size, heads, head_dim)
    needed = math.prod(shape) * kv_cache.element_size()
    available = available_host_bytes()
    if available is not None and needed > available:
        raise ValueError(f"kv_offloading_size: this rank's share of the CPU tier is {needed / 1024**3:.2f} GiB "
                         f"but the host has {available / 1024**3:.2f} GiB available; lower --kv-offloading-size")
    logger.info("CPU tier of the KV cache: %d blocks, %.2f GiB on this rank", num_slots, needed / 1024**3)
    return torch.empty(shape, dtype=kv_cache.dtype, pin_memory=kv_cache.is_cuda)


def run_transfers(kv_cache: torch.Tensor, host: torch.Tensor, transfers) -> None:
    """The step's copies between the pool and the tier, in the order the block manager issued them
    (one stream on a GPU, so each copy sees the ones before it and the step after sees them all)."""
    for to_host, block_id, slot in transfers:
        if to_host:
            host[slot].copy_(kv_cache[:, :, block_id], non_blocking=True)
        else:
            kv_cache[:, :, block_id].copy_(host[slot], non_blocking=True)
