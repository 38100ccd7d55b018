"""On the GPU in bf16 at Llama-3-8B attention shapes (32 heads, 8 KV heads, head_dim 128, block_size 16):
the grouped decode and GQA-packed prefill with logit soft-capping, rotary fused with the KV write and
SiLU-and-mul against float32 torch references, and the kernels one decoder layer launches per decode
step. Written without a GPU at hand: run them on one (bash bench/run_gpu.sh)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from gpu_checkpoints import save_gpu_checkpoint
from shardserve.runtime.attention import triton_decode, triton_prefill
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.attention.torch_backend import paged_attention, write_kv
from shardserve.runtime.attention.triton_backend import TritonAttentionBackend
from shardserve.runtime.attention.triton_rotary_kv import rotary_store_kv
from shardserve.runtime.config import load_model_config
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context
from shardserve.runtime.worker.inputs import RequestState, prepare_inputs
from shardserve.runtime.layers.activation import silu_and_mul_reference
from shardserve.runtime.layers.rotary import RotaryEmbedding
from shardserve.runtime.layers.triton_activation import silu_and_mul
from shardserve.runtime.worker.loader import load_model
from shardserve.runtime.sampling_params import SamplingParams

from tests.gpu.test_gpu_kernels import BF16, CUDA, random_case
from tests.runtime.attention_cases import capped_reference

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
DECODE_SHAPES = [(3000, 1), (16, 1), (1000, 1), (0, 1), (4095, 1), (255, 1), (300, 1), (77, 1)]


@pytest.mark.parametrize("window, cap", [(None, None), (None, 50.0), (1000, None), (333, 30.0)])
def test_grouped_decode_bf16(window, cap):
    meta, q, _, _, cache = random_case(DECODE_SHAPES, seed=11)
    scale = 128**-0.5
    if cap is None:
        expected = paged_attention(q.float(), cache.float(), meta, scale, sliding_window=window)
    else:
        expected = capped_reference(q.float(), cache.float(), meta, scale, cap, window)
    for num_splits in (None, 1, 7, 32):
        actual = triton_decode.paged_decode(q, cache, meta, scale, num_splits=num_splits, sliding_window=window,
                                            logits_soft_cap=cap)
        torch.testing.assert_close(actual.float(), expected, **BF16)


@pytest.mark.parametrize("window, cap", [(None, 50.0), (128, None), (100, 30.0)])
def test_gqa_packed_prefill_bf16(window, cap):
    meta, q, _, _, cache = random_case([(0, 300), (500, 77), (33, 1), (0, 16), (17, 129)], seed=12)
    scale = 128**-0.5
    if cap is None:
        expected = paged_attention(q.float(), cache.float(), meta, scale, sliding_window=window)
    else:
        expected = capped_reference(q.float(), cache.float(), meta, scale, cap, window)
    actual = triton_prefill.paged_prefill(q, cache, meta, scale, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(actual.float(), expected, **BF16)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rotary_store_kv_bf16(cache_dtype):
    """Strided views of one qkv projection; the reference rotates the same bf16 values in float32."""
    meta, _, _, _, cache = random_case([(40, 300), (0, 17), (999, 1)], seed=13)
    cache = torch.zeros_like(cache, dtype=cache_dtype)
    num_tokens = meta.query_start_loc_cpu[-1]
    qkv = torch.randn(num_tokens, 48 * 128, device=CUDA).to(torch.bfloat16)
    q, k, v = (x.unflatten(1, (-1, 128)) for x in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
    positions = torch.randint(0, 8192, (num_tokens,), device=CUDA)
    rotary = RotaryEmbedding(128, 8192, LLAMA3_ROPE).to(CUDA)
    scales = (1.0, 1.0) if cache_dtype == torch.bfloat16 else (0.05, 0.02)
    expected_q, expected_k = rotary(positions, q.float(), k.float())
    expected_cache = torch.zeros_like(cache)
    write_kv(expected_k, v.float(), expected_cache, meta.slot_mapping, scales)
    actual_q = rotary_store_kv(q, k, v, positions, rotary.cos, rotary.sin, cache, meta.slot_mapping, scales)
    torch.testing.assert_close(actual_q.float(), expected_q, **BF16)
    if cache_dtype == torch.bfloat16:
        torch.testing.assert_close(cache.float(), expected_cache.float(), **BF16)
    else:  # one fp8 step apart at most where the bf16 rounding of k moved it across a rounding boundary
        torch.testing.assert_close(cache.float(), expected_cache.float(), atol=0.02, rtol=0.13)


@pytest.mark.parametrize("rows, size", [(1, 14336), (64, 14336), (300, 1000)])
def test_silu_and_mul_bf16(rows, size):
    x = torch.randn(rows, 2 * size, device=CUDA).to(torch.bfloat16) * 3
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x))  # one bf16 step apart at most


def decode_step_kernels(folder: str) -> list[str]:
    """Names of the CUDA kernels one eager decode step launches (after a prefill of 40 tokens)."""
    model = load_model(load_model_config(folder, dtype="bfloat16"), CUDA)
    for layer in [m for m in model.modules() if isinstance(m, Attention)]:
        layer.kv_cache = torch.zeros(2, 8, 16, layer.num_kv_heads, layer.head_dim, dtype=torch.bfloat16, device=CUDA)
    state = RequestState("r", list(range(3, 45)), 42, SamplingParams(), 0, frozenset(), [5, 2, 7], 0)
    backend = TritonAttentionBackend()
    names = []
    for size in (40, 1, 1):  # prefill, a decode that compiles, the decode profiled
        inputs = prepare_inputs([state], {"r": size}, 16, CUDA)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.inference_mode(), forward_context(ForwardContext(inputs.attn_metadata, backend)):
                model(inputs.input_ids, inputs.positions)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and not e.name.startswith(("Memcpy", "Memset"))]
        state.num_computed_tokens += size
    return names


OUR_KERNELS = ("_rms_norm_kernel", "_rotary_kv_kernel", "_decode_kernel", "_decode_reduce_kernel",
               "_silu_and_mul_kernel", "_store_kv_kernel", "_prefill_kernel")


def test_a_decoder_layer_launches_about_ten_kernels(tmp_path):
    """Per layer = (kernels of a 4-layer model - kernels of a 2-layer one) / 2: two norms (residual add
    fused), qkv, rotary + KV write, attention, o_proj, gate_up, SiLU-and-mul, down = 9 (cuBLAS may add
    a split-K reduction to a GEMM). 42 keys at most: one split, no reduce."""
    counts = {}
    for num_layers in (2, 4):
        save_gpu_checkpoint(str(tmp_path / str(num_layers)), "llama", num_hidden_layers=num_layers)
        counts[num_layers] = decode_step_kernels(str(tmp_path / str(num_layers)))
    per_layer = (len(counts[4]) - len(counts[2])) / 2
    extra = Counter(counts[4]) - Counter(counts[2])  # two layers' kernels
    print(f"kernels per decoder layer: {per_layer}: {dict(extra)}")
    ours = Counter(k for name in extra.elements() for k in OUR_KERNELS if k in name)
    assert ours == {"_rms_norm_kernel": 4, "_rotary_kv_kernel": 2, "_decode_kernel": 2,
                    "_silu_and_mul_kernel": 2}, dict(extra)
    assert per_layer <= 11, dict(extra)
