"""The paged KV cache seen from Triton: the store kernel and the helpers both attention kernels share.

Layout of one layer's cache:
[2, num_blocks, block_size, num_kv_heads, head_dim]; a slot is block_id * block_size + offset. A one-plane
cache [1, ...] (MLA) passes its plane as both K and V: the store writes it twice, the kernels read V from it.
An fp8 cache holds k / k_scale and v / v_scale: the store divides and saturates, the attention kernels
multiply back (in fp32) before their dots. Prefill is in triton_prefill.py, decode in triton_decode.py,
the rotary embedding fused with the store in triton_rotary_kv.py.
NOTE: a launch without attention sinks passes None for sinks_ptr, which Triton's JIT makes a constexpr: the
HAS_SINKS=False kernels compile without the argument, to the same code as before sinks existed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.runtime.attention.torch_backend import is_fp8


@triton.jit
def _quantized(x, kv_scale, largest, IS_FP8: tl.constexpr):
    if IS_FP8:
        x = tl.clamp(x.to(tl.float32) / kv_scale, -largest, largest)
    return x


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, row_size, k_scale, v_scale, largest,
                     BLOCK: tl.constexpr, IS_FP8: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < row_size  # row = num_kv_heads * head_dim contiguous values
    k = _quantized(tl.load(k_ptr + token * row_size + cols, mask=mask), k_scale, largest, IS_FP8)
    v = _quantized(tl.load(v_ptr + token * row_size + cols, mask=mask), v_scale, largest, IS_FP8)
    tl.store(k_cache_ptr + slot * row_size + cols, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * row_size + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def largest_value(dtype: torch.dtype) -> float:
    """The saturation bound of an fp8 cache (unused otherwise)."""
    return torch.finfo(dtype).max if is_fp8(dtype) else 0.0


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] -> kv_cache[0/1] at slot_mapping."""
    num_tokens, row_size = k.shape[0], k.shape[1] * k.shape[2]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](k.contiguous(), v.contiguous(), kv_cache[0], kv_cache[-1], slot_mapping,
                                    row_size, kv_scales[0], kv_scales[1], largest_value(kv_cache.dtype),
                                    BLOCK=triton.next_power_of_2(row_size), IS_FP8=is_fp8(kv_cache.dtype))


@triton.jit
def _load_kv_tile(cache_ptr, table_row_ptr, positions, kv_head, dims, seq_len, block_size, num_kv_heads,
                  head_dim):
    """K or V for `positions` of one request and KV head: [BLOCK_N, BLOCK_D], zeros past seq_len."""
    valid = positions < seq_len
    block_ids = tl.load(table_row_ptr + positions // block_size, mask=valid, other=0)
    slots = block_ids.to(tl.int64) * block_size + positions % block_size
    offsets = (slots * num_kv_heads + kv_head)[:, None] * head_dim + dims[None, :]
    return tl.load(cache_ptr + offsets, mask=valid[:, None] & (dims[None, :] < head_dim), other=0.0)


@triton.jit
def _dequantized(x, kv_scale, dtype: tl.constexpr, IS_FP8: tl.constexpr):
    """A K or V tile in the dtype of the dots (the query's): fp8 multiplied back by its scale in fp32."""
    if IS_FP8:
        x = x.to(tl.float32) * kv_scale
    return x.to(dtype)


@triton.jit
def _dot(a, b, IS_FP32: tl.constexpr):
    """a @ b in fp32; fp32 models get exact fp32 products (not TF32), the rest tensor cores."""
    if IS_FP32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _soft_capped(scores, soft_cap, HAS_SOFT_CAP: tl.constexpr):
    """Gemma 2's logit cap: soft_cap * tanh(scores / soft_cap), with tanh(x) = 2 sigmoid(2x) - 1."""
    if HAS_SOFT_CAP:
        scores = soft_cap * (2.0 * tl.sigmoid(scores * (2.0 / soft_cap)) - 1.0)
    return scores


@triton.jit
def _with_sink(acc, l_i, m_i, sink):
    """(acc, l_i) of an online softmax at running max m_i, rescaled to max(m_i, sink) with exp(sink) added
    to the denominator (gpt-oss's attention sinks): nothing overflows, and a row that saw no key gets 0."""
    m = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m)
    return acc * alpha[:, None], l_i * alpha + tl.exp(sink - m)
