"""Reference paged attention in plain torch: the CPU path and the oracle for the Triton kernels.

An fp8 cache holds k / k_scale and v / v_scale (saturated at the format's largest value); reading
multiplies the scale back. Scales are per tensor (one float per layer for K and one for V)."""

from __future__ import annotations

import torch

from shardserve.runtime.worker.forward_context import AttentionMetadata


NO_SCALES = (1.0, 1.0)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap): bounded in (-cap, cap), near identity for small scores; None: unchanged."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis with one more logit per row in the denominator, dropped after (gpt-oss's
    attention sinks): sinks broadcast to scores[..., :1], one per query head; None: plain softmax."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    logits = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :-1]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """x in the cache's dtype: divided by the scale and saturated when the cache is fp8."""
    if not is_fp8(dtype):
        return x.to(dtype)
    largest = torch.finfo(dtype).max
    return (x.float() / kv_scale).clamp(-largest, largest).to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: tuple[float, float] = NO_SCALES) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] -> their slots in kv_cache[0] and kv_cache[1]; a
    one-plane cache [1, ...] (MLA's latent) stores k, which is also what its attention reads as values."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = quantize_kv(k, kv_cache.dtype, kv_scales[0])
    if kv_cache.shape[0] == 2:  # a one-plane cache (MLA) holds K only, and V is read from it
        kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = quantize_kv(v, kv_cache.dtype, kv_scales[1])


def _read(cached: torch.Tensor, kv_scale: float) -> torch.Tensor:
    """Cached K or V back in float32."""
    return cached.float() * kv_scale if kv_scale != 1.0 else cached.float()


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              kv_scales: tuple[float, float] = NO_SCALES, first_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's keys and values in position order from block `first_block` on, float32:
    2 x [seq_len - first_block * block_size, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    blocks = block_table[first_block: -(-seq_len // block_size)].long()
    keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len - first_block * block_size]
    values = kv_cache[-1, blocks].flatten(0, 1)[:seq_len - first_block * block_size]
    return _read(keys, kv_scales[0]), _read(values, kv_scales[1])


def first_block_read(first_query_position: int, sliding_window: int | None, block_size: int) -> int:
    """The first block a query from `first_query_position` on reads: the blocks before it may have been
    freed behind the window (runtime/core/block_manager.py), their table entries stale, so none is read."""
    if sliding_window is None:
        return 0
    return max(0, first_query_position - sliding_window + 1) // block_size


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, kv_scales: tuple[float, float] = NO_SCALES,
                    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; attends each request's queries over its cached K/V
    (with a sliding window, the query at position i over positions (i - sliding_window, i]; with a
    soft cap, scores are cap * tanh(scores / cap) before the mask; with sinks [num_heads], each head's
    softmax has sinks[head] in its denominator: softmax_with_sinks).
    NOTE: single-token (decode) requests are done together in one padded batch; the rest one by one,
    since padding prompts to a common length would cost O(batch x longest^2) memory."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    head_sinks = None if sinks is None else sinks.view(kv_cache.shape[3], -1, 1, 1)  # scores' [kv_heads, group, ...]
    options = (sliding_window, kv_scales, logits_soft_cap, head_sinks)
    decodes = [r for r in range(meta.num_requests) if starts[r + 1] - starts[r] == 1]
    if decodes:
        _decode_batch(q, kv_cache, meta, scale, decodes, out, *options)
    for r in range(meta.num_requests):
        if starts[r + 1] - starts[r] != 1:
            _attend_one(q, kv_cache, meta, scale, r, out, *options)
    return out


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., num_heads, head_dim] -> [..., num_kv_heads, group, head_dim] (GQA without copying K/V)."""
    return q.unflatten(-2, (num_kv_heads, q.shape[-2] // num_kv_heads))


def _attend_one(q, kv_cache, meta, scale, r, out, sliding_window, kv_scales, logits_soft_cap, sinks) -> None:
    start, end = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
    seq_len = meta.seq_lens_cpu[r]
    first = first_block_read(seq_len - (end - start), sliding_window, kv_cache.shape[2])
    keys, values = gather_kv(kv_cache, meta.block_tables[r], seq_len, kv_scales, first)  # [keys, kv_heads, head_dim]
    query = _grouped(q[start:end], kv_cache.shape[3]).float()  # [query_len, kv_heads, group, head_dim]
    scores = soft_cap(torch.einsum("qkgd,lkd->kgql", query, keys) * scale, logits_soft_cap)
    query_positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
    key_positions = torch.arange(first * kv_cache.shape[2], seq_len, device=q.device)[None, :]
    hidden = key_positions > query_positions[:, None]  # [query_len, seq_len]: the future
    if sliding_window is not None:
        hidden |= key_positions <= query_positions[:, None] - sliding_window
    probs = softmax_with_sinks(scores.masked_fill(hidden, float("-inf")), sinks)
    out[start:end] = torch.einsum("kgql,lkd->qkgd", probs, values).flatten(1, 2).to(q.dtype)


def _decode_batch(q, kv_cache, meta, scale, rows: list[int], out, sliding_window, kv_scales, logits_soft_cap,
                  sinks) -> None:
    block_size = kv_cache.shape[2]
    lens = [int(meta.seq_lens_cpu[r]) for r in rows]
    firsts = [first_block_read(n - 1, sliding_window, block_size) for n in lens]
    lasts = [-(-n // block_size) - 1 for n in lens]
    width = max(last - first + 1 for first, last in zip(firsts, lasts))  # blocks read per row
    # each row reads its own blocks from its first in the window; shorter rows repeat their last (masked)
    columns = torch.minimum(torch.tensor(firsts)[:, None] + torch.arange(width)[None, :], torch.tensor(lasts)[:, None])
    tables = meta.block_tables[rows].gather(1, columns.to(meta.block_tables.device)).long()  # [batch, width]
    keys = _read(kv_cache[0][tables].flatten(1, 2), kv_scales[0])  # [batch, width * block_size, kv_heads, head_dim]
    values = _read(kv_cache[-1][tables].flatten(1, 2), kv_scales[1])
    seq_lens = torch.tensor(lens, device=q.device)
    tokens = torch.tensor([meta.query_start_loc_cpu[r] for r in rows], device=q.device)
    query = _grouped(q[tokens], kv_cache.shape[3]).float()  # [batch, kv_heads, group, head_dim]
    # [kv_heads, group, batch, keys]: _attend_one's layout, so the same view of the sinks broadcasts over both
    scores = soft_cap(torch.einsum("bkgd,blkd->kgbl", query, keys) * scale, logits_soft_cap)
    offsets = torch.arange(width * block_size, device=q.device)[None, :]
    key_positions = torch.tensor(firsts, device=q.device)[:, None] * block_size + offsets  # [batch, width * block_size]
    hidden = key_positions >= seq_lens[:, None]  # [batch, width * block_size]: padding and repeats
    if sliding_window is not None:
        hidden |= key_positions < seq_lens[:, None] - sliding_window
    probs = softmax_with_sinks(scores.masked_fill(hidden, float("-inf")), sinks)
    out[tokens] = torch.einsum("kgbl,blkd->bkgd", probs, values).flatten(1, 2).to(q.dtype)


class TorchAttentionBackend:
    name = "torch"
    fuses_rotary = False  # the Attention layer rotates q and k before forward

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, kv_scales: tuple[float, float] = NO_SCALES,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return paged_attention(q, kv_cache, meta, scale, sliding_window, kv_scales, logits_soft_cap, sinks)
