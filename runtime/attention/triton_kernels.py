"""Triton kernels for paged attention: KV write, prefill, split-KV decode and its reduction.

Prefill covers the new tokens plus the cached prefix. Layout of one layer's cache:
[2, num_blocks, block_size, num_kv_heads, head_dim]; a slot is block_id * block_size + offset.
An fp8 cache holds k / k_scale and v / v_scale: the store divides and saturates, the attention kernels
multiply back (in fp32) before their dots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] -> kv_cache[0/1] at slot_mapping."""
    num_tokens, row_size = k.shape[0], k.shape[1] * k.shape[2]
    if num_tokens == 0:
        return
    is_fp8 = _is_fp8(kv_cache.dtype)
    largest = torch.finfo(kv_cache.dtype).max if is_fp8 else 0.0
    _store_kv_kernel[(num_tokens,)](k.contiguous(), v.contiguous(), kv_cache[0], kv_cache[1], slot_mapping,
                                    row_size, kv_scales[0], kv_scales[1], largest,
                                    BLOCK=triton.next_power_of_2(row_size), IS_FP8=is_fp8)


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
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_ptr, seq_lens_ptr, tables_ptr,
                    table_stride, scale, num_heads, num_kv_heads, head_dim, block_size, window, k_scale, v_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP32: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, IS_FP8: tl.constexpr):
    """One (request, head, query tile): online softmax over keys [0, last query position].
    Dots take the cache dtype (bf16/fp16 on tensor cores); fp32 models use exact fp32 dots, not TF32.

        positions:  0 ........ context_len-1 | context_len ...... seq_len-1
                    (cached prefix, all seen) | (this step's queries, causal)

    With HAS_WINDOW the query at position i sees only (i - window, i]: the loop starts at the first
    key the tile's earliest query still sees, never earlier (blocks behind it may be freed, their
    table entries stale: runtime/block_manager.py)."""
    request, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + request)
    q_len = tl.load(query_start_ptr + request + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - q_len
    kv_head = head // (num_heads // num_kv_heads)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the request
    dims = tl.arange(0, BLOCK_D)
    row_valid = rows < q_len
    q_offsets = ((q_start + rows) * num_heads + head)[:, None] * head_dim + dims[None, :]
    q_mask = row_valid[:, None] & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    query_pos = context_len + rows
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    if HAS_WINDOW:
        first = tl.maximum(context_len + tile * BLOCK_M - window + 1, 0)
    else:
        first = context_len * 0
    table_row = tables_ptr + request * table_stride
    for start in range(first, end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        k = _load_kv_tile(k_cache_ptr, table_row, positions, kv_head, dims, seq_len, block_size,
                          num_kv_heads, head_dim)
        v = _load_kv_tile(v_cache_ptr, table_row, positions, kv_head, dims, seq_len, block_size,
                          num_kv_heads, head_dim)
        if IS_FP8:  # back to the query's dtype for the dots
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if IS_FP32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        allowed = (positions[None, :] <= query_pos[:, None]) & (positions[None, :] < seq_len)
        if HAS_WINDOW:
            allowed = allowed & (positions[None, :] > query_pos[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IS_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
                         query_start_ptr, seq_lens_ptr, tables_ptr, table_stride, scale, num_heads,
                         num_kv_heads, head_dim, block_size, num_splits, window, k_scale, v_scale,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """One (request, head, split): partial softmax over keys [first + split * split_len, +split_len),
    first = 0, or seq_len - window with HAS_WINDOW.
    NOTE: split_len comes from this request's own length (its keys / num_splits, rounded up to
    BLOCK_N), not from the batch's longest, so the host passes only num_splits: a CUDA graph fixes
    it at capture and every replay still spreads each request over all its splits."""
    request, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + request)
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = seq_len * 0
    split_len = ((seq_len - first + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    token = tl.load(query_start_ptr + request)
    kv_head = head // (num_heads // num_kv_heads)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (token * num_heads + head) * head_dim + dims, mask=dims < head_dim, other=0.0)
    q = q.to(tl.float32)
    part = (request * num_heads + head) * num_splits + split
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)  # fp32 scalars, loop-carried
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    split_start = first + split * split_len
    split_end = tl.minimum(seq_len, split_start + split_len)
    table_row = tables_ptr + request * table_stride
    for start in range(split_start, split_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < split_end
        k = _load_kv_tile(k_cache_ptr, table_row, positions, kv_head, dims, split_end, block_size,
                          num_kv_heads, head_dim).to(tl.float32) * k_scale
        v = _load_kv_tile(v_cache_ptr, table_row, positions, kv_head, dims, split_end, block_size,
                          num_kv_heads, head_dim).to(tl.float32) * v_scale
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))  # [BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(part_out_ptr + part * BLOCK_D + dims, acc)
    tl.store(part_max_ptr + part, m_i)
    tl.store(part_sum_ptr + part, l_i)


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, query_start_ptr, num_heads,
                          head_dim, num_splits, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Combine the splits of one (request, head): rescale each partial sum to the global max."""
    request, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    base = (request * num_heads + head) * num_splits
    valid = splits < num_splits
    maxes = tl.load(part_max_ptr + base + splits, mask=valid, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + splits, mask=valid, other=0.0)
    m = tl.max(maxes, axis=0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp(maxes - m))
    parts = tl.load(part_out_ptr + (base + splits)[:, None] * BLOCK_D + dims[None, :], mask=valid[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    token = tl.load(query_start_ptr + request)
    tl.store(out_ptr + (token * num_heads + head) * head_dim + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, block_m: int = 16,
                  block_n: int = 16, sliding_window: int | None = None,
                  kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] for any mix of prefill chunks and decodes."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    grid = (meta.num_requests, num_heads, triton.cdiv(meta.max_query_len, block_m))
    _prefill_kernel[grid](q.contiguous(), kv_cache[0], kv_cache[1], out, meta.query_start_loc, meta.seq_lens,
                          meta.block_tables, meta.block_tables.stride(0), scale, num_heads, kv_cache.shape[3],
                          head_dim, kv_cache.shape[2], sliding_window or 0, kv_scales[0], kv_scales[1],
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(head_dim), IS_FP32=q.dtype == torch.float32,
                          HAS_WINDOW=sliding_window is not None, IS_FP8=_is_fp8(kv_cache.dtype))
    return out


def default_num_splits(num_requests: int, num_heads: int, max_seq_len: int, num_programs: int = 256) -> int:
    """NOTE: split the keys only when requests x heads alone cannot fill the GPU; each split should
    still cover a few hundred keys so the reduction stays cheap."""
    wanted = triton.cdiv(num_programs, num_requests * num_heads)
    return max(1, min(wanted, triton.cdiv(max_seq_len, 256), 32))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, num_splits: int | None = None,
                 block_n: int = 16, sliding_window: int | None = None,
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """q: [num_requests, num_heads, head_dim], one query token per request (split-KV decode).
    Reads no tensor value on the host, so it can be captured in a CUDA graph."""
    num_requests, num_heads, head_dim = meta.num_requests, q.shape[1], q.shape[2]
    if num_splits is None:
        longest = min(meta.max_seq_len, sliding_window or meta.max_seq_len)
        num_splits = default_num_splits(num_requests, num_heads, longest)
    block_d = _block_d(head_dim)
    part_out = torch.empty((num_requests, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
    part_max = torch.empty((num_requests, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    _decode_split_kernel[(num_requests, num_heads, num_splits)](
        q.contiguous(), kv_cache[0], kv_cache[1], part_out, part_max, part_sum, meta.query_start_loc,
        meta.seq_lens, meta.block_tables, meta.block_tables.stride(0), scale, num_heads, kv_cache.shape[3],
        head_dim, kv_cache.shape[2], num_splits, sliding_window or 0, kv_scales[0], kv_scales[1], BLOCK_N=block_n,
        BLOCK_D=block_d, HAS_WINDOW=sliding_window is not None)
    _decode_reduce_kernel[(num_requests, num_heads)](
        part_out, part_max, part_sum, out, meta.query_start_loc, num_heads, head_dim, num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d)
    return out
