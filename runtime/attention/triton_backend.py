"""Paged attention on CUDA through the Triton kernels.

Split-KV decode when every request in the step decodes; the prefill kernel (new tokens over the
cached prefix) otherwise; over a one-plane cache (MLA), 16 heads per launch (with their sinks, if any).
Given positions and the layer's rotary embedding, q and k are rotated in the kernel that writes the
cache (fuses_rotary)."""

from __future__ import annotations

from typing import Any

import torch

from shardserve.runtime.attention.triton_decode import paged_decode
from shardserve.runtime.attention.triton_kernels import store_kv
from shardserve.runtime.attention.triton_prefill import paged_prefill
from shardserve.runtime.attention.triton_rotary_kv import rotary_store_kv
from shardserve.runtime.worker.forward_context import AttentionMetadata


# NOTE: MLA's query group is every head of the rank (one latent KV head): 128 at tp 1. The kernels hold a
# program's whole group in one tile, so heads go 16 per launch (each launch reads the cache again; at tp 8,
# DeepSeek-V3's 16 heads per rank are one launch)
MLA_HEADS_PER_LAUNCH = 16


class TritonAttentionBackend:
    name = "triton"
    fuses_rotary = True  # forward takes positions and rotary_emb; the torch backend wants q and k rotated

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                kv_scales: tuple[float, float] = (1.0, 1.0), logits_soft_cap: float | None = None,
                positions: torch.Tensor | None = None, rotary_emb=None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]; with
        rotary_emb (a RotaryEmbedding) q and k are rotated by positions [num_tokens] first; sinks:
        float32 [num_heads] or None."""
        if rotary_emb is None:
            store_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        else:
            assert positions is not None  # given with rotary_emb
            q = rotary_store_kv(q, k, v, positions, rotary_emb.cos, rotary_emb.sin, kv_cache, meta.slot_mapping,
                                kv_scales)
        options: dict[str, Any] = dict(sliding_window=sliding_window, kv_scales=kv_scales,
                                       logits_soft_cap=logits_soft_cap)
        kernel = paged_decode if meta.is_decode_only else paged_prefill
        if kv_cache.shape[0] == 2 or q.shape[1] <= MLA_HEADS_PER_LAUNCH:
            return kernel(q, kv_cache, meta, scale, sinks=sinks, **options)
        # one-plane cache (MLA, one KV head): a few heads per launch, so a program's query group stays small
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for first in range(0, q.shape[1], MLA_HEADS_PER_LAUNCH):
            heads = slice(first, first + MLA_HEADS_PER_LAUNCH)
            out[:, heads] = kernel(q[:, heads], kv_cache, meta, scale, sinks=None if sinks is None else sinks[heads],
                                   **options)
        return out
