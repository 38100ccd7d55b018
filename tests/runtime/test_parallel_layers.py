"""Tensor-parallel weight loaders slice the right shard (checked in one process, rank by rank)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from shardserve.runtime.worker.checkpoint import CheckpointTensor
from shardserve.runtime.layers.embedding import VocabParallelEmbedding
from shardserve.runtime.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                              RowParallelLinear)
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state


@pytest.fixture
def tensors(tmp_path):
    """Checkpoint tensors written to a real safetensors file and read back lazily."""
    generator = torch.Generator().manual_seed(0)
    data = {
        "q": torch.randn(32, 32, generator=generator), "k": torch.randn(16, 32, generator=generator),
        "v": torch.randn(16, 32, generator=generator), "qkv_bias": torch.randn(64, generator=generator),
        "gate": torch.randn(48, 32, generator=generator), "up": torch.randn(48, 32, generator=generator),
        "down": torch.randn(32, 48, generator=generator), "embed": torch.randn(100, 32, generator=generator),
        "conv1d_attn": torch.randn(32, 96, generator=generator),  # GPT-2 layout: [in, 3 * out]
    }
    save_file(data, str(tmp_path / "t.safetensors"))
    handle = safe_open(str(tmp_path / "t.safetensors"), framework="pt")
    saved = get_parallel_state()
    yield data, {name: CheckpointTensor(handle.get_slice(name)) for name in data}
    set_parallel_state(saved)


def on_rank(tp_rank: int, tp_size: int, build):
    set_parallel_state(ParallelState(tp_rank=tp_rank, tp_size=tp_size))
    return build()


KV_HEADS_OF_RANK = {1: [[0, 1]], 2: [[0], [1]], 4: [[0], [0], [1], [1]]}  # tp 4 > 2 KV heads: replicated


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_shards_with_kv_head_replication(tensors, tp_size):
    data, lazy = tensors
    for rank in range(tp_size):
        layer = on_rank(rank, tp_size, lambda: QKVParallelLinear(32, 8, num_heads=4, num_kv_heads=2, bias=False))
        for shard in "qkv":
            layer.weight_loader(layer.weight, lazy[shard], shard)
        q_rows = 32 // tp_size
        kv = [h * 8 + i for h in KV_HEADS_OF_RANK[tp_size][rank] for i in range(8)]  # head_dim 8
        expected = torch.cat([data["q"][rank * q_rows:(rank + 1) * q_rows], data["k"][kv], data["v"][kv]])
        assert torch.equal(layer.weight, expected), (tp_size, rank)


def test_fused_transposed_qkv_matches_separate_loading(tensors):
    data, lazy = tensors
    full = data["conv1d_attn"].t()  # [96, 32] = q | k | v, each 32 rows (GPT-2: no GQA)
    for rank in range(2):
        layer = on_rank(rank, 2, lambda: QKVParallelLinear(32, 8, num_heads=4, num_kv_heads=4, bias=False))
        layer.weight_loader(layer.weight, lazy["conv1d_attn"].transposed())
        parts = [full[i * 32 + rank * 16: i * 32 + (rank + 1) * 16] for i in range(3)]
        assert torch.equal(layer.weight, torch.cat(parts))


def test_column_then_row_shards_sum_to_the_full_product(tensors):
    data, lazy = tensors
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    gate_up = torch.cat([data["gate"], data["up"]])
    full = F.linear(F.linear(x, gate_up)[:, :48] * F.linear(x, gate_up)[:, 48:], data["down"])
    partial_sums = torch.zeros_like(full)
    for rank in range(2):
        merged = on_rank(rank, 2, lambda: MergedColumnParallelLinear(32, [48, 48], bias=False))
        merged.weight_loader(merged.weight, lazy["gate"], 0)
        merged.weight_loader(merged.weight, lazy["up"], 1)
        row = on_rank(rank, 2, lambda: RowParallelLinear(48, 32, bias=False))
        row.weight_loader(row.weight, lazy["down"])
        gate, up = F.linear(x, merged.weight).chunk(2, dim=-1)
        partial_sums += F.linear(gate * up, row.weight)  # what the all-reduce adds up
    torch.testing.assert_close(partial_sums, full, atol=1e-4, rtol=1e-4)  # summation order differs


def test_column_parallel_bias_is_sharded(tensors):
    data, lazy = tensors
    for rank in range(2):
        layer = on_rank(rank, 2, lambda: ColumnParallelLinear(32, 64, bias=True))
        layer.weight_loader(layer.bias, lazy["qkv_bias"])
        assert torch.equal(layer.bias, data["qkv_bias"][rank * 32:(rank + 1) * 32])


def test_vocab_is_padded_and_split(tensors):
    data, lazy = tensors
    rows = []
    for rank in range(2):
        embed = on_rank(rank, 2, lambda: VocabParallelEmbedding(100, 32))
        embed.weight_loader(embed.weight, lazy["embed"])
        assert embed.num_padded == 128 and embed.weight.shape == (64, 32)
        rows.append(embed.weight)
    assert torch.equal(torch.cat(rows)[:100], data["embed"])
    assert not torch.cat(rows)[100:].any()  # padding rows stay zero


def test_indivisible_sizes_are_refused(tensors):
    with pytest.raises(ValueError, match="do not divide"):
        on_rank(0, 3, lambda: QKVParallelLinear(32, 8, num_heads=4, num_kv_heads=2))
