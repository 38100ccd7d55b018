"""Attention sinks (gpt-oss) in the torch paged backend and the layer's no-cache path, against the
formula written out here and transformers' eager attention; the layer's sinks parameter and its
tensor-parallel loader."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardserve.runtime.distributed import parallel_state
from shardserve.runtime.attention import layer as layer_module
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend, paged_attention, write_kv
from shardserve.runtime.worker.checkpoint import CheckpointTensor
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context
from shardserve.runtime.distributed.parallel_state import ParallelState
from tests.runtime import attention_cases

BLOCK_SIZE, NUM_BLOCKS, SCALE = 4, 24, 0.9
SHAPES = [(9, 4), (0, 7), (13, 1), (3, 1)]  # two prefills (one over a cached prefix), two decodes


def random_case(shapes, num_heads=4, num_kv_heads=2, head_dim=8, seed=3):
    """Metadata, q and a cache holding every request's keys and values (cached prefixes and new tokens)."""
    meta = attention_cases.make_batch(shapes, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    num_tokens = meta.query_start_loc_cpu[-1]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) for _ in range(2))
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    write_kv(k, v, cache, meta.slot_mapping)
    return meta, q, cache


def request_kv(cache, meta, r):
    """Request r's keys and values at every position: 2 x [seq_len, kv_heads, dim]."""
    seq_len = meta.seq_lens_cpu[r]
    blocks = meta.block_tables[r, : -(-seq_len // BLOCK_SIZE)].long()
    return (cache[i, blocks].flatten(0, 1)[:seq_len] for i in (0, 1))


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_adds_each_heads_sink_in_prefill_and_decode(window):
    meta, q, cache = random_case(SHAPES)
    sinks = attention_cases.sinks_for(4)
    out = paged_attention(q, cache, meta, SCALE, sliding_window=window, sinks=sinks)
    for r, (num_cached, num_new) in enumerate(SHAPES):
        start, seq_len = meta.query_start_loc_cpu[r], num_cached + num_new
        keys, values = request_kv(cache, meta, r)
        expected = attention_cases.dense_reference(q[start: start + num_new], keys, values, range(num_cached, seq_len),
                                                   SCALE, window=window, sinks=sinks)
        torch.testing.assert_close(out[start: start + num_new], expected)
    plain = paged_attention(q, cache, meta, SCALE, sliding_window=window)
    assert out[:, 0].abs().max() < 1e-20  # a sink far above every score takes all of its head's attention
    torch.testing.assert_close(out[:, -1], plain[:, -1])  # one far below changes nothing
    assert (out[:, 1:-1] - plain[:, 1:-1]).abs().max() > 0.1  # control: the other sinks bite


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_transformers_gpt_oss_eager_attention(window):
    """A chunk of 6 queries over a 9-token cached prefix, GQA (4 heads over 2 KV heads)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    meta, q, cache = random_case([(9, 6)])
    sinks = attention_cases.sinks_for(4, seed=1)
    keys, values = request_kv(cache, meta, 0)
    positions, key_positions = torch.arange(9, 15)[:, None], torch.arange(15)[None, :]
    hidden = key_positions > positions
    if window is not None:
        hidden |= key_positions <= positions - window
    mask = torch.zeros(hidden.shape).masked_fill(hidden, torch.finfo(torch.float32).min)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=2, training=False)
    expected, _ = eager_attention_forward(module, q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                          values.transpose(0, 1)[None], mask[None, None], SCALE)
    actual = paged_attention(q, cache, meta, SCALE, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(actual, expected[0])


@pytest.mark.parametrize("cap, has_sinks", [(2.0, False), (None, True), (2.0, True)], ids=["cap", "sinks", "both"])
@pytest.mark.parametrize("scores_per_slice", [1 << 24, 100])  # the whole prompt at once; 2 queries a slice
def test_no_cache_path_matches_the_paged_backend(cap, has_sinks, scores_per_slice, monkeypatch):
    """The layer's dry-run path (no metadata: SDPA has neither soft caps nor sinks) and the paged backend
    agree on one prompt, and both with the dense reference."""
    monkeypatch.setattr(layer_module, "SCORES_PER_SLICE", scores_per_slice)
    layer = Attention(num_heads=4, head_dim=8, scale=SCALE, num_kv_heads=2, logits_soft_cap=cap, has_sinks=has_sinks)
    if has_sinks:
        with torch.no_grad():
            layer.sinks.copy_(attention_cases.sinks_for(4, seed=2))
    meta = attention_cases.make_batch([(0, 11)], BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(11, n, generator=generator) * 3 for n in (32, 16, 16))  # large scores: the cap bites
    layer.kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8)
    with forward_context(ForwardContext(None, TorchAttentionBackend())):
        dry = layer(q, k, v)
    with forward_context(ForwardContext(meta, TorchAttentionBackend())):
        paged = layer(q, k, v)
    torch.testing.assert_close(dry, paged)
    expected = attention_cases.dense_reference(q.view(11, 4, 8), k.view(11, 2, 8), v.view(11, 2, 8), range(11), SCALE,
                                               cap, sinks=layer.sinks)
    torch.testing.assert_close(dry, expected.flatten(1))


def test_layer_without_sinks_has_no_sinks_parameter():
    layer = Attention(num_heads=4, head_dim=8, scale=SCALE, num_kv_heads=2)
    assert layer.sinks is None and "sinks" not in dict(layer.named_parameters())


@pytest.fixture
def checkpoint_sinks(tmp_path):
    """A bfloat16 [8] sinks tensor (8 heads), and a [6] one, written to safetensors and read back lazily."""
    data = {"sinks": torch.randn(8, generator=torch.Generator().manual_seed(0)).bfloat16(), "six": torch.zeros(6)}
    save_file(data, str(tmp_path / "t.safetensors"))
    handle = safe_open(str(tmp_path / "t.safetensors"), framework="pt")
    return data["sinks"], {name: CheckpointTensor(handle.get_slice(name)) for name in data}


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_sinks_load_this_ranks_heads(checkpoint_sinks, tp_size, monkeypatch):
    whole, lazy = checkpoint_sinks
    heads = 8 // tp_size
    for rank in range(tp_size):
        monkeypatch.setattr(parallel_state, "_STATE", ParallelState(tp_rank=rank, tp_size=tp_size))
        layer = Attention(num_heads=heads, head_dim=8, scale=SCALE, num_kv_heads=1, has_sinks=True)
        assert layer.sinks.dtype == torch.float32 and not layer.sinks.requires_grad
        layer.weight_loader(layer.sinks, lazy["sinks"])
        assert torch.equal(layer.sinks, whole[rank * heads: (rank + 1) * heads].float()), (tp_size, rank)


def test_sinks_of_another_head_count_are_refused(checkpoint_sinks, monkeypatch):
    _, lazy = checkpoint_sinks
    monkeypatch.setattr(parallel_state, "_STATE", ParallelState(tp_rank=1, tp_size=2))
    layer = Attention(num_heads=4, head_dim=8, scale=SCALE, num_kv_heads=1, has_sinks=True)
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight_loader(layer.sinks, lazy["six"])  # 3 heads a rank, the layer has 4


def test_dry_run_attention_takes_sdpas_fused_kernel_not_its_math_path():
    """The profiled step's attention (no metadata, no cap, no sinks) must not hold heads x tokens^2 scores: on an
    H200 SDPA's math path, which 3-D tensors select, took ~20 GB from the KV cache at 8,192 tokens."""
    from torch.profiler import profile

    layer = Attention(num_heads=4, head_dim=8, scale=SCALE, num_kv_heads=2)
    meta = attention_cases.make_batch([(0, 11)], BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(11, n, generator=generator) for n in (32, 16, 16))
    layer.kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8)
    with profile() as prof, forward_context(ForwardContext(None, TorchAttentionBackend())):
        dry = layer(q, k, v)
    names = {event.name for event in prof.events()}
    assert "aten::scaled_dot_product_attention" in names and "aten::_scaled_dot_product_attention_math" not in names
    with forward_context(ForwardContext(meta, TorchAttentionBackend())):
        torch.testing.assert_close(dry, layer(q, k, v))
