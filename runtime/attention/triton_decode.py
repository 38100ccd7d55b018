"""Split-KV paged decode: one program per (request, KV head, split), the KV head's query group in one dot.

    program (r, kv_head, s):  q rows = the group's query heads, padded to BLOCK_G (>= 16 for tl.dot)
    keys of r:  first .............................................. seq_len
                | split 0          | split 1          | split 2        |   splits of r = its own count
    num_splits(r) = min(max_splits, ceil(keys / SPLIT_MIN)), computed on the device from seq_lens[r]

A request with one split writes its output directly; the others write partial (max, sum, acc) rows
that the reduce kernel combines. No host read of seq_lens, so a CUDA graph captures it whole.
With HAS_SINKS (gpt-oss), each head's exp(sink) joins its softmax's denominator once: in the decode
kernel for a request with one split, in the reduce for the others (at the max over splits and sink)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.runtime.attention.torch_backend import is_fp8
from shardserve.runtime.attention.triton_kernels import (_dequantized, _dot, _load_kv_tile, _soft_capped, _with_sink,
                                                         block_d)

SPLIT_MIN = 256  # keys a split covers at least: fewer and the reduction costs more than the split saves
MAX_SPLITS = 32


@triton.jit
def _split_plan(seq_len, window, max_splits, SPLIT_MIN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(first key, number of splits, keys per split) of one request."""
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = seq_len * 0
    num_keys = seq_len - first
    num_splits = tl.maximum(tl.minimum(max_splits, (num_keys + SPLIT_MIN - 1) // SPLIT_MIN), 1)
    return first, num_splits, (num_keys + num_splits - 1) // num_splits


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
                   query_start_ptr, seq_lens_ptr, tables_ptr, table_stride, scale, soft_cap, num_heads, num_kv_heads,
                   head_dim, block_size, max_splits, window, k_scale, v_scale,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_MIN: tl.constexpr,
                   NUM_STAGES: tl.constexpr, IS_FP32: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   IS_FP8: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Online softmax of the group's queries over keys [split_start, split_end): each K/V tile is
    loaded once for all query heads of its KV head (scores = [BLOCK_G, BLOCK_N] from one dot)."""
    request, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + request)
    first, num_splits, split_len = _split_plan(seq_len, window, max_splits, SPLIT_MIN, HAS_WINDOW)
    if split >= num_splits:
        return
    group = num_heads // num_kv_heads
    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * group + rows
    dims = tl.arange(0, BLOCK_D)
    token = tl.load(query_start_ptr + request)
    row_mask = (rows < group)[:, None] & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + (token * num_heads + heads)[:, None] * head_dim + dims[None, :], mask=row_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    split_start = first + split * split_len
    split_end = tl.minimum(seq_len, split_start + split_len)
    table_row = tables_ptr + request * table_stride
    for start in tl.range(split_start, split_end, BLOCK_N, num_stages=NUM_STAGES):
        positions = start + tl.arange(0, BLOCK_N)
        k = _load_kv_tile(k_cache_ptr, table_row, positions, kv_head, dims, split_end, block_size, num_kv_heads,
                          head_dim)
        v = _load_kv_tile(v_cache_ptr, table_row, positions, kv_head, dims, split_end, block_size, num_kv_heads,
                          head_dim)
        k = _dequantized(k, k_scale, q.dtype, IS_FP8)
        v = _dequantized(v, v_scale, q.dtype, IS_FP8)
        scores = _soft_capped(_dot(q, tl.trans(k), IS_FP32) * scale, soft_cap, HAS_SOFT_CAP)
        scores = tl.where((positions < split_end)[None, :], scores, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every tile holds a key
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IS_FP32)
        m_i = m_new
    if num_splits == 1:
        if HAS_SINKS:
            acc, l_i = _with_sink(acc, l_i, m_i, tl.load(sinks_ptr + heads, mask=rows < group, other=0.0))
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (token * num_heads + heads)[:, None] * head_dim + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part = (request * num_heads + heads) * max_splits + split  # [BLOCK_G]
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=(rows < group)[:, None])
        tl.store(part_max_ptr + part, m_i, mask=rows < group)
        tl.store(part_sum_ptr + part, l_i, mask=rows < group)


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, sinks_ptr, query_start_ptr,
                          seq_lens_ptr, num_heads, head_dim, max_splits, window, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr, SPLIT_MIN: tl.constexpr, HAS_WINDOW: tl.constexpr,
                          HAS_SINKS: tl.constexpr):
    """Combine the splits of one (request, head): rescale each partial sum to the global max (with
    HAS_SINKS, of the splits' maxes and the head's sink, whose exp joins the denominator once).
    Requests with one split were written by the decode kernel and are skipped."""
    request, head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + request)
    _, num_splits, _ = _split_plan(seq_len, window, max_splits, SPLIT_MIN, HAS_WINDOW)
    if num_splits == 1:
        return
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    base = (request * num_heads + head) * max_splits
    valid = splits < num_splits
    maxes = tl.load(part_max_ptr + base + splits, mask=valid, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + splits, mask=valid, other=0.0)
    m = tl.max(maxes, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
        m = tl.maximum(m, sink)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp(maxes - m))
    parts = tl.load(part_out_ptr + (base + splits)[:, None] * BLOCK_D + dims[None, :], mask=valid[:, None], other=0.0)
    numerator = tl.sum(parts * weights[:, None], axis=0)
    denominator = tl.sum(sums * weights, axis=0)
    if HAS_SINKS:
        denominator += tl.exp(sink - m)
    out = numerator / denominator
    token = tl.load(query_start_ptr + request)
    tl.store(out_ptr + (token * num_heads + head) * head_dim + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


def max_decode_splits(num_requests: int, num_kv_heads: int, longest: int, num_programs: int = 264) -> int:
    """The split count the grid allows (each request uses fewer when it is short).
    NOTE: from the batch's shape and an upper bound on its length only (max_model_len inside a CUDA
    graph), never from seq_lens: split while (request, KV head) programs alone cannot fill about two
    waves of an H100's 132 SMs."""
    wanted = triton.cdiv(num_programs, num_requests * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(longest, SPLIT_MIN), MAX_SPLITS))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, num_splits: int | None = None,
                 block_n: int = 64, sliding_window: int | None = None, kv_scales: tuple[float, float] = (1.0, 1.0),
                 logits_soft_cap: float | None = None, split_min: int = SPLIT_MIN,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_requests, num_heads, head_dim], one query token per request. num_splits: the most
    splits any request may use (None: max_decode_splits); the reduce launches only when it is > 1.
    sinks: float32 [num_heads] (gpt-oss); None compiles the kernels without them."""
    num_requests, num_heads, head_dim = meta.num_requests, q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if num_splits is None:
        longest = min(meta.max_seq_len, sliding_window or meta.max_seq_len)
        num_splits = max_decode_splits(num_requests, num_kv_heads, longest)
    width = block_d(head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    part_out = torch.empty((num_requests, num_heads, num_splits, width) if num_splits > 1 else (1, 1, 1, 1),
                           dtype=torch.float32, device=q.device)
    part_max = torch.empty(part_out.shape[:3], dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    window = sliding_window or 0
    # NOTE: MLA's 576-wide entries (BLOCK_D 1024) compile for sm_90 without spills only in 16-key tiles
    # on 8 warps, 2 stages (tests/runtime/triton_compile_check.py); untimed on a GPU so far
    block_n, warps, stages = (min(block_n, 16), 8, 2) if width > 256 else (block_n, 4, 3)
    _decode_kernel[(num_requests, num_kv_heads, num_splits)](
        q.contiguous(), kv_cache[0], kv_cache[-1], out, sinks, part_out, part_max, part_sum, meta.query_start_loc,
        meta.seq_lens, meta.block_tables, meta.block_tables.stride(0), scale, logits_soft_cap or 0.0, num_heads,
        num_kv_heads, head_dim, kv_cache.shape[2], num_splits, window, kv_scales[0], kv_scales[1],
        BLOCK_G=max(16, triton.next_power_of_2(num_heads // num_kv_heads)), BLOCK_N=block_n, BLOCK_D=width,
        SPLIT_MIN=split_min, NUM_STAGES=stages, IS_FP32=q.dtype == torch.float32, HAS_WINDOW=sliding_window is not None,
        IS_FP8=is_fp8(kv_cache.dtype), HAS_SOFT_CAP=logits_soft_cap is not None, HAS_SINKS=sinks is not None,
        num_warps=warps)
    if num_splits > 1:
        _decode_reduce_kernel[(num_requests, num_heads)](
            part_out, part_max, part_sum, out, sinks, meta.query_start_loc, meta.seq_lens, num_heads, head_dim,
            num_splits, window, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=width, SPLIT_MIN=split_min,
            HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None)
    return out
