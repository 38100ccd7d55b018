"""The Triton attention kernels over the shapes that matter (head_dim 64/128, GQA groups 1/3/4/8,
block_size 16, lengths over several blocks, mixed in one batch, windows, fp8 cache, logit soft-cap)
under TRITON_INTERPRET=1, against the torch reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402

from shardserve.runtime.attention import triton_decode, triton_prefill  # noqa: E402
from shardserve.runtime.attention.torch_backend import paged_attention, write_kv  # noqa: E402
from tests.runtime import attention_cases  # noqa: E402
from tests.runtime.kernel_launches import count_launches  # noqa: E402

BLOCK_SIZE, NUM_BLOCKS = 16, 48
FP32 = dict(atol=3e-5, rtol=1e-4)
PREFILL_SHAPES = [(0, 40), (37, 21), (70, 1), (5, 1)]  # fresh prompt, chunk over a prefix, decodes
DECODE_SHAPES = [(100, 1), (15, 1), (49, 1), (130, 1), (0, 1)]


def random_case(shapes, num_heads, num_kv_heads, head_dim, seed=0, cache_dtype=torch.float32, kv_scales=(1.0, 1.0)):
    meta = attention_cases.make_batch(shapes, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    num_tokens = meta.query_start_loc_cpu[-1]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) for _ in range(2))
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    write_kv(k, v, cache, meta.slot_mapping, kv_scales)
    return meta, q, cache


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_with_the_chosen_tiles(head_dim, group):
    meta, q, cache = random_case(PREFILL_SHAPES, 2 * group, 2, head_dim)
    expected = paged_attention(q, cache, meta, scale=head_dim**-0.5)
    actual = triton_prefill.paged_prefill(q, cache, meta, scale=head_dim**-0.5)
    torch.testing.assert_close(actual, expected, **FP32)


@pytest.mark.parametrize("group, block_m", [(3, 16), (7, 16), (4, 16), (8, 8)])
def test_prefill_packs_any_group_into_small_tiles(group, block_m):
    """Tiles of a few tokens each, a group that leaves padding rows, and one token per tile."""
    meta, q, cache = random_case(PREFILL_SHAPES, 2 * group, 2, 64, seed=2)
    expected = paged_attention(q, cache, meta, scale=0.125)
    actual = triton_prefill.paged_prefill(q, cache, meta, scale=0.125, block_m=block_m, block_n=16)
    torch.testing.assert_close(actual, expected, **FP32)


@pytest.mark.parametrize("window, cache_dtype", [(7, torch.float32), (40, torch.float32), (None, torch.float8_e4m3fn),
                                                 (20, torch.float8_e5m2)])
def test_prefill_windows_and_fp8(window, cache_dtype):
    scales = (0.5, 2.0) if cache_dtype != torch.float32 else (1.0, 1.0)
    meta, q, cache = random_case(PREFILL_SHAPES, 8, 2, 64, seed=3, cache_dtype=cache_dtype, kv_scales=scales)
    expected = paged_attention(q, cache, meta, 0.125, sliding_window=window, kv_scales=scales)
    actual = triton_prefill.paged_prefill(q, cache, meta, 0.125, sliding_window=window, kv_scales=scales)
    torch.testing.assert_close(actual, expected, **FP32)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_grouped_by_kv_head(head_dim, group, num_splits):
    """With split_min 32 the 130-key request takes 4 splits, the 15-key one a single split."""
    meta, q, cache = random_case(DECODE_SHAPES, 2 * group, 2, head_dim, seed=4)
    expected = paged_attention(q, cache, meta, scale=head_dim**-0.5)
    actual = triton_decode.paged_decode(q, cache, meta, scale=head_dim**-0.5, num_splits=num_splits, block_n=16,
                                        split_min=32)
    torch.testing.assert_close(actual, expected, **FP32)


@pytest.mark.parametrize("window, cache_dtype", [(7, torch.float32), (64, torch.float32), (None, torch.float8_e4m3fn),
                                                 (33, torch.float8_e5m2)])
def test_decode_windows_and_fp8_over_splits(window, cache_dtype):
    scales = (0.5, 2.0) if cache_dtype != torch.float32 else (1.0, 1.0)
    meta, q, cache = random_case(DECODE_SHAPES, 8, 2, 64, seed=5, cache_dtype=cache_dtype, kv_scales=scales)
    expected = paged_attention(q, cache, meta, 0.125, sliding_window=window, kv_scales=scales)
    actual = triton_decode.paged_decode(q, cache, meta, 0.125, num_splits=3, block_n=16, sliding_window=window,
                                        kv_scales=scales, split_min=16)
    torch.testing.assert_close(actual, expected, **FP32)


@pytest.mark.parametrize("window", [None, 9])
def test_logit_soft_cap_in_both_kernels(window):
    cap = 2.0  # small enough that the cap changes the result
    meta, q, cache = random_case(PREFILL_SHAPES, 8, 2, 64, seed=6)
    q = q * 3
    expected = attention_cases.capped_reference(q, cache, meta, 0.125, cap, window)
    actual = triton_prefill.paged_prefill(q, cache, meta, 0.125, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(actual, expected, **FP32)
    assert not torch.allclose(actual, paged_attention(q, cache, meta, 0.125, sliding_window=window), atol=1e-2)
    meta, q, cache = random_case(DECODE_SHAPES, 8, 2, 64, seed=7)
    q = q * 3
    expected = attention_cases.capped_reference(q, cache, meta, 0.125, cap, window)
    actual = triton_decode.paged_decode(q, cache, meta, 0.125, num_splits=3, block_n=16, sliding_window=window,
                                        logits_soft_cap=cap, split_min=16)
    torch.testing.assert_close(actual, expected, **FP32)


def test_reduce_launches_only_when_a_request_may_split():
    meta, q, cache = random_case(DECODE_SHAPES, 8, 2, 64, seed=8)
    with count_launches(triton_decode) as launches:
        triton_decode.paged_decode(q, cache, meta, 0.125)  # every request shorter than SPLIT_MIN: one split
    assert launches == ["_decode_kernel"]
    assert triton_decode.max_decode_splits(meta.num_requests, 2, meta.max_seq_len) == 1
    with count_launches(triton_decode) as launches:
        triton_decode.paged_decode(q, cache, meta, 0.125, num_splits=2, split_min=64)
    assert launches == ["_decode_kernel", "_decode_reduce_kernel"]
