"""Paged attention on CUDA through the Triton kernels.

Split-KV decode when every request in the step decodes; the prefill kernel (new tokens over the
cached prefix) otherwise. Given positions and the layer's rotary embedding, q and k are rotated in
the kernel that writes the cache (fuses_rotary)."""

from __future__ import annotations

from typing import Any

import torch

from shardserve.runtime.attention.triton_decode import paged_decode
from shardserve.runtime.attention.triton_kernels import store_kv
from shardserve.runtime.attention.triton_prefill import paged_prefill
from shardserve.runtime.attention.triton_rotary_kv import rotary_store_kv
from shardserve.runtime.forward_context import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"
    fuses_rotary = True  # forward takes positions and rotary_emb; the torch backend wants q and k rotated

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                kv_scales: tuple[float, float] = (1.0, 1.0), logits_soft_cap: float | None = None,
                positions: torch.Tensor | None = None, rotary_emb=None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]; with
        rotary_emb (a RotaryEmbedding) q and k are rotated by positions [num_tokens] first."""
        if rotary_emb is None:
            store_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        else:
            assert positions is not None  # given with rotary_emb
            q = rotary_store_kv(q, k, v, positions, rotary_emb.cos, rotary_emb.sin, kv_cache, meta.slot_mapping,
                                kv_scales)
        options: dict[str, Any] = dict(sliding_window=sliding_window, kv_scales=kv_scales,
                                       logits_soft_cap=logits_soft_cap)
        if meta.is_decode_only:
            return paged_decode(q, kv_cache, meta, scale, **options)
        return paged_prefill(q, kv_cache, meta, scale, **options)
