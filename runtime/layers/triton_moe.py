"""Fused mixture-of-experts on the GPU: (token, k) pairs grouped by expert on the device, a grouped GEMM
for gate|up with SiLU-and-mul, a grouped GEMM for down scaled by the routing weight, a sum over top-k.

A pair p = token * top_k + k picks expert topk_ids[token, k]. The align step lays the pairs out by
(local) expert, each expert's run padded to a whole number of BLOCK_M rows:

    sorted_pairs:  | e0 e0 e0 pad | e1 e1 e1 e1 | e3 pad pad pad | (pairs of other ranks' experts)
    block_experts: |      0       |      1      |       3        |  E   E ...   (E: nothing to do)

Padding rows hold num_pairs (past every pair) and are masked; a block whose expert is E exits at once.
Every size comes from the shapes (the buffers hold the worst case), so nothing is read on the host and
a forward can be captured in a CUDA graph.

The GEMMs read each expert matrix W [N, K] (N outputs, K inputs) tile by tile through _weight_tile: float
weights [E, N, K] as they are, quantized ones dequantized in the inner loop (FORMAT; the layouts are in
quantization/triton_quant_moe.py). ExpertOps adds per-expert biases to either GEMM and picks the gated
activation (silu, or gpt-oss's swigluoai)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shardserve.runtime.layers.activation import GatedActivation
from shardserve.runtime.layers.quantization.triton_packed_int import _awq_shift

FLOAT, FP8, AWQ, GPTQ, MXFP4 = 0, 1, 2, 3, 4  # the kernels' FORMAT


@dataclass(frozen=True)
class ExpertMatrices:
    """One stacked expert matrix (w13 or w2): float [E, N, K], or quantized in a layout of
    quantization/triton_quant_moe.py's docstring."""

    weight: torch.Tensor  # float or fp8 weight, or int32 qweight
    scale: torch.Tensor | None = None  # None for float
    zeros: torch.Tensor | None = None  # int32 qzeros; None for float and fp8
    format: int = FLOAT  # FLOAT | FP8 | AWQ | GPTQ | MXFP4
    group_n: int = 1  # fp8: outputs sharing a scale
    group_k: int = 1  # inputs sharing a scale (and a zero point)
    bits: int = 8
    zero_offset: int = 0  # GPTQ's classic format stores zero - 1

    @property
    def num_inputs(self) -> int:
        if self.format == GPTQ:
            return self.weight.shape[1] * (32 // self.bits)
        if self.format == MXFP4:  # two 4-bit values per byte
            return self.weight.shape[2] * 2
        return self.weight.shape[1 if self.format == AWQ else 2]

    def kernel_args(self) -> tuple:
        """(w, scale, zeros, their expert and row strides, group_n, group_k, zero_offset) as the kernels take
        them; a tensor a format does not use stands in for it, never read."""
        scale = self.weight if self.scale is None else self.scale
        zeros = scale if self.zeros is None else self.zeros
        for t in (self.weight, scale, zeros):
            assert t.stride(-1) == 1, "expert matrices need a contiguous last dimension"
        return (self.weight, scale, zeros, self.weight.stride(0), self.weight.stride(1), scale.stride(0),
                scale.stride(1), zeros.stride(0), zeros.stride(1), self.group_n, self.group_k, self.zero_offset)


@dataclass(frozen=True)
class ExpertOps:
    """What the grouped GEMMs add to the matrices: biases (w13_bias [E, 2I] gate | up, w2_bias [E, H], this
    rank's experts; None: none) and the gated activation between them."""

    activation: GatedActivation = GatedActivation()
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    def kernel_args(self, which: str, stand_in: torch.Tensor) -> tuple:
        """(bias, its expert stride) of "w13" or "w2"; `stand_in` takes a missing bias's place, never read."""
        bias = self.w13_bias if which == "w13" else self.w2_bias
        return (stand_in, 0) if bias is None else (bias, bias.stride(0))


PLAIN = ExpertOps()


def moe_align(topk_ids: torch.Tensor, num_experts: int, first_expert: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [num_tokens, top_k] (global expert ids; this rank holds experts [first_expert,
    first_expert + num_experts)) -> sorted_pairs [capacity] int32 and block_experts [capacity // block_m]
    int32, laid out as the module docstring draws them."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs, device = flat.numel(), flat.device
    local = flat - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # E: another rank's
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]: where each expert's run ends
    run_start = torch.cat((padded_end - padded, padded_end[-1:]))  # [E + 1]: others' pairs after all runs
    order = torch.argsort(local, stable=True)  # pair ids grouped by expert
    grouped = local[order]
    first_of_group = torch.cumsum(counts, 0) - counts
    dest = run_start[grouped] + torch.arange(num_pairs, device=device) - first_of_group[grouped]
    # NOTE: runs plus others' pairs never pass num_pairs + E * (block_m - 1) rows
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


@triton.jit
def _mxfp4_tile(w_ptr, s_ptr, e, cols, ks, ok, stride_we, stride_wr, stride_se, stride_sr):
    """W^T of MXFP4 (OCP microscaling): byte k // 2 of row n holds input k in its low (even k) or high
    nibble as e2m1 (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), and each 32 inputs
    share a power-of-two scale 2^(s - 127) stored as one byte (e8m0)."""
    packed = tl.load(w_ptr + e * stride_we + cols[None, :] * stride_wr + (ks // 2)[:, None], mask=ok, other=0)
    nibble = (packed.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 15
    exponent, mantissa = (nibble >> 1) & 3, (nibble & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32)))
    value = tl.where(nibble >= 8, -magnitude, magnitude)
    s = tl.load(s_ptr + e * stride_se + cols[None, :] * stride_sr + (ks // 32)[:, None], mask=ok, other=127)
    return value * tl.exp2(s.to(tl.float32) - 127.0)


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, expert, cols, ks, ok, stride_we, stride_wr, stride_se, stride_sr,
                 stride_ze, stride_zr, group_n, group_k, zero_offset, FORMAT: tl.constexpr, BITS: tl.constexpr):
    """W^T [BLOCK_K, BLOCK_N] for inputs `ks` and outputs `cols` of one expert (zero where not ok): float
    weights as stored, quantized ones dequantized in float32."""
    e = expert.to(tl.int64)
    # NOTE: FORMAT compared with literals: a jit function reads no Python globals (FLOAT, FP8, AWQ, GPTQ = 0..3)
    if FORMAT == 0:
        tile = tl.load(w_ptr + e * stride_we + cols[None, :] * stride_wr + ks[:, None], mask=ok, other=0.0)
    elif FORMAT == 1:
        w = tl.load(w_ptr + e * stride_we + cols[None, :] * stride_wr + ks[:, None], mask=ok, other=0.0)
        s = tl.load(s_ptr + e * stride_se + (cols // group_n)[None, :] * stride_sr + (ks // group_k)[:, None],
                    mask=ok, other=0.0)
        tile = w.to(tl.float32) * s
    elif FORMAT == 4:
        tile = _mxfp4_tile(w_ptr, s_ptr, e, cols, ks, ok, stride_we, stride_wr, stride_se, stride_sr)
    else:
        PACK: tl.constexpr = 32 // BITS
        low = (1 << BITS) - 1
        if FORMAT == 2:
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
def _moe_gate_up_kernel(x_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_experts, top_k,
                              hidden_size, intermediate, stride_xm, stride_om, w_ptr, s_ptr, z_ptr, stride_we,
                              stride_wr, stride_se, stride_sr, stride_ze, stride_zr, group_n, group_k, zero_offset,
                              b_ptr, stride_be, alpha, limit, FORMAT: tl.constexpr, BITS: tl.constexpr,
                              IS_FP32: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] = act(gate, up), gate = x[token] . W13[e, n] (+ b13[e, n]), up = x[token] . W13[e,
    intermediate + n] (+ b13[e, intermediate + n]) for the pairs of one block, n in one BLOCK_N tile of the
    intermediate features; act: silu(gate) * up (ACTIVATION 0) or swigluoai (1, layers/activation.py)."""
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
    if HAS_BIAS:
        bias_row = b_ptr + expert.to(tl.int64) * stride_be
        gate += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_row + intermediate + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 1:
        gate = tl.minimum(gate, limit)
        up = tl.clamp(up, -limit, limit)
        act = gate * tl.sigmoid(gate * alpha) * (up + 1.0)
    else:
        act = gate * tl.sigmoid(gate) * up
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(x_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_experts,
                           intermediate, hidden_size, stride_xm, stride_om, w_ptr, s_ptr, z_ptr, stride_we, stride_wr,
                           stride_se, stride_sr, stride_ze, stride_zr, group_n, group_k, zero_offset,
                           b_ptr, stride_be, FORMAT: tl.constexpr, BITS: tl.constexpr, IS_FP32: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """out[pair, n] = weight[pair] * (x[pair] . W2[e, n] (+ b2[e, n])): x is the gate-up output, one row
    per pair."""
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
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)  # float32 routing weights
    acc = acc * weight[:, None]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def block_sizes(num_pairs: int, num_experts: int, is_fp32: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16-row blocks while experts see few pairs each (decode), 64 above.
    NOTE: fixed shapes, no autotuning, so a captured graph and an eager step run the same code."""
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    return block_m, (32 if is_fp32 else 64), (32 if is_fp32 else 64)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0, blocks: tuple[int, int, int] | None = None,
              ops: ExpertOps = PLAIN) -> torch.Tensor:
    """hidden [num_tokens, hidden_size], w13 [E, 2 * I, hidden_size] (gate | up), w2 [E, hidden_size, I],
    topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] global expert ids (this rank
    holds [first_expert, first_expert + E); pairs of other experts add nothing) -> [num_tokens, hidden_size]."""
    num_pairs, is_fp32 = topk_ids.numel(), hidden.dtype == torch.float32
    return grouped_moe(hidden, ExpertMatrices(w13), ExpertMatrices(w2), topk_weights, topk_ids, first_expert,
                       blocks or block_sizes(num_pairs, w13.shape[0], is_fp32), ops=ops)


def grouped_moe(hidden: torch.Tensor, w13: ExpertMatrices, w2: ExpertMatrices, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, first_expert: int, blocks: tuple[int, int, int],
                num_warps: int = 4, ops: ExpertOps = PLAIN) -> torch.Tensor:
    """fused_moe over expert matrices of any FORMAT, at the given (BLOCK_M, BLOCK_N, BLOCK_K) and warps,
    with `ops`' biases and activation."""
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w13.weight.shape[0], w2.num_inputs
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    block_m, block_n, block_k = blocks
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    sorted_pairs, block_experts = moe_align(topk_ids, num_experts, first_expert, block_m)
    num_blocks = block_experts.numel()
    x = hidden.contiguous()
    act = torch.empty((num_pairs, intermediate), dtype=hidden.dtype, device=hidden.device)
    flags = dict(IS_FP32=hidden.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                 num_warps=num_warps)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(intermediate, block_n))](
        x, act, sorted_pairs, block_experts, num_pairs, num_experts, top_k, hidden_size, intermediate,
        x.stride(0), act.stride(0), *w13.kernel_args(), *ops.kernel_args("w13", x), ops.activation.alpha,
        ops.activation.limit, FORMAT=w13.format, BITS=w13.bits, HAS_BIAS=ops.w13_bias is not None,
        ACTIVATION=ops.activation.code, **flags)
    # rows of pairs routed to other ranks' experts are never written: they must add zero
    out = torch.zeros((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.to(torch.float32).reshape(-1).contiguous()
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        act, weights, out, sorted_pairs, block_experts, num_pairs, num_experts, intermediate, hidden_size,
        act.stride(0), out.stride(0), *w2.kernel_args(), *ops.kernel_args("w2", x), FORMAT=w2.format,
        BITS=w2.bits, HAS_BIAS=ops.w2_bias is not None, **flags)
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)
