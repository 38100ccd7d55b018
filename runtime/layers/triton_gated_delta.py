"""Triton kernels of Gated DeltaNet's decode step: the short convolution's update and the gated delta rule's
recurrent step, each reading and writing a request's state row in place by its slot.

Their torch references are gated_delta_ops.causal_conv1d_step and recurrent_gated_delta_step (with the
gather, zeroing and scatter that gated_delta_net.GatedDeltaNet.decode wraps around them). Both kernels
decide on the device whether a request starts from a zero state (seq_len == query_len), so a step holds
no host read and a CUDA graph can capture it.

    conv state row:       conv_states[slot]       [dim, kernel - 1]                 model dtype
    recurrent state row:  recurrent_states[slot]  [num_v_heads, head_k_dim, head_v_dim] float32
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

L2_EPS = 1e-6  # gated_delta_ops._L2_EPS
CONV_BLOCK_C = 128  # channels per conv program
MAX_BLOCK_V = 32  # value columns per delta-rule program


@triton.jit
def _rows_to_read(seq_lens_ptr, query_start_ptr, request, num_rows):
    """num_rows of the request's state row when its step follows earlier tokens, else 0: a request at
    token 0 starts from zeros (its slot's row is stale and never read)."""
    query_len = tl.load(query_start_ptr + request + 1) - tl.load(query_start_ptr + request)
    return tl.where(tl.load(seq_lens_ptr + request) > query_len, num_rows, 0)


@triton.jit
def _conv1d_decode_kernel(x_ptr, weight_ptr, state_ptr, out_ptr, slots_ptr, seq_lens_ptr, query_start_ptr,
                          x_stride, weight_stride, dim, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_W: tl.constexpr):
    """One request's token, BLOCK_C channels: window = state | x, out = silu(window . weight), and the
    state shifted left by one with x at its end, written back in place. Products and the sum in fp32."""
    request = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    taps = tl.arange(0, BLOCK_W)  # [BLOCK_W], KERNEL <= BLOCK_W: window position
    is_channel = channels < dim
    num_past = _rows_to_read(seq_lens_ptr, query_start_ptr, request, KERNEL - 1)
    slot = tl.load(slots_ptr + request).to(tl.int64)
    x = tl.load(x_ptr + request.to(tl.int64) * x_stride + channels, mask=is_channel, other=0.0)  # [BLOCK_C]
    # [BLOCK_C, BLOCK_W]: this slot's rows, KERNEL - 1 past inputs each
    row = state_ptr + slot * dim * (KERNEL - 1) + channels[:, None] * (KERNEL - 1) + taps[None, :]
    is_past = is_channel[:, None] & (taps[None, :] < KERNEL - 1)
    past = tl.load(row, mask=is_channel[:, None] & (taps[None, :] < num_past), other=0.0).to(x.dtype)
    window = tl.where(taps[None, :] == KERNEL - 1, x[:, None], past)
    weight = tl.load(weight_ptr + channels[:, None] * weight_stride + taps[None, :],
                     mask=is_channel[:, None] & (taps[None, :] < KERNEL), other=0.0)
    acc = tl.sum(window.to(tl.float32) * weight.to(tl.float32), axis=1)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + request.to(tl.int64) * dim + channels, out.to(out_ptr.dtype.element_ty), mask=is_channel)
    later = tl.load(row + 1, mask=is_channel[:, None] & (taps[None, :] + 1 < num_past), other=0.0)
    shifted = tl.where(taps[None, :] + 1 == KERNEL - 1, x[:, None].to(later.dtype), later)
    tl.store(row, shifted.to(state_ptr.dtype.element_ty), mask=is_past)


