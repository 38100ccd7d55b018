"""Table entries freed behind the window are never read: the torch backend and the Triton kernels
(TRITON_INTERPRET=1) give the same output when those entries point at a block of NaNs."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402

from shardserve.runtime.attention import triton_decode, triton_prefill  # noqa: E402
from shardserve.runtime.attention.torch_backend import paged_attention, write_kv  # noqa: E402
from attention_cases import poison_freed_entries  # noqa: E402
from test_triton_kernels import BLOCK_SIZE, NUM_BLOCKS, random_case  # noqa: E402


@pytest.mark.parametrize("window", [1, 3, 6, 9])
def test_prefill_never_reads_freed_blocks(window):
    meta, q, k, v, cache = random_case([(21, 3), (9, 1), (13, 10)], head_dim=16)
    write_kv(k, v, cache, meta.slot_mapping)
    expected = paged_attention(q, cache, meta, scale=0.3, sliding_window=window)
    poison_freed_entries(meta, cache, window, NUM_BLOCKS, BLOCK_SIZE)
    assert meta.block_tables.unique().numel() < meta.block_tables.numel()  # something was poisoned
    torch.testing.assert_close(paged_attention(q, cache, meta, scale=0.3, sliding_window=window), expected)
    actual = triton_prefill.paged_prefill(q, cache, meta, scale=0.3, sliding_window=window)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window, num_splits", [(1, 1), (4, 2), (7, 3)])
def test_decode_never_reads_freed_blocks(window, num_splits):
    meta, q, k, v, cache = random_case([(20, 1), (2, 1), (37, 1)], num_heads=4, num_kv_heads=1)
    write_kv(k, v, cache, meta.slot_mapping)
    expected = paged_attention(q, cache, meta, scale=0.2, sliding_window=window)
    poison_freed_entries(meta, cache, window, NUM_BLOCKS, BLOCK_SIZE)
    torch.testing.assert_close(paged_attention(q, cache, meta, scale=0.2, sliding_window=window), expected)
    actual = triton_decode.paged_decode(q, cache, meta, scale=0.2, num_splits=num_splits, sliding_window=window,
                                        split_min=1)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
