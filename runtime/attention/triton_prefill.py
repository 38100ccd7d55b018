"""Paged prefill: new tokens over the cached prefix, one program per (request, KV head, query tile).

A tile's BLOCK_M rows pack the KV head's whole query group (GQA), so each K/V tile is loaded once for
all of the group's heads:

    row i  ->  query token tile * tokens_per_tile + i // group,  head kv_head * group + i % group
    tokens_per_tile = BLOCK_M // group      (rows past tokens_per_tile * group are padding)

    positions:  0 ........ context_len-1 | context_len ...... seq_len-1
                (cached prefix, all seen) | (this step's queries, causal)

With HAS_SINKS (gpt-oss), each row's head adds exp(sink) to its softmax's denominator at the end."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.runtime.attention.torch_backend import is_fp8
from shardserve.runtime.attention.triton_kernels import (_dequantized, _dot, _load_kv_tile, _soft_capped, _with_sink,
                                                         block_d)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr, query_start_ptr, seq_lens_ptr, tables_ptr,
                    table_stride, scale, soft_cap, num_heads, num_kv_heads, head_dim, block_size, window, k_scale,
                    v_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    IS_FP32: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_FP8: tl.constexpr,
                    HAS_SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Online softmax over keys [first, last query position of the tile]. With HAS_WINDOW the query at
    position i sees only (i - window, i]: the loop starts at the first key the tile's earliest
    query still sees, never earlier (blocks behind it may be freed, their table entries stale)."""
    request, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = num_heads // num_kv_heads
    tokens_per_tile = BLOCK_M // group
    q_start = tl.load(query_start_ptr + request)
    q_len = tl.load(query_start_ptr + request + 1) - q_start
    if tile * tokens_per_tile >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - q_len
    rows = tl.arange(0, BLOCK_M)
    query = tile * tokens_per_tile + rows // group  # query index within the request
    dims = tl.arange(0, BLOCK_D)
    row_valid = (rows < tokens_per_tile * group) & (query < q_len)
    q_offsets = ((q_start + query) * num_heads + kv_head * group + rows % group)[:, None] * head_dim + dims[None, :]
    q_mask = row_valid[:, None] & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    query_pos = context_len + query
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(seq_len, context_len + (tile + 1) * tokens_per_tile)
    if HAS_WINDOW:
        first = tl.maximum(context_len + tile * tokens_per_tile - window + 1, 0)  # exact: earlier blocks may be freed
    else:
        first = context_len * 0
    table_row = tables_ptr + request * table_stride
    for start in range(first, end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        k = _load_kv_tile(k_cache_ptr, table_row, positions, kv_head, dims, seq_len, block_size, num_kv_heads,
                          head_dim)
        v = _load_kv_tile(v_cache_ptr, table_row, positions, kv_head, dims, seq_len, block_size, num_kv_heads,
                          head_dim)
        k = _dequantized(k, k_scale, q.dtype, IS_FP8)
        v = _dequantized(v, v_scale, q.dtype, IS_FP8)
        scores = _soft_capped(_dot(q, tl.trans(k), IS_FP32) * scale, soft_cap, HAS_SOFT_CAP)  # [BLOCK_M, BLOCK_N]
        allowed = (positions[None, :] <= query_pos[:, None]) & (positions[None, :] < seq_len)
        if HAS_WINDOW:
            allowed = allowed & (positions[None, :] > query_pos[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row the window hides from this whole tile
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IS_FP32)
        m_i = m_new
    if HAS_SINKS:
        acc, l_i = _with_sink(acc, l_i, m_i, tl.load(sinks_ptr + kv_head * group + rows % group))
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_tile(dtype: torch.dtype, head_dim: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). NOTE: 128 x 64 tiles with 8 warps compile to wgmma on sm_90 without
    spilling for head_dim <= 128 in bf16/fp16; head_dim 256 halves the rows, and fp32 (CUDA cores, no
    tensor cores) keeps 64 x 32; MLA's entries take 16 x 16. BLOCK_M is at least the group so a tile holds one token."""
    if head_dim > 256:  # MLA's 576-wide entries: the only tile found without (much) spilling, 24 bytes
        block_m, block_n, num_warps = 16, 16, 8
    elif dtype == torch.float32:
        block_m, block_n, num_warps = 64, 32, 4
    elif head_dim > 128:
        block_m, block_n, num_warps = 64, 64, 8
    else:
        block_m, block_n, num_warps = 128, 64, 8
    return max(block_m, triton.next_power_of_2(group)), block_n, num_warps


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, block_m: int | None = None,
                  block_n: int | None = None, sliding_window: int | None = None,
                  kv_scales: tuple[float, float] = (1.0, 1.0), logits_soft_cap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] for any mix of prefill chunks and decodes; block_m / block_n
    override prefill_tile's choice (tests use small tiles). sinks: float32 [num_heads] (gpt-oss); None
    compiles the kernel without them."""
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    tile_m, tile_n, num_warps = prefill_tile(q.dtype, head_dim, group)
    block_m, block_n = max(block_m or tile_m, triton.next_power_of_2(group)), block_n or tile_n
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    grid = (meta.num_requests, num_kv_heads, triton.cdiv(meta.max_query_len, block_m // group))
    _prefill_kernel[grid](q.contiguous(), kv_cache[0], kv_cache[-1], out, sinks, meta.query_start_loc, meta.seq_lens,
                          meta.block_tables, meta.block_tables.stride(0), scale, logits_soft_cap or 0.0, num_heads,
                          num_kv_heads, head_dim, kv_cache.shape[2], sliding_window or 0, kv_scales[0], kv_scales[1],
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d(head_dim),
                          IS_FP32=q.dtype == torch.float32, HAS_WINDOW=sliding_window is not None,
                          IS_FP8=is_fp8(kv_cache.dtype), HAS_SOFT_CAP=logits_soft_cap is not None,
                          HAS_SINKS=sinks is not None, num_warps=num_warps, num_stages=2)
    return out
