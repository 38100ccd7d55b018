"""Attention sinks (gpt-oss) in the Triton kernels under TRITON_INTERPRET=1, against the torch reference:
prefill, decode in one split and in several (the reduce adds each sink once), sliding windows, the
backend's 16-heads-per-launch path over a one-plane cache."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402

from shardserve.runtime.attention import triton_decode  # noqa: E402
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend, paged_attention, write_kv  # noqa: E402
from shardserve.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from shardserve.runtime.attention.triton_decode import paged_decode  # noqa: E402
from shardserve.runtime.attention.triton_prefill import paged_prefill  # noqa: E402
from tests.runtime.attention_cases import sinks_for  # noqa: E402
from tests.runtime.kernel_launches import count_launches  # noqa: E402
from tests.runtime.test_triton_kernels import random_case  # noqa: E402

FP32 = dict(atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 1, 5, 16])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_prefill_with_sinks_matches_reference(window, num_kv_heads):
    """Fresh prompts, chunks over cached prefixes (longer than a tile), decodes; GQA groups 4 and 2."""
    meta, q, k, v, cache = random_case([(0, 7), (21, 3), (9, 1), (13, 18)], num_kv_heads=num_kv_heads, head_dim=16)
    write_kv(k, v, cache, meta.slot_mapping)
    sinks = sinks_for(4)
    expected = paged_attention(q, cache, meta, scale=0.3, sliding_window=window, sinks=sinks)
    actual = paged_prefill(q, cache, meta, scale=0.3, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(actual, expected, **FP32)
    assert not torch.allclose(expected, paged_attention(q, cache, meta, scale=0.3, sliding_window=window), atol=1e-2)


@pytest.mark.parametrize("window, num_splits", [(None, 1), (None, 3), (6, 1), (6, 3), (17, 2), (64, 4)])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_split_kv_decode_with_sinks_matches_reference(window, num_splits, num_kv_heads):
    """Requests of 38, 3 and 21 keys over splits of at least 4: some one split, some several."""
    meta, q, k, v, cache = random_case([(20, 1), (2, 1), (37, 1)], num_kv_heads=num_kv_heads)
    write_kv(k, v, cache, meta.slot_mapping)
    sinks = sinks_for(4, seed=1)
    expected = paged_attention(q, cache, meta, scale=0.2, sliding_window=window, sinks=sinks)
    with count_launches(triton_decode) as launches:
        actual = paged_decode(q, cache, meta, scale=0.2, num_splits=num_splits, sliding_window=window, split_min=4,
                              sinks=sinks)
    torch.testing.assert_close(actual, expected, **FP32)
    assert ("_decode_reduce_kernel" in launches) == (num_splits > 1)
    assert not torch.allclose(expected, paged_attention(q, cache, meta, scale=0.2, sliding_window=window), atol=1e-2)


@pytest.mark.parametrize("shapes", [[(6, 1), (11, 1)], [(6, 2), (0, 5)]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_with_sinks_matches_torch_backend(shapes, dtype):
    meta, q, k, v, cache = (x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x
                            for x in random_case(shapes, seed=4))
    sinks = sinks_for(4, seed=2)
    expected = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.25, sinks=sinks)
    actual = TritonAttentionBackend().forward(q, k, v, cache, meta, 0.25, sinks=sinks)
    tolerance = FP32 if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(actual, expected, **tolerance)


@pytest.mark.parametrize("shapes", [[(0, 7), (5, 3), (9, 1)], [(20, 1), (3, 1), (37, 1)]])
def test_heads_per_launch_take_their_own_sinks(shapes):
    """20 heads over one KV head of a one-plane cache go 16 per launch, each launch with its heads' sinks."""
    meta, q, k, _, cache = random_case(shapes, num_heads=20, num_kv_heads=1, head_dim=40, seed=6)
    cache = cache[:1].clone()
    sinks = sinks_for(20, seed=3)
    expected = TorchAttentionBackend().forward(q, k, k, cache.clone(), meta, 0.3, sinks=sinks)
    actual = TritonAttentionBackend().forward(q, k, k, cache, meta, 0.3, sinks=sinks)
    torch.testing.assert_close(actual, expected, **FP32)
