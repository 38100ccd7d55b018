"""The Triton kernels compiled on the GPU, in bf16, against the float32 torch reference; the decode
kernel replayed in a CUDA graph; the sampler's device path without a host sync."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime.attention import triton_decode, triton_kernels, triton_prefill
from shardserve.runtime.attention.torch_backend import paged_attention, write_kv
from shardserve.runtime.worker.forward_context import AttentionMetadata
from shardserve.runtime.worker.inputs import RequestState
from shardserve.runtime.layers import triton_norm
from shardserve.runtime.layers.norm import add_rms_norm_reference, rms_norm_reference
from shardserve.runtime.worker.sampler import sample_on_device
from shardserve.runtime.sampling_params import SamplingParams

from tests.runtime.attention_cases import make_batch

BLOCK_SIZE, NUM_BLOCKS = 16, 1024
CUDA = torch.device("cuda")
BF16 = dict(atol=2e-2, rtol=2e-2)  # bf16 inputs and output against a float32 computation on the same inputs


def make_meta(shapes, seed=0):
    return make_batch(shapes, BLOCK_SIZE, NUM_BLOCKS, CUDA, seed)


def random_case(shapes, num_heads=32, num_kv_heads=8, head_dim=128, seed=0):
    meta = make_meta(shapes, seed)
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    num_tokens = meta.query_start_loc_cpu[-1]

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=CUDA).to(torch.bfloat16)

    q = randn(num_tokens, num_heads, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    cache = randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)  # the cached prefixes
    write_kv(k, v, cache, meta.slot_mapping)
    return meta, q, k, v, cache


def test_store_kv_writes_exactly_the_reference_slots():
    meta, _, k, v, cache = random_case([(40, 300), (0, 17), (999, 1)])
    cache.zero_()
    expected = torch.zeros_like(cache)
    write_kv(k, v, expected, meta.slot_mapping)
    triton_kernels.store_kv(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache, expected) and cache.abs().sum() > 0


@pytest.mark.parametrize("shapes", [[(0, 300), (500, 77), (33, 1), (1000, 1), (0, 16)], [(17, 1029)]])
def test_prefill_bf16_matches_float32_reference(shapes):
    meta, q, _, _, cache = random_case(shapes)
    expected = paged_attention(q.float(), cache.float(), meta, scale=128**-0.5)
    actual = triton_prefill.paged_prefill(q, cache, meta, scale=128**-0.5)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, **BF16)


@pytest.mark.parametrize("num_splits", [None, 1, 5, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(32, 8, 128), (16, 2, 64), (8, 8, 128)])
def test_split_kv_decode_bf16_matches_float32_reference(num_splits, num_heads, num_kv_heads, head_dim):
    meta, q, _, _, cache = random_case([(3000, 1), (16, 1), (1000, 1), (0, 1), (4095, 1)], num_heads, num_kv_heads,
                                       head_dim, seed=3)
    expected = paged_attention(q.float(), cache.float(), meta, scale=0.1)
    actual = triton_decode.paged_decode(q, cache, meta, scale=0.1, num_splits=num_splits)
    torch.testing.assert_close(actual.float(), expected, **BF16)


def test_decode_kernel_replays_in_a_cuda_graph_with_new_lengths():
    """The kernel reads lengths and block tables only on the device: one capture serves every step."""
    max_model_len, size, num_heads, num_kv_heads, head_dim = 4096, 4, 32, 8, 128
    generator = torch.Generator(device=CUDA).manual_seed(7)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator,
                        device=CUDA).to(torch.bfloat16)
    static_q = torch.zeros(size, num_heads, head_dim, dtype=torch.bfloat16, device=CUDA)
    static_lens = torch.ones(size, dtype=torch.int32, device=CUDA)
    static_tables = torch.zeros(size, max_model_len // BLOCK_SIZE, dtype=torch.int32, device=CUDA)
    static = AttentionMetadata(torch.zeros(size, dtype=torch.int64, device=CUDA),
                               torch.arange(size + 1, dtype=torch.int32, device=CUDA), static_lens, static_tables,
                               max_query_len=1, max_seq_len=max_model_len, query_start_loc_cpu=list(range(size + 1)),
                               seq_lens_cpu=None)
    triton_decode.paged_decode(static_q, cache, static, 0.1)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = triton_decode.paged_decode(static_q, cache, static, 0.1)
    for seed, shapes in ((5, [(100, 1), (2000, 1), (5, 1), (4000, 1)]), (6, [(3, 1), (700, 1), (4090, 1), (64, 1)])):
        meta = make_meta(shapes, seed=seed)
        q = torch.randn(size, num_heads, head_dim, generator=generator, device=CUDA).to(torch.bfloat16)
        static_q.copy_(q)
        static_lens.copy_(meta.seq_lens)
        static_tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        graph.replay()
        expected = paged_attention(q.float(), cache.float(), meta, 0.1)
        torch.testing.assert_close(static_out.float(), expected, **BF16)


@pytest.mark.parametrize("num_rows, hidden_size", [(1, 4096), (7, 5120), (256, 4096), (300, 128)])
def test_fused_add_rms_norm_bf16(num_rows, hidden_size):
    generator = torch.Generator(device=CUDA).manual_seed(num_rows)
    x = torch.randn(num_rows, hidden_size, generator=generator, device=CUDA).to(torch.bfloat16) * 4
    residual = torch.randn(num_rows, hidden_size, generator=generator, device=CUDA).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(hidden_size, generator=generator, device=CUDA)).to(torch.bfloat16)
    out, summed = triton_norm.add_rms_norm(x, residual, weight, 1e-6)
    expected, expected_sum = add_rms_norm_reference(x, residual, weight, 1e-6)  # the torch path in bf16
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(out, expected)  # bf16 defaults: one rounding step apart at most
    exact = rms_norm_reference(expected_sum.float(), weight.float(), 1e-6)
    torch.testing.assert_close(out.float(), exact, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(triton_norm.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


def states_for(params: list[SamplingParams]) -> list[RequestState]:
    return [RequestState(f"r{i}", [1, 2], 2, p, 100 + i, frozenset(), [0], 1) for i, p in enumerate(params)]


def test_sampling_waits_for_nothing_on_the_device():
    logits = torch.randn(64, 32000, device=CUDA) * 3
    batches = [[SamplingParams(temperature=0.0)] * 64,
               [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01)] * 32
               + [SamplingParams(temperature=0.0)] * 32,
               [SamplingParams(temperature=1.0, seed=i) for i in range(64)]]
    for params in batches:
        states = states_for(params)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
        try:
            tokens = sample_on_device(logits, states)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        tokens = tokens.tolist()
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        assert [tokens[i] for i in greedy] == logits.argmax(dim=-1)[greedy].tolist()
        assert all(0 <= t < 32000 for t in tokens)
