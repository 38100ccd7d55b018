"""Triton kernels of Gated DeltaNet for any step (prefill, mixed, decode): the short causal convolution and
the gated delta rule over the step's flattened tokens, each request reading and writing its state row in
place by its slot.

    tokens:            | r0: t0 t1 t2 | r1: t0 | r2: t0 t1 |       (query_start_loc: 0, 3, 4, 6)
    conv state row:       conv_states[slot]       [dim, kernel - 1]                 model dtype
    recurrent state row:  recurrent_states[slot]  [num_v_heads, head_k_dim, head_v_dim] float32

A program walks one request's tokens in order from its state row, or from zeros when the request is at
token 0 (seq_len == query_len, decided on the device), and leaves the state after its last token in the
row. A decode step is the case of one token per request: the launch reads nothing on the host, so a CUDA
graph can capture it.

Their torch references are gated_delta_ops.causal_conv1d and chunk_gated_delta_rule, one request at a time
(gated_delta_net.GatedDeltaNet.prefill), and the batched steps of GatedDeltaNet.decode.

NOTE: the delta rule here is the fused-recurrent form, token after token (the same math as the chunked
rule, which stays the CPU path and the reference). It reads and writes the [head_k_dim, head_v_dim] state
once per request, but its loop over tokens is sequential: for long prompts a chunked (WY) kernel, a few
tl.dot per 64 tokens as chunk_gated_delta_rule does in torch, would be faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

L2_EPS = 1e-6  # gated_delta_ops._L2_EPS
CONV_BLOCK_C = 128  # channels per conv program
MAX_BLOCK_V = 32  # value columns per delta-rule program


@triton.jit
def _token_range(query_start_ptr, seq_lens_ptr, request, num_rows):
    """(first token, number of tokens) of a request's step, and num_rows of its state row to read when the
    step follows earlier tokens, else 0: a request at token 0 starts from zeros (its slot's row is stale and
    never read)."""
    start = tl.load(query_start_ptr + request)
    num_tokens = tl.load(query_start_ptr + request + 1) - start
    return start, num_tokens, tl.where(tl.load(seq_lens_ptr + request) > num_tokens, num_rows, 0)


@triton.jit
def _window(x_ptr, row, start, sources, columns, channels, x_stride, is_channel, num_past, is_tap):
    """[BLOCK_C, BLOCK_W] inputs at the request's token indices `sources` (those < 0 come before the step:
    the state row's `columns`, of which num_past are read, zeros beyond), in x's dtype."""
    is_step = sources >= 0
    tokens = (start + tl.maximum(sources, 0)).to(tl.int64)
    mask = is_channel[:, None] & is_tap[None, :]
    step = tl.load(x_ptr + tokens[None, :] * x_stride + channels[:, None], mask=mask & is_step[None, :], other=0.0)
    past = tl.load(row + tl.where(is_step, 0, columns)[None, :],
                   mask=mask & (~is_step[None, :]) & (columns[None, :] < num_past), other=0.0)
    return tl.where(is_step[None, :], step, past.to(step.dtype))


@triton.jit
def _conv1d_varlen_kernel(x_ptr, weight_ptr, state_ptr, out_ptr, slots_ptr, seq_lens_ptr, query_start_ptr,
                          verify_ptr, verifying_ptr, x_stride, weight_stride, dim, num_rows, KERNEL: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, HAS_VERIFY: tl.constexpr):
    """One request, BLOCK_C channels, token after token: the window of token t is inputs t - KERNEL + 1 .. t
    (the earliest from the state row, or zeros), out_t = silu(window . weight) with products and sum in fp32;
    then the last KERNEL - 1 inputs go to the state row. HAS_VERIFY: a request flagged in verifying_ptr (its step
    verifies drafts) also leaves the state after each of its first num_rows tokens at verify_ptr[slot, t]."""
    request = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    taps = tl.arange(0, BLOCK_W)  # [BLOCK_W], KERNEL <= BLOCK_W: window position
    is_channel = channels < dim
    start, num_tokens, num_past = _token_range(query_start_ptr, seq_lens_ptr, request, KERNEL - 1)
    slot = tl.load(slots_ptr + request).to(tl.int64)
    # [BLOCK_C, 1]: this slot's rows, KERNEL - 1 past inputs per channel
    row = state_ptr + slot * dim * (KERNEL - 1) + channels[:, None] * (KERNEL - 1)
    weight = tl.load(weight_ptr + channels[:, None] * weight_stride + taps[None, :],
                     mask=is_channel[:, None] & (taps[None, :] < KERNEL), other=0.0).to(tl.float32)
    for t in range(0, num_tokens):
        window = _window(x_ptr, row, start, t + taps - (KERNEL - 1), t + taps, channels, x_stride, is_channel,
                         num_past, taps < KERNEL)
        acc = tl.sum(window.to(tl.float32) * weight, axis=1)
        out = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (start + t).to(tl.int64) * dim + channels, out.to(out_ptr.dtype.element_ty),
                 mask=is_channel)
        if HAS_VERIFY:  # the state after token t: inputs t - KERNEL + 2 .. t
            keeps = tl.where(t < num_rows, tl.load(verifying_ptr + request), 0)  # (a block below: the interpreter)
            after = _window(x_ptr, row, start, t + 1 + taps - (KERNEL - 1), t + 1 + taps, channels, x_stride,
                            is_channel, num_past, taps < KERNEL - 1)
            copy = verify_ptr + ((slot * num_rows + t) * dim + channels[:, None]) * (KERNEL - 1) + taps[None, :]
            tl.store(copy, after.to(verify_ptr.dtype.element_ty),
                     mask=is_channel[:, None] & (taps[None, :] < KERNEL - 1)
                     & ((channels[:, None] * 0 + taps[None, :] * 0 + keeps) != 0))
    # state column p: input num_tokens - KERNEL + 1 + p (before the step: the row's column num_tokens + p)
    last = _window(x_ptr, row, start, num_tokens + taps - (KERNEL - 1), num_tokens + taps, channels, x_stride,
                   is_channel, num_past, taps < KERNEL - 1)
    tl.debug_barrier()  # every read of the row (by any thread) before the row is overwritten
    tl.store(row + taps[None, :], last.to(state_ptr.dtype.element_ty),
             mask=is_channel[:, None] & (taps[None, :] < KERNEL - 1))


@triton.jit
def _gated_delta_varlen_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, seq_lens_ptr,
                               query_start_ptr, verify_ptr, verifying_ptr, q_stride, k_stride, v_stride, num_v_heads,
                               group, head_k_dim, head_v_dim, num_rows, scale, eps, BLOCK_K: tl.constexpr,
                               BLOCK_V: tl.constexpr, HAS_VERIFY: tl.constexpr):
    """One request, one value head, BLOCK_V of its value columns (a column of S updates on its own), token
    after token:

        S = exp(g) S;   u = beta (v - S^T k);   S = S + k u^T;   o = S^T q      (q, k l2-normalized, q scaled)

    S [head_k_dim, BLOCK_V] float32 stays in registers from the request's slot row (or zeros) to its store.
    HAS_VERIFY: a request flagged in verifying_ptr also leaves S after each of its first num_rows tokens at
    verify_ptr[slot, t] (speculative decoding's per-token states, worker/state_rollback.py)."""
    request = tl.program_id(0)
    head = tl.program_id(1)
    columns = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    is_row, is_column = rows < head_k_dim, columns < head_v_dim
    start, num_tokens, num_read = _token_range(query_start_ptr, seq_lens_ptr, request, head_k_dim)
    slot = tl.load(slots_ptr + request).to(tl.int64)
    key_head = head // group
    # [BLOCK_K, BLOCK_V] of S: row-major [head_k_dim, head_v_dim] per (slot, head)
    cells = state_ptr + (slot * num_v_heads + head) * head_k_dim * head_v_dim \
        + rows[:, None] * head_v_dim + columns[None, :]
    is_cell = is_row[:, None] & is_column[None, :]
    state = tl.load(cells, mask=(rows[:, None] < num_read) & is_column[None, :], other=0.0)
    for t in range(0, num_tokens):
        token = (start + t).to(tl.int64)
        q = tl.load(q_ptr + token * q_stride + key_head * head_k_dim + rows, mask=is_row, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + token * k_stride + key_head * head_k_dim + rows, mask=is_row, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + token * v_stride + head * head_v_dim + columns, mask=is_column, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        g = tl.load(g_ptr + token * num_v_heads + head).to(tl.float32)
        beta = tl.load(beta_ptr + token * num_v_heads + head).to(tl.float32)
        state = state * tl.exp(g)
        update = (v - tl.sum(state * k[:, None], axis=0)) * beta  # [BLOCK_V]
        state = state + k[:, None] * update[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + (token * num_v_heads + head) * head_v_dim + columns, out.to(out_ptr.dtype.element_ty),
                 mask=is_column)
        if HAS_VERIFY:
            keeps = tl.where(t < num_rows, tl.load(verifying_ptr + request), 0)  # (a block below: the interpreter)
            copy = verify_ptr + ((slot * num_rows + t) * num_v_heads + head) * head_k_dim * head_v_dim \
                + rows[:, None] * head_v_dim + columns[None, :]
            tl.store(copy, state, mask=is_cell & ((rows[:, None] * 0 + columns[None, :] * 0 + keeps) != 0))
    tl.store(cells, state, mask=is_cell)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, verify_states: torch.Tensor | None = None,
                         verifying: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, dim] (the step's tokens, rows may be strided), weight [dim, kernel], conv_states
    [num_slots, dim, kernel - 1] (updated in place at rows slots [num_requests]), seq_lens [num_requests] and
    query_start_loc [num_requests + 1] int32 -> silu(conv) [num_tokens, dim] in x's dtype. verify_states
    [num_slots, rows, dim, kernel - 1] with verifying [num_requests] int32: the flagged requests' state after each
    of their first `rows` tokens."""
    num_tokens, dim = x.shape
    kernel = weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and conv_states.is_contiguous()
    out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device)
    num_requests = slots.shape[0]
    if num_requests == 0:
        return out
    grid = (num_requests, triton.cdiv(dim, CONV_BLOCK_C))
    has_verify = verify_states is not None and verifying is not None
    assert not has_verify or verify_states.is_contiguous()  # type: ignore[union-attr]
    _conv1d_varlen_kernel[grid](x, weight, conv_states, out, slots, seq_lens, query_start_loc,
                                verify_states if has_verify else conv_states, verifying if has_verify else slots,
                                x.stride(0), weight.stride(0), dim,
                                verify_states.shape[1] if verify_states is not None and has_verify else 0,
                                KERNEL=kernel, BLOCK_C=CONV_BLOCK_C, BLOCK_W=triton.next_power_of_2(kernel),
                                HAS_VERIFY=has_verify, num_warps=4)
    return out


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            recurrent_states: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, verify_states: torch.Tensor | None = None,
                            verifying: torch.Tensor | None = None) -> torch.Tensor:
    """q, k [num_tokens, num_k_heads, head_k_dim], v [num_tokens, num_v_heads, head_v_dim] (rows may be
    strided, heads packed), g and beta [num_tokens, num_v_heads], recurrent_states [num_slots, num_v_heads,
    head_k_dim, head_v_dim] float32 (updated in place at rows slots [num_requests]) -> out [num_tokens,
    num_v_heads, head_v_dim] in v's dtype. verify_states [num_slots, rows, num_v_heads, head_k_dim, head_v_dim]
    float32 with verifying [num_requests] int32: the flagged requests' state after each of their first `rows`
    tokens."""
    num_tokens, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[2]
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be packed within a row"
    assert recurrent_states.is_contiguous() and recurrent_states.dtype == torch.float32
    out = torch.empty(num_tokens, num_v_heads, head_v_dim, dtype=v.dtype, device=v.device)
    num_requests = slots.shape[0]
    if num_requests == 0:
        return out
    block_v = min(triton.next_power_of_2(head_v_dim), MAX_BLOCK_V)
    grid = (num_requests, num_v_heads, triton.cdiv(head_v_dim, block_v))
    has_verify = verify_states is not None and verifying is not None
    assert not has_verify or verify_states.is_contiguous()  # type: ignore[union-attr]
    _gated_delta_varlen_kernel[grid](q, k, v, g.contiguous(), beta.contiguous(), recurrent_states, out, slots,
                                     seq_lens, query_start_loc, verify_states if has_verify else recurrent_states,
                                     verifying if has_verify else slots, q.stride(0), k.stride(0), v.stride(0),
                                     num_v_heads, num_v_heads // q.shape[1], head_k_dim, head_v_dim,
                                     verify_states.shape[1] if verify_states is not None and has_verify else 0,
                                     head_k_dim ** -0.5, L2_EPS,
                                     BLOCK_K=triton.next_power_of_2(head_k_dim), BLOCK_V=block_v,
                                     HAS_VERIFY=has_verify, num_warps=4)
    return out
