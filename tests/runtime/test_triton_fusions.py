"""The fused kernels under TRITON_INTERPRET=1 against their torch references (rotary embedding + KV
write, SiLU-and-mul), and what the attention of a Llama layer launches on the Triton backend."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from shardserve.runtime.attention import triton_decode, triton_kernels, triton_prefill, triton_rotary_kv  # noqa: E402
from shardserve.runtime.attention.layer import Attention  # noqa: E402
from shardserve.runtime.attention.torch_backend import write_kv  # noqa: E402
from shardserve.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context  # noqa: E402
from shardserve.runtime.layers.activation import silu_and_mul_reference  # noqa: E402
from shardserve.runtime.layers.rotary import RotaryEmbedding  # noqa: E402
from shardserve.runtime.layers.triton_activation import silu_and_mul  # noqa: E402
from tests.runtime import attention_cases  # noqa: E402
from tests.runtime.kernel_launches import count_launches  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def rotary_case(num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q, k, v as strided views of one qkv projection, positions, shuffled slots."""
    meta = attention_cases.make_batch([(3, 9), (40, 1), (0, 5)], 16, 12, torch.device("cpu"), seed)
    generator = torch.Generator().manual_seed(seed)
    num_tokens = meta.query_start_loc_cpu[-1]
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 512, (num_tokens,), generator=generator)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim), positions, meta.slot_mapping)


@pytest.mark.parametrize("head_dim, rotary_dim, params", [(64, None, LLAMA3_ROPE), (128, None, DEFAULT_ROPE),
                                                          (64, 32, DEFAULT_ROPE), (24, 16, LLAMA3_ROPE)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_store_kv_matches_rotary_then_write(head_dim, rotary_dim, params, dtype):
    q, k, v, positions, slots = rotary_case(8, 2, head_dim, dtype)
    rotary = RotaryEmbedding(head_dim, 512, params, rotary_dim)
    cache = torch.zeros(2, 12, 16, 2, head_dim, dtype=dtype)
    expected_cache = cache.clone()
    expected_q, expected_k = rotary(positions, q, k)
    write_kv(expected_k, v, expected_cache, slots)
    actual_q = triton_rotary_kv.rotary_store_kv(q, k, v, positions, rotary.cos, rotary.sin, cache, slots)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=2e-3)
    torch.testing.assert_close(actual_q, expected_q, **tolerance)
    torch.testing.assert_close(cache, expected_cache, **tolerance)
    assert actual_q.is_contiguous() and cache[1].abs().sum() > 0
    if rotary_dim is not None:  # the features past rotary_dim are copied as they are
        assert torch.equal(actual_q[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rotary_store_kv_quantizes_an_fp8_cache(dtype):
    """Bit for bit at position 0 (no rotation) on fp8 values times the scale, as test_triton_kernels.py
    does for store_kv: the interpreter rounds to fp8 its own way; the GPU test checks rounding."""
    scales = (0.5, 2.0)
    q, k, v, positions, slots = rotary_case(4, 2, 64, torch.float32, seed=3)
    k, v, positions = k.to(dtype).float() * scales[0], v.to(dtype).float() * scales[1], torch.zeros_like(positions)
    k[0, 0, 0] = -1e6  # saturates at the format's largest value, never inf or nan
    rotary = RotaryEmbedding(64, 512, DEFAULT_ROPE)
    cache = torch.zeros(2, 12, 16, 2, 64, dtype=dtype)
    expected_cache = cache.clone()
    write_kv(rotary(positions, q, k)[1], v, expected_cache, slots, scales)
    triton_rotary_kv.rotary_store_kv(q, k, v, positions, rotary.cos, rotary.sin, cache, slots, scales)
    assert cache[0].flatten()[slots[0] * 128].float() == -torch.finfo(dtype).max
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))


@pytest.mark.parametrize("shape", [(5, 2 * 96), (3, 2 * 1500), (0, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul_matches_reference(shape, dtype):
    wide = torch.randn(shape[0], shape[1] + 8, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    x = wide[:, 4: 4 + shape[1]]  # a strided view, as a column slice of a bigger projection would be
    # NOTE: the interpreter converts to bf16 by truncation (numpy has no bf16): two bf16 steps apart
    # at most there; fp32 and fp16 round as the GPU does and match the reference's rounding exactly.
    rtol = 1.6e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=1e-6, rtol=rtol)


def _inside_triton() -> bool:
    """Called from Triton's interpreter (which copies a launch's tensors with torch ops of its own)?"""
    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}triton{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class AtenOps(TorchDispatchMode):
    """Records the aten ops that compute something (views and allocations launch no kernel)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in ("empty", "empty_strided", "empty_like") and not _inside_triton():
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shapes, kernels", [
    ([(20, 1), (7, 1)], ["_rotary_kv_kernel", "_decode_kernel"]),
    ([(20, 3), (0, 5)], ["_rotary_kv_kernel", "_prefill_kernel"])])
def test_llama_attention_launches_two_kernels_between_its_projections(shapes, kernels, checkpoint_factory):
    """A Llama layer's attention on the Triton backend: qkv projection, one kernel that rotates and
    writes the cache, one attention kernel, output projection; nothing else computes."""
    from shardserve.runtime.config import load_model_config
    from shardserve.runtime.worker.loader import load_model

    folder, _ = checkpoint_factory("llama3")
    model = load_model(load_model_config(folder), torch.device("cpu"))
    layer = model.model.layers[0].self_attn
    attn = [m for m in model.modules() if isinstance(m, Attention)][0]
    attn.kv_cache = torch.zeros(2, 8, 16, attn.num_kv_heads, attn.head_dim)
    meta = attention_cases.make_batch(shapes, 16, 8, torch.device("cpu"))
    num_tokens = meta.query_start_loc_cpu[-1]
    hidden = torch.randn(num_tokens, model.model.embed_tokens.weight.shape[1])
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(meta.seq_lens_cpu, (n for _, n in shapes))])
    recorder = AtenOps()
    with torch.inference_mode(), forward_context(ForwardContext(meta, TritonAttentionBackend())):
        with count_launches(triton_kernels, triton_rotary_kv, triton_decode, triton_prefill) as launches, recorder:
            layer(positions, hidden)
    assert launches == kernels
    assert recorder.ops == ["linear", "linear"], recorder.ops  # qkv_proj and o_proj
