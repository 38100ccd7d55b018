"""Fused mixture-of-experts over quantized experts on the GPU: triton_moe's align step and grouped GEMMs,
each weight tile dequantized in the inner loop (fp8 with per-tensor, per-channel or block scales; AWQ or
GPTQ 4- or 8-bit with zero points and group scales).

One expert matrix W [N, K] (N outputs, K inputs), stacked over E experts, as the kernels read it:

    FP8   weight [E, N, K] float8_e4m3fn          scale [E, ceil(N / group_n), ceil(K / group_k)] float32
    AWQ   qweight [E, K, N / p], word n // 8 of row k, nibble slot of column n % 8 in 0,2,4,6,1,3,5,7
    GPTQ  qweight [E, K / p, N], value k % p of word k // p of column n
          AWQ and GPTQ: qzeros [E, K / group_k, N / p] (packed like AWQ's or GPTQ's qweight columns),
          scales [E, K / group_k, N]

    fp8:  W[n, k] = weight[n, k] * scale[n // group_n, k // group_k]
    int:  W[n, k] = (q[k, n] - zero[k // group_k, n] - zero_offset) * scale[k // group_k, n]

Every matrix's last dimension is contiguous (the kernels assume it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shardserve.runtime.layers.quantization.triton_packed_int import _awq_shift
from shardserve.runtime.layers.triton_moe import block_sizes, moe_align

FP8, AWQ, GPTQ = 0, 1, 2  # the kernels' FORMAT
NUM_WARPS = 8


@dataclass(frozen=True)
class QuantizedExperts:
    """One stacked expert matrix (w13 or w2) in a layout of the module docstring."""

    weight: torch.Tensor  # fp8 weight or int32 qweight
    scale: torch.Tensor
    zeros: torch.Tensor | None  # int32 qzeros; None for fp8
    format: int  # FP8 | AWQ | GPTQ
    group_n: int = 1  # fp8: outputs sharing a scale
    group_k: int = 1  # inputs sharing a scale (and a zero point)
    bits: int = 8
    zero_offset: int = 0  # GPTQ's classic format stores zero - 1

    @property
    def num_inputs(self) -> int:
        if self.format == GPTQ:
            return self.weight.shape[1] * (32 // self.bits)
        return self.weight.shape[2 if self.format == FP8 else 1]

    def kernel_args(self) -> tuple:
        """(w, scale, zeros, their expert and row strides, group_n, group_k, zero_offset) as the kernels take them."""
        zeros = self.scale if self.zeros is None else self.zeros  # fp8: a placeholder never read
        for t in (self.weight, self.scale, zeros):
            assert t.stride(-1) == 1, "quantized expert matrices need a contiguous last dimension"
        return (self.weight, self.scale, zeros, self.weight.stride(0), self.weight.stride(1), self.scale.stride(0),
                self.scale.stride(1), zeros.stride(0), zeros.stride(1), self.group_n, self.group_k, self.zero_offset)


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, expert, cols, ks, ok, stride_we, stride_wr, stride_se, stride_sr,
                 stride_ze, stride_zr, group_n, group_k, zero_offset, FORMAT: tl.constexpr, BITS: tl.constexpr):
    """W^T [BLOCK_K, BLOCK_N] in float32 for inputs `ks` and outputs `cols` of one expert (zero where not ok)."""
    e = expert.to(tl.int64)
    if FORMAT == 0:
        w = tl.load(w_ptr + e * stride_we + cols[None, :] * stride_wr + ks[:, None], mask=ok, other=0.0)
        s = tl.load(s_ptr + e * stride_se + (cols // group_n)[None, :] * stride_sr + (ks // group_k)[:, None],
                    mask=ok, other=0.0)
        tile = w.to(tl.float32) * s
    else:
        PACK: tl.constexpr = 32 // BITS
        low = (1 << BITS) - 1
        if FORMAT == 1:
            words = tl.load(w_ptr + e * stride_we + ks[:, None] * stride_wr + (cols // PACK)[None, :], mask=ok, other=0)
            zero_shift = _awq_shift(cols)[None, :]
            q = (words >> zero_shift) & low
        else:
            words = tl.load(w_ptr + e * stride_we + (ks // PACK)[:, None] * stride_wr + cols[None, :], mask=ok, other=0)
            q = (words >> ((ks % PACK) * BITS)[:, None]) & low
            zero_shift = ((cols % PACK) * BITS)[None, :]
        groups = (ks // group_k)[:, None]
        zero_words = tl.load(z_ptr + e * stride_ze + groups * stride_zr + (cols // PACK)[None, :], mask=ok, other=0)
        zeros = ((zero_words >> zero_shift) & low) + zero_offset
        s = tl.load(s_ptr + e * stride_se + groups * stride_sr + cols[None, :], mask=ok, other=0.0)
        tile = (q - zeros).to(tl.float32) * s.to(tl.float32)
    return tile


@triton.jit
def _quant_moe_gate_up_kernel(x_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_experts, top_k,
                              hidden_size, intermediate, stride_xm, stride_om, w_ptr, s_ptr, z_ptr, stride_we,
                              stride_wr, stride_se, stride_sr, stride_ze, stride_zr, group_n, group_k, zero_offset,
                              FORMAT: tl.constexpr, BITS: tl.constexpr, IS_FP32: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] = silu(x[token] . W13[e, n]) * (x[token] . W13[e, intermediate + n]), as triton_moe's
    gate-up kernel with W13 dequantized tile by tile."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < intermediate
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        ok = k_ok[:, None] & col_ok[None, :]
        w_gate = _weight_tile(w_ptr, s_ptr, z_ptr, expert, cols, ks, ok, stride_we, stride_wr, stride_se, stride_sr,
                              stride_ze, stride_zr, group_n, group_k, zero_offset, FORMAT, BITS).to(x.dtype)
        w_up = _weight_tile(w_ptr, s_ptr, z_ptr, expert, cols + intermediate, ks, ok, stride_we, stride_wr,
                            stride_se, stride_sr, stride_ze, stride_zr, group_n, group_k, zero_offset, FORMAT,
                            BITS).to(x.dtype)
        if IS_FP32:
            gate += tl.dot(x, w_gate, input_precision="ieee")
            up += tl.dot(x, w_up, input_precision="ieee")
        else:
            gate += tl.dot(x, w_gate)
            up += tl.dot(x, w_up)
    act = gate * tl.sigmoid(gate) * up
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _quant_moe_down_kernel(x_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_experts,
                           intermediate, hidden_size, stride_xm, stride_om, w_ptr, s_ptr, z_ptr, stride_we, stride_wr,
                           stride_se, stride_sr, stride_ze, stride_zr, group_n, group_k, zero_offset,
                           FORMAT: tl.constexpr, BITS: tl.constexpr, IS_FP32: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] = weight[pair] * (x[pair] . W2[e, n]), W2 dequantized tile by tile."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, intermediate, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < intermediate
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = _weight_tile(w_ptr, s_ptr, z_ptr, expert, cols, ks, k_ok[:, None] & col_ok[None, :], stride_we,
                         stride_wr, stride_se, stride_sr, stride_ze, stride_zr, group_n, group_k, zero_offset,
                         FORMAT, BITS).to(x.dtype)
        if IS_FP32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    weight = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)  # float32 routing weights
    acc = acc * weight[:, None]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def quantized_block_sizes(num_pairs: int, num_experts: int, is_fp32: bool) -> tuple[int, int, int]:
    """triton_moe's (BLOCK_M, BLOCK_N, BLOCK_K) with the dequantized tiles at most 32 wide: along N in
    16-row blocks (decode), along K in 64-row ones.
    NOTE: at these tiles and NUM_WARPS = 8 every format compiles for sm_90 without register spills
    (ptxas -v); 4 warps, or 64 x 64 tiles, spill the gate and up tiles dequantized side by side."""
    block_m, block_n, block_k = block_sizes(num_pairs, num_experts, is_fp32)
    if block_m > 16:
        return block_m, block_n, min(block_k, 32)
    return block_m, min(block_n, 32), block_k


def quantized_fused_moe(hidden: torch.Tensor, w13: QuantizedExperts, w2: QuantizedExperts,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int = 0,
                        blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """triton_moe.fused_moe with quantized w13 (gate | up, [E, 2I, hidden] as W) and w2 ([E, hidden, I]):
    hidden [num_tokens, hidden_size], topk_weights float32 and topk_ids (global expert ids) [num_tokens,
    top_k] -> [num_tokens, hidden_size]."""
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w13.weight.shape[0], w2.num_inputs
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    is_fp32 = hidden.dtype == torch.float32
    block_m, block_n, block_k = blocks or quantized_block_sizes(num_pairs, num_experts, is_fp32)
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    sorted_pairs, block_experts = moe_align(topk_ids, num_experts, first_expert, block_m)
    num_blocks = block_experts.numel()
    x = hidden.contiguous()
    act = torch.empty((num_pairs, intermediate), dtype=hidden.dtype, device=hidden.device)
    flags = dict(IS_FP32=is_fp32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS)
    _quant_moe_gate_up_kernel[(num_blocks, triton.cdiv(intermediate, block_n))](
        x, act, sorted_pairs, block_experts, num_pairs, num_experts, top_k, hidden_size, intermediate,
        x.stride(0), act.stride(0), *w13.kernel_args(), FORMAT=w13.format, BITS=w13.bits, **flags)
    # rows of pairs routed to other ranks' experts are never written: they must add zero
    out = torch.zeros((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.to(torch.float32).reshape(-1).contiguous()
    _quant_moe_down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        act, weights, out, sorted_pairs, block_experts, num_pairs, num_experts, intermediate, hidden_size,
        act.stride(0), out.stride(0), *w2.kernel_args(), FORMAT=w2.format, BITS=w2.bits, **flags)
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)
