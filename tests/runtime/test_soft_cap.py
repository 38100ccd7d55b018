"""Attention logit soft-capping (Gemma 2) in the torch paged backend (its no-cache path: test_attention_sinks.py),
against dense attention written out here."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime.attention.torch_backend import paged_attention, write_kv
from tests.runtime import attention_cases

BLOCK_SIZE, NUM_BLOCKS, SCALE = 4, 24, 0.9


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
        expected = attention_cases.dense_reference(q[start: start + num_new], keys, values, range(num_cached, seq_len),
                                                   SCALE, 2.0, window)
        torch.testing.assert_close(out[start: start + num_new], expected)
    uncapped = paged_attention(q, cache, meta, SCALE, sliding_window=window)
    assert (uncapped - out).abs().max() > 0.1  # control: the cap changed the result
