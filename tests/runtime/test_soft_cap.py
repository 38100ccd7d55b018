"""Attention logit soft-capping (Gemma 2) in the torch paged backend and the layer's no-cache path,
against dense attention written out here."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime.attention import layer as layer_module
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend, paged_attention, write_kv
from shardserve.runtime.forward_context import ForwardContext, forward_context
from tests.runtime import attention_cases

BLOCK_SIZE, NUM_BLOCKS, SCALE = 4, 24, 0.9


def dense_reference(q, keys, values, positions, cap, window=None):
    """q: [n, heads, dim] at `positions`; keys/values: [seq_len, kv_heads, dim] (every position)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    out = []
    for j, position in enumerate(positions):
        first = 0 if window is None else max(0, position - window + 1)
        scores = torch.einsum("hd,lhd->hl", q[j], keys[first: position + 1]) * SCALE
        probs = torch.softmax(torch.tanh(scores / cap) * cap, dim=-1)
        out.append(torch.einsum("hl,lhd->hd", probs, values[first: position + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_caps_scores_in_prefill_and_decode(window):
    shapes = [(9, 4), (0, 7), (13, 1), (3, 1)]  # two prefills (one over a cached prefix), two decodes
    meta = attention_cases.make_batch(shapes, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    num_tokens = meta.query_start_loc_cpu[-1]
    q = torch.randn(num_tokens, 4, 8, generator=generator) * 3  # large scores: the cap bites
    k, v = torch.randn(num_tokens, 2, 8, generator=generator) * 3, torch.randn(num_tokens, 2, 8, generator=generator)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8, generator=generator) * 3  # the cached prefixes
    write_kv(k, v, cache, meta.slot_mapping)
    out = paged_attention(q, cache, meta, SCALE, sliding_window=window, logits_soft_cap=2.0)
    for r, (num_cached, num_new) in enumerate(shapes):
        start, seq_len = meta.query_start_loc_cpu[r], num_cached + num_new
        blocks = meta.block_tables[r, : -(-seq_len // BLOCK_SIZE)].long()
        keys, values = (cache[i, blocks].flatten(0, 1)[:seq_len] for i in (0, 1))
        expected = dense_reference(q[start: start + num_new], keys, values, range(num_cached, seq_len), 2.0, window)
        torch.testing.assert_close(out[start: start + num_new], expected)
    uncapped = paged_attention(q, cache, meta, SCALE, sliding_window=window)
    assert (uncapped - out).abs().max() > 0.1  # control: the cap changed the result


@pytest.mark.parametrize("scores_per_slice", [1 << 24, 100])  # the whole prompt at once; 2 queries a slice
def test_no_cache_path_caps_like_the_paged_backend(scores_per_slice, monkeypatch):
    """The layer's dry-run path (no metadata) and the paged backend agree on one capped prompt."""
    monkeypatch.setattr(layer_module, "SCORES_PER_SLICE", scores_per_slice)
    layer = Attention(num_heads=4, head_dim=8, scale=SCALE, num_kv_heads=2, logits_soft_cap=2.0)
    meta = attention_cases.make_batch([(0, 11)], BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(11, 32, generator=generator) * 3
    k, v = torch.randn(11, 16, generator=generator) * 3, torch.randn(11, 16, generator=generator)
    layer.kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8)
    with forward_context(ForwardContext(None, TorchAttentionBackend())):
        dry = layer(q, k, v)
    with forward_context(ForwardContext(meta, TorchAttentionBackend())):
        paged = layer(q, k, v)
    torch.testing.assert_close(dry, paged)
    expected = dense_reference(q.view(11, 4, 8), k.view(11, 2, 8), v.view(11, 2, 8), range(11), 2.0)
    torch.testing.assert_close(dry, expected.flatten(1))
