"""The compiled Triton kernels never read table entries the block manager freed behind the window
(they point at a block of NaNs here), at GPU sizes in bf16."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime.attention import triton_decode, triton_prefill
from shardserve.runtime.attention.torch_backend import paged_attention

from tests.gpu.test_gpu_kernels import BF16, BLOCK_SIZE, NUM_BLOCKS, random_case
from tests.runtime.attention_cases import poison_freed_entries


@pytest.mark.parametrize("window", [100, 4096])
def test_prefill_and_decode_skip_freed_blocks(window):
    meta, q, _, _, cache = random_case([(3000, 300), (700, 77), (4500, 1), (2000, 1)])  # 664 of 1024 blocks
    expected = paged_attention(q.float(), cache.float(), meta, scale=128**-0.5, sliding_window=window)
    poison_freed_entries(meta, cache, window, NUM_BLOCKS, BLOCK_SIZE)
    actual = triton_prefill.paged_prefill(q, cache, meta, scale=128**-0.5, sliding_window=window)
    torch.testing.assert_close(actual.float(), expected, **BF16)
    decode_meta, decode_q, _, _, decode_cache = random_case([(4500, 1), (8000, 1), (30, 1)], seed=1)
    expected = paged_attention(decode_q.float(), decode_cache.float(), decode_meta, scale=128**-0.5,
                               sliding_window=window)
    poison_freed_entries(decode_meta, decode_cache, window, NUM_BLOCKS, BLOCK_SIZE)
    actual = triton_decode.paged_decode(decode_q, decode_cache, decode_meta, scale=128**-0.5,
                                         sliding_window=window)
    torch.testing.assert_close(actual.float(), expected, **BF16)
