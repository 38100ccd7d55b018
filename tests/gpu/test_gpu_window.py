"""The compiled Triton kernels never read table entries the block manager freed behind the window
(they point at a block of NaNs here), at GPU sizes in bf16."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime.attention import triton_kernels
from shardserve.runtime.attention.torch_backend import paged_attention
from shardserve.runtime.block_manager import BlockManager

from tests.gpu.test_gpu_kernels import BF16, BLOCK_SIZE, NUM_BLOCKS, random_case


def poison_freed_entries(meta, cache, window: int) -> None:
    pool = BlockManager(NUM_BLOCKS, BLOCK_SIZE, sliding_window=window)
    used = set(meta.block_tables.flatten().tolist())
    poison = next(b for b in range(NUM_BLOCKS) if b not in used)
    cache[:, poison] = float("nan")
    starts = meta.query_start_loc_cpu
    for r in range(meta.num_requests):
        num_computed = int(meta.seq_lens_cpu[r] - (starts[r + 1] - starts[r]))
        meta.block_tables[r, :pool.num_behind_window(num_computed)] = poison


@pytest.mark.parametrize("window", [100, 4096])
def test_prefill_and_decode_skip_freed_blocks(window):
    meta, q, _, _, cache = random_case([(3000, 300), (700, 77), (4500, 1), (2000, 1)])  # 664 of 1024 blocks
    expected = paged_attention(q.float(), cache.float(), meta, scale=128**-0.5, sliding_window=window)
    poison_freed_entries(meta, cache, window)
    actual = triton_kernels.paged_prefill(q, cache, meta, scale=128**-0.5, sliding_window=window)
    torch.testing.assert_close(actual.float(), expected, **BF16)
    decode_meta, decode_q, _, _, decode_cache = random_case([(4500, 1), (8000, 1), (30, 1)], seed=1)
    expected = paged_attention(decode_q.float(), decode_cache.float(), decode_meta, scale=128**-0.5,
                               sliding_window=window)
    poison_freed_entries(decode_meta, decode_cache, window)
    actual = triton_kernels.paged_decode(decode_q, decode_cache, decode_meta, scale=128**-0.5,
                                         sliding_window=window)
    torch.testing.assert_close(actual.float(), expected, **BF16)
