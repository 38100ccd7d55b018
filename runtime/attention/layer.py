"""The attention layer models call: writes new K/V into this layer's cache and attends over it."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.runtime.attention.torch_backend import soft_cap, softmax_with_sinks
from shardserve.runtime.worker.checkpoint import CheckpointTensor
from shardserve.runtime.worker.forward_context import get_forward_context
from shardserve.runtime.layers.weights import copy_into, shard_range
from shardserve.runtime.distributed.parallel_state import get_parallel_state


class Attention(nn.Module):
    """Holds this layer's slice of the KV pool, bound by the worker after start-up:
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, values), or with cache_planes=1
    [1, ...]: keys only, which the attention reads as values too (MLA's latent, attention/mla.py).
    sliding_window: a query at position i sees keys at positions (i - sliding_window, i]; None: all.
    logits_soft_cap: scores become cap * tanh(scores / cap) before the mask and softmax (Gemma 2).
    has_sinks: a learned logit per query head (`sinks`, this rank's heads, float32) joins the denominator
    of that head's softmax (gpt-oss): keys can get less than all of the attention.
    An fp8 pool stores k / k_scale and v / v_scale; k_scale and v_scale are 1.0 unless the checkpoint
    ships them (read as optional buffers, fixed as floats once loaded)."""

    k_scale: torch.Tensor  # [] float32 buffers
    v_scale: torch.Tensor
    sinks: nn.Parameter | None  # [num_heads] float32 with has_sinks

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None, cache_planes: int = 2,
                 has_sinks: bool = False):
        super().__init__()
        self.cache_planes = cache_planes
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0  # which block tables it reads (planner/kv_groups.py), set by the worker with kv_cache
        if has_sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("sinks", None)
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.kv_scales = (1.0, 1.0)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """sinks: this tensor-parallel rank's heads of the checkpoint's [num_attention_heads]."""
        state = get_parallel_state()
        copy_into(param.data, loaded.narrow(0, *shard_range(loaded.shape[0], state.tp_rank, state.tp_size)))

    def fix_kv_scales(self) -> None:
        """Read the loaded scales once, so that no step reads a tensor value on the host."""
        k_scale = float(self.k_scale)
        self.kv_scales = (k_scale, float(self.v_scale) if self.cache_planes == 2 else k_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                rotary_emb=None) -> torch.Tensor:
        """q: [num_tokens, num_heads(, head_dim)], k/v: [num_tokens, num_kv_heads(, head_dim)]; given a
        RotaryEmbedding, q and k are rotated by positions [num_tokens] here, or in the backend's kernel
        that writes the cache when it fuses_rotary."""
        context = get_forward_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        meta = None if context.attn_metadata is None else context.attn_metadata.for_group(self.kv_group)
        fused = rotary_emb is not None and meta is not None and context.backend.fuses_rotary
        if rotary_emb is not None and not fused:
            q, k = rotary_emb(positions, q, k)
        if meta is None:  # profiling run without a cache: plain causal attention (no window)
            out = _causal_attention(q, k, v, self.scale, self.logits_soft_cap, self.sinks)
        elif fused:
            assert self.kv_cache is not None  # bound before any step with metadata
            out = context.backend.forward(q, k, v, self.kv_cache, meta, self.scale,
                                          self.sliding_window, self.kv_scales, positions=positions,
                                          rotary_emb=rotary_emb, logits_soft_cap=self.logits_soft_cap,
                                          sinks=self.sinks)
        else:
            assert self.kv_cache is not None
            out = context.backend.forward(q, k, v, self.kv_cache, meta, self.scale,
                                          self.sliding_window, self.kv_scales, logits_soft_cap=self.logits_soft_cap,
                                          sinks=self.sinks)
        return out.reshape(-1, self.num_heads * self.head_dim)


# NOTE: SDPA has no soft cap and no sinks, so such a dry run scores a slice of queries at a time: the
# profiled peak then holds at most this many float32 scores, not num_heads * num_tokens^2.
SCORES_PER_SLICE = 1 << 24


def _causal_attention(q, k, v, scale, logits_soft_cap, sinks):
    """q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]; sinks: [num_heads]."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.transpose(0, 1), k.repeat_interleave(group, dim=1).transpose(0, 1), v.repeat_interleave(
        group, dim=1).transpose(0, 1)  # [heads, num_tokens, head_dim]
    if logits_soft_cap is None and sinks is None:
        # NOTE: 4-D, [1, heads, tokens, head_dim]: given 3-D tensors SDPA takes its math path, which holds
        # heads x tokens^2 scores (on an H200 the profiled step of 8,192 tokens took ~20 GB from the KV cache)
        out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
        return out[0].transpose(0, 1)
    num_heads, num_tokens = q.shape[0], q.shape[1]
    out = torch.empty_like(q)
    step = max(1, SCORES_PER_SLICE // (num_heads * num_tokens))
    for start in range(0, num_tokens, step):
        end = min(num_tokens, start + step)  # queries [start, end) see keys [0, end)
        scores = torch.einsum("hqd,hkd->hqk", q[:, start:end].float(), k[:, :end].float()) * scale
        future = torch.arange(end, device=q.device)[None, :] > torch.arange(start, end, device=q.device)[:, None]
        scores = soft_cap(scores, logits_soft_cap).masked_fill(future, float("-inf"))
        probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(-1, 1, 1))
        out[:, start:end] = torch.einsum("hqk,hkd->hqd", probs, v[:, :end].float()).to(q.dtype)
    return out.transpose(0, 1)
