"""On the GPU, in bf16: the fp8 KV cache kernels against the torch reference reading the same fp8 cache,
and the AWQ/GPTQ GEMM against dequantize-then-matmul. Written without a GPU at hand: run them on one."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime.attention import triton_decode, triton_kernels, triton_prefill
from shardserve.runtime.attention.torch_backend import paged_attention, write_kv
from shardserve.runtime.layers.quantization.triton_packed_int import packed_int_matmul

from tests.gpu.test_gpu_kernels import BF16, CUDA, random_case
from tests.runtime.quant_checkpoints import AWQ_ORDER, pack_int32

SCALES = (0.05, 0.02)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_kernels_match_the_reference(dtype):
    meta, q, k, v, cache = random_case([(40, 300), (0, 17), (999, 1)])
    cache = cache.to(dtype)
    expected_cache = cache.clone()
    write_kv(k, v, expected_cache, meta.slot_mapping, SCALES)
    triton_kernels.store_kv(k, v, cache, meta.slot_mapping, SCALES)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))  # the GPU rounds like torch
    expected = paged_attention(q.float(), cache, meta, 128**-0.5, kv_scales=SCALES)
    torch.testing.assert_close(triton_prefill.paged_prefill(q, cache, meta, 128**-0.5, kv_scales=SCALES).float(),
                               expected, **BF16)
    meta, q, k, v, cache = random_case([(3000, 1), (16, 1), (0, 1)], seed=3)
    cache = cache.to(dtype)
    write_kv(k, v, cache, meta.slot_mapping, SCALES)
    expected = paged_attention(q.float(), cache, meta, 0.1, kv_scales=SCALES)
    torch.testing.assert_close(triton_decode.paged_decode(q, cache, meta, 0.1, kv_scales=SCALES).float(),
                               expected, **BF16)


@pytest.mark.parametrize("bits, is_awq", [(4, True), (4, False), (8, False)])
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_packed_int_gemm_bf16_matches_dequantized_matmul(bits, is_awq, num_tokens):
    num_in, num_out, group = 4096, 1024, 128
    top = 2**bits - 1
    q = torch.randint(0, top + 1, (num_in, num_out), device=CUDA)
    zeros = torch.randint(1, top + 1, (num_in // group, num_out), device=CUDA)
    scales = (torch.rand(num_in // group, num_out, device=CUDA) * 0.01).to(torch.bfloat16)
    groups = (torch.arange(num_in, device=CUDA) // group).to(torch.int32)
    if is_awq:
        qweight, qzeros, offset = pack_int32(q, 4, 1, AWQ_ORDER), pack_int32(zeros, 4, 1, AWQ_ORDER), 0
    else:
        qweight, qzeros, offset = pack_int32(q, bits, 0), pack_int32(zeros - 1, bits, 1), 1
    weight = (q - zeros[groups.long()]).float() * scales[groups.long()].float()  # [in, out]
    x = torch.randn(num_tokens, num_in, device=CUDA).to(torch.bfloat16)
    expected = x.float() @ weight
    actual = packed_int_matmul(x, qweight, qzeros, scales, groups, bits, is_awq, offset)
    torch.testing.assert_close(actual.float(), expected, atol=0.05 * expected.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_fp8_scaled_mm_matches_dequantize_then_matmul(num_tokens):
    from torch import nn

    from shardserve.runtime.layers.quantization.config import QuantConfig
    from shardserve.runtime.layers.quantization.fp8 import Fp8LinearMethod

    method = Fp8LinearMethod(QuantConfig.from_dict(None, "fp8"))
    layer = nn.Module()
    layer.packed_dims = {}
    with torch.device(CUDA):
        method.create_weights(layer, 4096, 1024, 4096)
    layer.weight.data.copy_(torch.randn(1024, 4096, device=CUDA) * 0.02)
    method.process_after_loading(layer)
    x = torch.randn(num_tokens, 4096, device=CUDA).to(torch.bfloat16)
    assert method._has_fp8_gemm(layer, x)
    expected = x.float() @ method.dequantize(layer).t()
    torch.testing.assert_close(method.apply(layer, x).float(), expected, atol=0.05 * expected.abs().max().item(),
                               rtol=5e-2)
