"""The rotary embedding fused with the KV-cache write: one kernel reads q, k and v (strided views of the
qkv projection), writes q rotated and stores k rotated and v into their cache slots.

Per head (NeoX half rotation, as runtime/layers/rotary.py), with h = rotary_dim // 2:

    x:    | x1 = x[:h] | x2 = x[h:2h] | rest = x[2h:head_dim] (kept; partial rotary) |
    out:  | x1 cos - x2 sin | x2 cos + x1 sin | rest |

cos and sin are the layer's float32 tables [max_position, h] (attention factor included); the rotation
is done in fp32 and rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.runtime.attention.torch_backend import is_fp8
from shardserve.runtime.attention.triton_kernels import _quantized, largest_value


@triton.jit
def _rotated_heads(x_ptr, heads, num_heads, head_dim, half, cos, sin, BLOCK_HALF: tl.constexpr):
    """Rows `heads` of one token: (first half rotated, second half rotated) in fp32, [BLOCK_H, BLOCK_HALF] each."""
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (cols < half)[None, :]
    base = x_ptr + heads[:, None] * head_dim + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask


@triton.jit
def _rest(x_ptr, heads, num_heads, head_dim, rotary_dim, BLOCK_D: tl.constexpr):
    """The features past rotary_dim (none unless partial rotary): offsets, values, mask."""
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (dims >= rotary_dim)[None, :] & (dims < head_dim)[None, :]
    offsets = heads[:, None] * head_dim + dims[None, :]
    return offsets, tl.load(x_ptr + offsets, mask=mask, other=0.0), mask


@triton.jit
def _rotary_kv_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                      slot_ptr, q_stride, k_stride, v_stride, num_heads, num_kv_heads, head_dim, rotary_dim,
                      k_scale, v_scale, largest, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                      BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
                      IS_PARTIAL: tl.constexpr):
    """One token: q [num_heads, head_dim] -> q_out (rotated); k, v [num_kv_heads, head_dim] -> the cache
    slot, k rotated; quantized by the per-tensor scales when the cache is fp8."""
    token = tl.program_id(0).to(tl.int64)
    half = rotary_dim // 2
    cols = tl.arange(0, BLOCK_HALF)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + position * half + cols, mask=cols < half, other=0.0)
    sin = tl.load(sin_ptr + position * half + cols, mask=cols < half, other=0.0)
    q_in, q_out = q_ptr + token * q_stride, q_out_ptr + token * num_heads * head_dim
    heads = tl.arange(0, BLOCK_H)
    out1, out2, mask = _rotated_heads(q_in, heads, num_heads, head_dim, half, cos, sin, BLOCK_HALF)
    at = heads[:, None] * head_dim + cols[None, :]
    tl.store(q_out + at, out1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(q_out + at + half, out2.to(q_out_ptr.dtype.element_ty), mask=mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    k_in, v_in = k_ptr + token * k_stride, v_ptr + token * v_stride
    k_slot, v_slot = k_cache_ptr + slot * num_kv_heads * head_dim, v_cache_ptr + slot * num_kv_heads * head_dim
    kv_heads = tl.arange(0, BLOCK_KV)
    out1, out2, mask = _rotated_heads(k_in, kv_heads, num_kv_heads, head_dim, half, cos, sin, BLOCK_HALF)
    at = kv_heads[:, None] * head_dim + cols[None, :]
    cache_type = k_cache_ptr.dtype.element_ty
    tl.store(k_slot + at, _quantized(out1, k_scale, largest, IS_FP8).to(cache_type), mask=mask)
    tl.store(k_slot + at + half, _quantized(out2, k_scale, largest, IS_FP8).to(cache_type), mask=mask)
    if IS_PARTIAL:
        offsets, rest, mask = _rest(q_in, heads, num_heads, head_dim, rotary_dim, BLOCK_D)
        tl.store(q_out + offsets, rest, mask=mask)
        offsets, rest, mask = _rest(k_in, kv_heads, num_kv_heads, head_dim, rotary_dim, BLOCK_D)
        tl.store(k_slot + offsets, _quantized(rest, k_scale, largest, IS_FP8).to(cache_type), mask=mask)
    dims = tl.arange(0, BLOCK_D)
    v_mask = (kv_heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]
    v_at = kv_heads[:, None] * head_dim + dims[None, :]
    v = tl.load(v_in + v_at, mask=v_mask, other=0.0)
    tl.store(v_slot + v_at, _quantized(v, v_scale, largest, IS_FP8).to(cache_type), mask=v_mask)


def _rows(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[num_tokens, num_heads(, head_dim)] with each token's heads contiguous (a strided view of qkv
    stays a view); a copy only when the heads themselves are strided."""
    rows = x.reshape(x.shape[0], num_heads * head_dim)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim] (row strides free),
    positions: [num_tokens], cos/sin: [max_position, rotary_dim // 2] float32.
    Returns q rotated, contiguous; k rotated and v are written to kv_cache at slot_mapping."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, rotary_dim = k.shape[1], 2 * cos.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    q_rows, k_rows, v_rows = _rows(q, num_heads, head_dim), _rows(k, num_kv_heads, head_dim), _rows(
        v, num_kv_heads, head_dim)
    _rotary_kv_kernel[(num_tokens,)](
        q_rows, k_rows, v_rows, positions, cos.contiguous(), sin.contiguous(), q_out, kv_cache[0], kv_cache[-1],
        slot_mapping, q_rows.stride(0), k_rows.stride(0), v_rows.stride(0), num_heads, num_kv_heads, head_dim,
        rotary_dim, kv_scales[0], kv_scales[1], largest_value(kv_cache.dtype),
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2), BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8(kv_cache.dtype), IS_PARTIAL=rotary_dim < head_dim, num_warps=4)
    return q_out