@triton.jit
def _gated_delta_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, seq_lens_ptr,
                               query_start_ptr, q_stride, k_stride, v_stride, num_v_heads, group, head_k_dim,
                               head_v_dim, scale, eps, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One request, one value head, BLOCK_V of its value columns (a column of S updates on its own):

        S = exp(g) S;   u = beta (v - S^T k);   S = S + k u^T;   o = S^T q      (q, k l2-normalized, q scaled)

    S [head_k_dim, BLOCK_V] float32 is read from and written back to the request's slot."""
    request = tl.program_id(0)
    head = tl.program_id(1)
    columns = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    is_row, is_column = rows < head_k_dim, columns < head_v_dim
    num_read = _rows_to_read(seq_lens_ptr, query_start_ptr, request, head_k_dim)
    slot = tl.load(slots_ptr + request).to(tl.int64)
    r64 = request.to(tl.int64)
    key_head = head // group
    q = tl.load(q_ptr + r64 * q_stride + key_head * head_k_dim + rows, mask=is_row, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + r64 * k_stride + key_head * head_k_dim + rows, mask=is_row, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + r64 * v_stride + head * head_v_dim + columns, mask=is_column, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    g = tl.load(g_ptr + r64 * num_v_heads + head).to(tl.float32)
    beta = tl.load(beta_ptr + r64 * num_v_heads + head).to(tl.float32)
    # [BLOCK_K, BLOCK_V] of S: row-major [head_k_dim, head_v_dim] per (slot, head)
    cells = state_ptr + (slot * num_v_heads + head) * head_k_dim * head_v_dim \
        + rows[:, None] * head_v_dim + columns[None, :]
    is_cell = is_row[:, None] & is_column[None, :]
    state = tl.load(cells, mask=(rows[:, None] < num_read) & is_column[None, :], other=0.0) * tl.exp(g)
    update = (v - tl.sum(state * k[:, None], axis=0)) * beta  # [BLOCK_V]
    state = state + k[:, None] * update[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + (r64 * num_v_heads + head) * head_v_dim + columns, out.to(out_ptr.dtype.element_ty),
             mask=is_column)
    tl.store(cells, state, mask=is_cell)


def conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """x [num_requests, dim] (one token each), weight [dim, kernel], conv_states [num_slots, dim, kernel - 1]
    (updated in place at rows slots [num_requests]) -> out [num_requests, dim] in x's dtype."""
    num_requests, dim = x.shape
    kernel = weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and conv_states.is_contiguous()
    out = torch.empty(num_requests, dim, dtype=x.dtype, device=x.device)
    if num_requests == 0:
        return out
    grid = (num_requests, triton.cdiv(dim, CONV_BLOCK_C))
    _conv1d_decode_kernel[grid](x, weight, conv_states, out, slots, seq_lens, query_start_loc, x.stride(0),
                                weight.stride(0), dim, KERNEL=kernel, BLOCK_C=CONV_BLOCK_C,
                                BLOCK_W=triton.next_power_of_2(kernel), num_warps=4)
    return out


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       recurrent_states: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor) -> torch.Tensor:
    """q, k [num_requests, num_k_heads, head_k_dim], v [num_requests, num_v_heads, head_v_dim] (rows may be
    strided, heads packed), g and beta [num_requests, num_v_heads], recurrent_states [num_slots, num_v_heads,
    head_k_dim, head_v_dim] float32 (updated in place at rows slots) -> out [num_requests, num_v_heads,
    head_v_dim] in v's dtype."""
    num_requests, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[2]
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be packed within a row"
    assert recurrent_states.is_contiguous() and recurrent_states.dtype == torch.float32
    out = torch.empty(num_requests, num_v_heads, head_v_dim, dtype=v.dtype, device=v.device)
    if num_requests == 0:
        return out
    block_v = min(triton.next_power_of_2(head_v_dim), MAX_BLOCK_V)
    grid = (num_requests, num_v_heads, triton.cdiv(head_v_dim, block_v))
    _gated_delta_decode_kernel[grid](q, k, v, g.contiguous(), beta.contiguous(), recurrent_states, out, slots,
                                     seq_lens, query_start_loc, q.stride(0), k.stride(0), v.stride(0), num_v_heads,
                                     num_v_heads // q.shape[1], head_k_dim, head_v_dim, head_k_dim ** -0.5, L2_EPS,
                                     BLOCK_K=triton.next_power_of_2(head_k_dim), BLOCK_V=block_v, num_warps=4)
    return out
