"""Paged attention on CUDA through the Triton kernels.

Split-KV decode when every request in the step decodes; the prefill kernel (new tokens over the
cached prefix) otherwise."""

from __future__ import annotations

import torch

from shardserve.runtime.attention.triton_kernels import paged_decode, paged_prefill, store_kv
from shardserve.runtime.forward_context import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        if meta.is_decode_only:
            return paged_decode(q, kv_cache, meta, scale, sliding_window=sliding_window, kv_scales=kv_scales)
        return paged_prefill(q, kv_cache, meta, scale, sliding_window=sliding_window, kv_scales=kv_scales)
