"""Triton GEMM for AWQ and GPTQ weights (w4a16 / w8a16): y = x W^T, dequantizing W in the inner loop.

Tiles: x [BLOCK_M, BLOCK_K] times W^T [BLOCK_K, BLOCK_N]; each W tile is unpacked from int32 words
(GPTQ: word k // p of column n, value k % p; AWQ: word n // 8 of row k, nibble slot of column n % 8
in AWQ's order 0,2,4,6,1,3,5,7), its zero and scale gathered by group_index[k]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _awq_shift(columns):
    """Bit offset of column c of its 8 in an AWQ word: slot j holds column (0,2,4,6,1,3,5,7)[j]."""
    c = columns % 8
    return (c // 2) * 4 + (c % 2) * 16


@triton.jit
def _packed_int_gemm_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, group_ptr, out_ptr, M, N, K,
                            zero_offset, stride_xm, stride_qw, stride_qz, stride_s, stride_om,
                            BITS: tl.constexpr, IS_AWQ: tl.constexpr, IS_FP32: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask_bits = (1 << BITS) - 1
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & col_ok[None, :]
        if IS_AWQ:
            words = tl.load(qweight_ptr + ks[:, None] * stride_qw + (cols // PACK)[None, :], mask=tile_ok, other=0)
            q = (words >> _awq_shift(cols)[None, :]) & mask_bits
        else:
            words = tl.load(qweight_ptr + (ks // PACK)[:, None] * stride_qw + cols[None, :], mask=tile_ok, other=0)
            q = (words >> ((ks % PACK) * BITS)[:, None]) & mask_bits
        groups = tl.load(group_ptr + ks, mask=k_ok, other=0)
        zero_words = tl.load(qzeros_ptr + groups[:, None] * stride_qz + (cols // PACK)[None, :], mask=tile_ok, other=0)
        if IS_AWQ:
            zeros = (zero_words >> _awq_shift(cols)[None, :]) & mask_bits
        else:
            zeros = (zero_words >> ((cols % PACK) * BITS)[None, :]) & mask_bits
        scales = tl.load(scales_ptr + groups[:, None] * stride_s + cols[None, :], mask=tile_ok, other=0.0)
        w = ((q - zeros - zero_offset).to(tl.float32) * scales.to(tl.float32)).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        if IS_FP32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def packed_int_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      group_index: torch.Tensor, bits: int, is_awq: bool, zero_offset: int,
                      block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """x [..., K] -> [..., N] with W given as in packed_int.py (zero_offset: GPTQ classic's + 1)."""
    lead, num_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, num_in).contiguous()
    num_out = scales.shape[1]
    out = torch.empty((x2.shape[0], num_out), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out.reshape(*lead, num_out)
    grid = (triton.cdiv(x2.shape[0], block_m), triton.cdiv(num_out, block_n))
    _packed_int_gemm_kernel[grid](x2, qweight, qzeros, scales, group_index, out, x2.shape[0], num_out, num_in,
                                  zero_offset, x2.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0),
                                  out.stride(0), BITS=bits, IS_AWQ=is_awq, IS_FP32=x.dtype == torch.float32,
                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.reshape(*lead, num_out)
