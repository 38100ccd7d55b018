"""Fused mixture-of-experts over quantized experts on the GPU: triton_moe's align step and grouped GEMMs,
each weight tile dequantized in the inner loop (fp8 with per-tensor, per-channel or block scales; AWQ or
GPTQ 4- or 8-bit with zero points and group scales), at tiles and warps of their own.

One expert matrix W [N, K] (N outputs, K inputs), stacked over E experts, as the kernels read it:

    FP8   weight [E, N, K] float8_e4m3fn          scale [E, ceil(N / group_n), ceil(K / group_k)] float32
    MXFP4 blocks [E, N, K / 2] uint8 (input k in byte k // 2, low nibble first)   scales [E, N, K / 32] uint8
    AWQ   qweight [E, K, N / p], word n // 8 of row k, nibble slot of column n % 8 in 0,2,4,6,1,3,5,7
    GPTQ  qweight [E, K / p, N], value k % p of word k // p of column n
          AWQ and GPTQ: qzeros [E, K / group_k, N / p] (packed like AWQ's or GPTQ's qweight columns),
          scales [E, K / group_k, N]

    fp8:  W[n, k] = weight[n, k] * scale[n // group_n, k // group_k]
    mxfp4: W[n, k] = e2m1(nibble k of row n) * 2^(scales[n, k // 32] - 127)
    int:  W[n, k] = (q[k, n] - zero[k // group_k, n] - zero_offset) * scale[k // group_k, n]

Every matrix's last dimension is contiguous (the kernels assume it)."""

from __future__ import annotations

import torch

from shardserve.runtime.layers.triton_moe import PLAIN, ExpertMatrices, ExpertOps, block_sizes, grouped_moe

NUM_WARPS = 8


def quantized_block_sizes(num_pairs: int, num_experts: int, is_fp32: bool) -> tuple[int, int, int]:
    """triton_moe's (BLOCK_M, BLOCK_N, BLOCK_K) with the dequantized tiles at most 32 wide: along N in
    16-row blocks (decode), along K in 64-row ones.
    NOTE: at these tiles and NUM_WARPS = 8 every format compiles for sm_90 without register spills
    (ptxas -v); 4 warps, or 64 x 64 tiles, spill the gate and up tiles dequantized side by side."""
    block_m, block_n, block_k = block_sizes(num_pairs, num_experts, is_fp32)
    if block_m > 16:
        return block_m, block_n, min(block_k, 32)
    return block_m, min(block_n, 32), block_k


def quantized_fused_moe(hidden: torch.Tensor, w13: ExpertMatrices, w2: ExpertMatrices,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int = 0,
                        blocks: tuple[int, int, int] | None = None, ops: ExpertOps = PLAIN) -> torch.Tensor:
    """triton_moe.fused_moe with quantized w13 (gate | up, [E, 2I, hidden] as W) and w2 ([E, hidden, I]):
    hidden [num_tokens, hidden_size], topk_weights float32 and topk_ids (global expert ids) [num_tokens,
    top_k] -> [num_tokens, hidden_size]."""
    num_pairs, is_fp32 = topk_ids.numel(), hidden.dtype == torch.float32
    blocks = blocks or quantized_block_sizes(num_pairs, w13.weight.shape[0], is_fp32)
    return grouped_moe(hidden, w13, w2, topk_weights, topk_ids, first_expert, blocks, NUM_WARPS, ops)
