"""Megatron-style tensor-parallel linear layers.

Each layer's weight_loader(param, loaded, ...) copies its own shard of a checkpoint tensor into one of
its parameters, so the loader never needs to know how a layer is split. NOTE: the loader finds the
method on the parameter's module; a bound method stored on the parameter would make a
module-parameter cycle that outlives `del` and keeps device memory until the garbage collector runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.runtime.checkpoint import CheckpointTensor
from shardserve.runtime.layers.weights import copy_into, default_weight_loader, shard_range
from shardserve.runtime.parallel_state import (get_parallel_state, tensor_parallel_all_gather,
                                               tensor_parallel_all_reduce)


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [output_size_per_rank, input_size_per_rank]."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype | None = None):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *shard) -> None:
        """Copy this rank's shard of `loaded` into `param`; each subclass knows its split."""
        raise NotImplementedError


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank (routers, small projections)."""

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *shard) -> None:
        default_weight_loader(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is a slice unless gather_output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 dtype: torch.dtype | None = None):
        tp_size = get_parallel_state().tp_size
        self.output_size = output_size
        self.gather_output = gather_output
        super().__init__(input_size, shard_range(output_size, 0, tp_size)[1], bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return tensor_parallel_all_gather(y) if self.gather_output else y

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *shard) -> None:
        start, size = shard_range(loaded.shape[0], self.tp_rank, self.tp_size)
        copy_into(param.data, loaded.narrow(0, start, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked in one (gate and up -> gate_up). The checkpoint's
    separate tensors load through shard index i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 dtype: torch.dtype | None = None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, dtype=dtype)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_index: int | None = None) -> None:
        if shard_index is None:  # already fused in the checkpoint: load each part in turn
            offset = 0
            for index, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded.narrow(0, offset, size), index)
                offset += size
            return
        part = self.output_sizes[shard_index] // self.tp_size
        offset = sum(self.output_sizes[:shard_index]) // self.tp_size
        start, size = shard_range(self.output_sizes[shard_index], self.tp_rank, self.tp_size)
        copy_into(param.data.narrow(0, offset, part), loaded.narrow(0, start, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matrix, laid out per rank as
    [q heads of this rank | k heads | v heads]. When tp_size exceeds the KV heads, each KV head is
    replicated on tp_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = True,
                 dtype: torch.dtype | None = None):
        tp_size = get_parallel_state().tp_size
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} attention heads do not divide over tensor_parallel_size={tp_size}")
        if max(num_kv_heads, tp_size) % min(num_kv_heads, tp_size):
            raise ValueError(f"{num_kv_heads} KV heads and tensor_parallel_size={tp_size}: one must divide the other")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size  # per rank
        self.num_kv_heads = max(1, num_kv_heads // tp_size)  # per rank
        self.total_num_kv_heads = num_kv_heads
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output, bias, dtype=dtype)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str | None = None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id is None:  # fused q|k|v in the checkpoint (GPT-2's c_attn)
            total_q = q_size * self.tp_size
            total_kv = self.total_num_kv_heads * self.head_dim
            self.weight_loader(param, loaded.narrow(0, 0, total_q), "q")
            self.weight_loader(param, loaded.narrow(0, total_q, total_kv), "k")
            self.weight_loader(param, loaded.narrow(0, total_q + total_kv, total_kv), "v")
            return
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            kv_rank = self.tp_rank // self.kv_replicas
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, kv_rank * kv_size
        copy_into(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed by the all-reduce here.
    The bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, dtype: torch.dtype | None = None):
        tp_size = get_parallel_state().tp_size
        super().__init__(shard_range(input_size, 0, tp_size)[1], output_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tensor_parallel_all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *shard) -> None:
        if param.dim() == 1:  # bias: whole on every rank
            copy_into(param.data, loaded)
            return
        start, size = shard_range(loaded.shape[1], self.tp_rank, self.tp_size)
        copy_into(param.data, loaded.narrow(1, start, size))
