"""Attention metadata for kernel tests (requests with cached and new tokens on shuffled blocks), a
dense reference with Gemma 2's logit soft-cap, and gpt-oss's sink logits."""

from __future__ import annotations

import torch

from shardserve.runtime.attention.torch_backend import gather_kv
from shardserve.runtime.worker.inputs import RequestState, prepare_inputs
from shardserve.runtime.sampling_params import SamplingParams


def poison_freed_entries(meta, cache, window: int, num_blocks: int, block_size: int) -> None:
    """Point each request's table entries that the block manager would have freed behind `window` at
    an unused block of NaNs (a block another request now owns: anything could be in it)."""
    from shardserve.runtime.core.block_manager import BlockManager

    pool = BlockManager(num_blocks, block_size, windows=(window,))
    used = set(meta.block_tables.flatten().tolist())
    poison = next(b for b in range(num_blocks) if b not in used)
    cache[:, poison] = float("nan")
    starts = meta.query_start_loc_cpu
    for r in range(meta.num_requests):
        num_computed = int(meta.seq_lens_cpu[r] - (starts[r + 1] - starts[r]))
        meta.block_tables[r, :pool.num_behind_window(num_computed)] = poison


def make_batch(shapes, block_size: int, num_blocks: int, device: torch.device, seed: int = 0):
    """shapes: (num_cached, num_new) per request -> its AttentionMetadata on `device`."""
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    states, scheduled = [], {}
    for i, (num_cached, num_new) in enumerate(shapes):
        total = num_cached + num_new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        states.append(RequestState(f"r{i}", [1] * total, total, SamplingParams(), 0, frozenset(), blocks, num_cached))
        scheduled[f"r{i}"] = num_new
    return prepare_inputs(states, scheduled, block_size, device).attn_metadata


def capped_reference(q, cache, meta, scale, cap, window=None):
    """Dense attention per query with scores cap * tanh(scores / cap) (Gemma 2), float32."""
    out = torch.empty_like(q)
    starts, group = meta.query_start_loc_cpu, q.shape[1] // cache.shape[3]
    for r in range(meta.num_requests):
        seq_len = meta.seq_lens_cpu[r]
        keys, values = gather_kv(cache, meta.block_tables[r], seq_len)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        for j, token in enumerate(range(starts[r], starts[r + 1])):
            position = seq_len - (starts[r + 1] - starts[r]) + j
            first = 0 if window is None else max(0, position - window + 1)
            scores = torch.einsum("hd,lhd->hl", q[token], keys[first:position + 1]) * scale
            probs = torch.softmax(cap * torch.tanh(scores / cap), dim=-1)
            out[token] = torch.einsum("hl,lhd->hd", probs, values[first:position + 1])
    return out


def sinks_for(num_heads: int, seed: int = 0) -> torch.Tensor:
    """gpt-oss's per-head sink logits, float32 [num_heads]: around the scores' scale, except the first far
    above every score (its head attends to almost nothing; no overflow allowed) and the last far below
    (its head's softmax as without a sink)."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 80.0, -80.0
    return sinks


def dense_reference(q, keys, values, positions, scale, cap=None, window=None, sinks=None):
    """q: [n, heads, dim] at `positions`; keys/values: [seq_len, kv_heads, dim] (every position). Per head
    h the scores (capped: cap * tanh(s / cap)) of the keys in the window; with sinks,
    p_j = exp(s_j - m) / (sum_j exp(s_j - m) + exp(sinks[h] - m)), m = max(max_j s_j, sinks[h])."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    out = []
    for j, position in enumerate(positions):
        first = 0 if window is None else max(0, position - window + 1)
        scores = torch.einsum("hd,lhd->hl", q[j], keys[first: position + 1]) * scale
        scores = scores if cap is None else torch.tanh(scores / cap) * cap
        m = scores.max(dim=1).values if sinks is None else torch.maximum(scores.max(dim=1).values, sinks)
        weights = torch.exp(scores - m[:, None])
        denominator = weights.sum(dim=1) + (0.0 if sinks is None else torch.exp(sinks - m))
        out.append(torch.einsum("hl,lhd->hd", weights / denominator[:, None], values[first: position + 1]))
    return torch.stack(out)
