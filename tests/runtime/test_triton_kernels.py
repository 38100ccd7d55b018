"""The Triton attention kernels under TRITON_INTERPRET=1 on CPU, against the torch reference backend."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402

from shardserve.runtime.attention import triton_kernels  # noqa: E402
from shardserve.runtime.attention.triton_decode import max_decode_splits, paged_decode  # noqa: E402
from shardserve.runtime.attention.triton_prefill import paged_prefill  # noqa: E402
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend, paged_attention, write_kv  # noqa: E402
from shardserve.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tests.runtime import attention_cases  # noqa: E402

BLOCK_SIZE, NUM_BLOCKS = 4, 24


def make_batch(shapes, seed=0):
    return attention_cases.make_batch(shapes, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"), seed)


def random_case(shapes, num_heads=4, num_kv_heads=2, head_dim=24, seed=0):
    meta = make_batch(shapes, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    num_tokens = meta.query_start_loc_cpu[-1]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)  # cached prefix
    return meta, q, k, v, cache


def test_store_kv_writes_the_same_slots():
    meta, _, k, v, cache = random_case([(3, 5), (0, 6), (8, 1)])
    expected = cache.clone()
    write_kv(k, v, expected, meta.slot_mapping)
    triton_kernels.store_kv(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("shapes, head_dim", [
    ([(0, 7), (5, 3), (9, 1), (0, 1)], 24),  # fresh prefill, chunk over a cached prefix, decodes
    ([(13, 18)], 16),  # more queries than one tile, prefix not block aligned
])
def test_prefill_kernel_matches_reference(shapes, head_dim):
    meta, q, k, v, cache = random_case(shapes, head_dim=head_dim)
    write_kv(k, v, cache, meta.slot_mapping)
    expected = paged_attention(q, cache, meta, scale=0.3)
    actual = paged_prefill(q, cache, meta, scale=0.3)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_kv_decode_matches_reference(num_splits):
    meta, q, k, v, cache = random_case([(20, 1), (2, 1), (37, 1)], num_heads=4, num_kv_heads=1)
    write_kv(k, v, cache, meta.slot_mapping)
    expected = paged_attention(q, cache, meta, scale=0.2)
    actual = paged_decode(q, cache, meta, scale=0.2, num_splits=num_splits, split_min=8)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("shapes, dtype", [([(6, 1), (11, 1)], torch.float32), ([(6, 2), (0, 5)], torch.float32),
                                           ([(6, 1), (11, 1)], torch.float16), ([(6, 2), (0, 5)], torch.float16)])
def test_backend_matches_torch_backend(shapes, dtype):
    meta, q, k, v, cache = (x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x
                            for x in random_case(shapes, seed=4))
    reference_cache = cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, reference_cache, meta, 0.25)
    actual = TritonAttentionBackend().forward(q, k, v, cache, meta, 0.25)
    tolerance = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected, **tolerance)
    assert torch.equal(cache, reference_cache)


@pytest.mark.parametrize("shapes", [[(0, 7), (5, 3), (9, 1)], [(20, 1), (3, 1), (37, 1)]])
def test_a_one_plane_cache_is_read_as_keys_and_values(shapes):
    """MLA's cache [1, ...]: one 40-wide entry per token (latent | rotated key), values = the entry; 20
    heads over one KV head go 16 per launch."""
    meta, q, k, _, cache = random_case(shapes, num_heads=20, num_kv_heads=1, head_dim=40, seed=6)
    cache = cache[:1].clone()
    reference_cache = cache.clone()
    expected = TorchAttentionBackend().forward(q, k, k, reference_cache, meta, 0.3)
    actual = TritonAttentionBackend().forward(q, k, k, cache, meta, 0.3)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    assert torch.equal(cache, reference_cache)
    two_planes = torch.cat([reference_cache, reference_cache])  # the same entries as separate K and V
    torch.testing.assert_close(paged_attention(q, two_planes, meta, 0.3), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_prefill_kernel_with_sliding_window_matches_reference(window):
    """Windows shorter than a tile, than the cached prefix, and than the whole sequence."""
    meta, q, k, v, cache = random_case([(0, 7), (21, 3), (9, 1), (13, 18)], head_dim=16)
    write_kv(k, v, cache, meta.slot_mapping)
    expected = paged_attention(q, cache, meta, scale=0.3, sliding_window=window)
    actual = paged_prefill(q, cache, meta, scale=0.3, sliding_window=window)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(expected, paged_attention(q, cache, meta, scale=0.3), atol=1e-3)


@pytest.mark.parametrize("window, num_splits", [(1, 1), (6, 3), (17, 2), (64, 3)])
def test_split_kv_decode_with_sliding_window_matches_reference(window, num_splits):
    meta, q, k, v, cache = random_case([(20, 1), (2, 1), (37, 1)], num_heads=4, num_kv_heads=1)
    write_kv(k, v, cache, meta.slot_mapping)
    expected = paged_attention(q, cache, meta, scale=0.2, sliding_window=window)
    actual = paged_decode(q, cache, meta, scale=0.2, num_splits=num_splits, sliding_window=window,
                          split_min=4)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_sliding_window_reference_sees_only_the_window():
    """The torch reference against dense attention over the last `window` keys of each query."""
    meta, q, k, v, cache = random_case([(10, 4)], num_heads=2, num_kv_heads=2, head_dim=8)
    write_kv(k, v, cache, meta.slot_mapping)
    out = paged_attention(q, cache, meta, scale=0.5, sliding_window=3)
    keys, values = (cache[i, meta.block_tables[0, :4].long()].flatten(0, 1)[:14] for i in (0, 1))
    for j, position in enumerate(range(10, 14)):
        seen = slice(position - 2, position + 1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[j], keys[seen]) * 0.5, dim=-1)
        torch.testing.assert_close(out[j], torch.einsum("hl,lhd->hd", probs, values[seen]))


def test_split_limit_comes_from_the_batch_shape():
    assert max_decode_splits(1, 8, 4096) == 16  # 8 programs: split while the GPU is not full
    assert max_decode_splits(8, 8, 4096) == 5  # Llama-3-8B at batch 8 still splits
    assert max_decode_splits(64, 8, 4096) == 1
    assert max_decode_splits(1, 8, 100) == 1  # no request can be longer than one split


# strided q/k/v (no rotary); q/k norm then fused rotary, head_dim 24; window 8; llama3 rope scaling;
# soft caps and local/global layers (Gemma 2); local rope base (Gemma 3); fused tensors, partial rotary (Phi-3)
# MLA over its one-plane latent cache (DeepSeek-V3 with q compression and yarn; V2-Lite without)
@pytest.mark.parametrize("family", ["gpt2", "qwen3", "mistral-window", "llama3", "gemma2", "gemma3", "phi3",
                                    "deepseek_v3", "deepseek_v2_lite"])
def test_models_on_the_triton_backend_match_transformers(family, checkpoint_factory):
    from runtime_forward import PROMPT, run_chunks

    from shardserve.runtime.config import load_model_config
    from shardserve.runtime.worker.loader import load_model

    folder, hf_model = checkpoint_factory(family)
    model = load_model(load_model_config(folder), torch.device("cpu"))
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    logits = run_chunks(model, [len(PROMPT) - 2, 1, 1], TritonAttentionBackend())  # prefill, then decodes
    assert (logits - expected).abs().max().item() < 1e-4


FP8_SCALES = (0.5, 2.0)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_store_kv_quantizes_like_the_reference(dtype):
    """NOTE: Triton's interpreter rounds fp32 -> fp8 its own way (it drops the carry of a mantissa that
    rounds up), so the values here are fp8 values times the scale: the division and the cast are exact
    and the kernel must match the reference bit for bit. Rounding itself is the GPU's (tests/gpu)."""
    meta, _, k, v, cache = random_case([(3, 5), (0, 6), (8, 1)])
    k = k.to(dtype).float() * FP8_SCALES[0]
    v = v.to(dtype).float() * FP8_SCALES[1]
    k[0, 0, 0] = 1e6  # saturates at the format's largest value, never inf or nan
    cache = cache.to(dtype)
    expected = cache.clone()
    write_kv(k, v, expected, meta.slot_mapping, FP8_SCALES)
    triton_kernels.store_kv(k, v, cache, meta.slot_mapping, FP8_SCALES)
    assert torch.isfinite(cache.float()).all() and cache[0].flatten()[meta.slot_mapping[0] * 48].float() == \
        torch.finfo(dtype).max
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kernels_read_an_fp8_cache_like_the_reference(dtype):
    meta, q, k, v, cache = random_case([(0, 7), (5, 3), (9, 1)])
    cache = cache.to(dtype)
    write_kv(k, v, cache, meta.slot_mapping, FP8_SCALES)
    expected = paged_attention(q, cache, meta, 0.3, kv_scales=FP8_SCALES)
    actual = paged_prefill(q, cache, meta, 0.3, kv_scales=FP8_SCALES)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    meta, q, k, v, cache = random_case([(20, 1), (2, 1), (37, 1)], num_kv_heads=1)
    cache = cache.to(dtype)
    write_kv(k, v, cache, meta.slot_mapping, FP8_SCALES)
    expected = paged_attention(q, cache, meta, 0.2, kv_scales=FP8_SCALES)
    actual = paged_decode(q, cache, meta, 0.2, num_splits=3, kv_scales=FP8_SCALES, split_min=8)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
