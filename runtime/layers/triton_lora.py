"""Triton gathered matmul for batched LoRA (Punica style): every token times its own slot's weight.

The grid is (row blocks, column blocks, slots). Program (m, n, l) takes rows [m * BLOCK_M, (m + 1) *
BLOCK_M) of slot l's run in sorted_tokens (lora_ops.py draws the layout) and columns [n * BLOCK_N, ...):

    sorted_tokens: | slot 0: t2 t4 | slot 1: t0 t3 t5 ... | (no slot) |
                     ^ m = 0         ^ m = 0   ^ m = 1 ...
    out rows:      scattered back to each token's own row, so no permutation is copied in or out.

A program whose m is past its slot's run exits at once: the grid's first dim comes from the host's
max_tokens_per_slot, so nothing is read back from the device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.runtime.layers.lora_batch import LoRABatch, check_gathered_shapes


@triton.jit
def _gathered_matmul_kernel(x_ptr, w_ptr, out_ptr, sorted_tokens_ptr, slot_starts_ptr, num_outputs, num_inputs,
                            stride_xt, stride_wl, stride_wn, stride_wk, stride_ot, ADD: tl.constexpr,
                            IS_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """out[t, n] (=, or += when ADD) sum_k x[t, k] * w[l, n, k] for BLOCK_M tokens t of slot l; float32
    accumulator, one rounding to out's dtype at the store."""
    slot = tl.program_id(2)
    start = tl.load(slot_starts_ptr + slot)
    count = tl.load(slot_starts_ptr + slot + 1) - start
    first = tl.program_id(0) * BLOCK_M
    if first >= count:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    row_ok = offs_m < count
    tokens = tl.load(sorted_tokens_ptr + start + offs_m, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < num_outputs
    # NOTE: int64 offsets: slot * stride_wl and token * stride_xt pass 2**31 in large buffers
    w_rows = w_ptr + slot.to(tl.int64) * stride_wl + cols.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    x_rows = x_ptr + tokens[:, None] * stride_xt  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, num_inputs, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < num_inputs
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + ks.to(tl.int64)[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0).to(x.dtype)  # w[l]^T tile: [BLOCK_K, BLOCK_N]
        if IS_FP32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out = out_ptr + tokens[:, None] * stride_ot + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if ADD:
        acc += tl.load(out, mask=out_ok, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_ok)


def _tile(size: int, largest: int) -> int:
    """A power of two covering `size`, at least 16 (tl.dot's smallest dim) and at most `largest`."""
    return max(16, min(largest, triton.next_power_of_2(max(size, 1))))


def block_sizes(max_tokens_per_slot: int, num_outputs: int, num_inputs: int,
                is_fp32: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 rows while slots see few tokens (decode), 64 above; N and K tiles
    fitted to the rank side (8..64) and capped at 64 (32 in float32) on the wide side.
    NOTE: fixed shapes, no autotuning, so a captured graph and an eager step run the same code."""
    largest = 32 if is_fp32 else 64
    block_m = 16 if max_tokens_per_slot <= 16 else 64
    return block_m, _tile(num_outputs, largest), _tile(num_inputs, largest)


def lora_gathered_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, batch: LoRABatch, add: bool) -> None:
    """x [T, K], w [L, N, K] (any strides), out [T, N] in place: out (=, or += when add) x @ w[slot].T per
    token with an adapter; add=False leaves zeros in the rows of tokens without one."""
    check_gathered_shapes(x, w, out, batch)
    if (x.stride(1) != 1 and x.shape[1] > 1) or (out.stride(1) != 1 and out.shape[1] > 1):
        raise ValueError("x and out need a unit stride in their last dimension")
    if not add:
        # NOTE: rows of tokens without a slot belong to no program; zeroing all of out first (a [T, rank]
        # memset for shrink) is cheaper than a program per such row
        out.zero_()
    num_slots, num_outputs, num_inputs = w.shape
    if batch.max_tokens_per_slot == 0 or num_outputs == 0:
        return
    is_fp32 = x.dtype == torch.float32
    block_m, block_n, block_k = block_sizes(batch.max_tokens_per_slot, num_outputs, num_inputs, is_fp32)
    grid = (triton.cdiv(batch.max_tokens_per_slot, block_m), triton.cdiv(num_outputs, block_n), num_slots)
    _gathered_matmul_kernel[grid](x, w, out, batch.sorted_tokens, batch.slot_starts, num_outputs, num_inputs,
                                  x.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0), ADD=add,
                                  IS_FP32=is_fp32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                  num_warps=4)
