"""Megatron-style tensor-parallel linear layers.

Each layer's weight_loader(param, loaded, ...) copies its own shard of a checkpoint tensor into one of
its parameters, so the loader never needs to know how a layer is split. NOTE: the loader finds the
method on the parameter's module; a bound method stored on the parameter would make a
module-parameter cycle that outlives `del` and keeps device memory until the garbage collector runs.

A layer built inside `quantized_layers(config)` holds its weight in the checkpoint's packed form
(a quant method makes the parameters and the matmul); `packed_dims` says, per parameter, where its
output and input features lie, so the same slicing serves float and packed weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.runtime.worker.checkpoint import CheckpointTensor
from shardserve.runtime.layers.quantization.methods import current_linear_method
from shardserve.runtime.layers.weights import (COLUMN_BIAS, FLOAT_WEIGHT, WHOLE, PackedDims, load_features,
                                               shard_range)
from shardserve.runtime.distributed.parallel_state import (get_parallel_state, tensor_parallel_all_gather,
                                               tensor_parallel_all_reduce)

if TYPE_CHECKING:
    from shardserve.runtime.layers.lora import LoRASlotWeights


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [output_size_per_rank, input_size_per_rank] (or its packed form)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype | None = None,
                 full_input_size: int | None = None):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.quant_method = current_linear_method()  # None: float weights
        self.input_size_per_rank, self.output_size_per_rank = input_size, output_size
        self.lora: LoRASlotWeights | None = None  # enable_lora's slots (layers/lora.py), added after loading
        self.packed_dims: dict[str, PackedDims] = {}
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
            self.packed_dims["weight"] = FLOAT_WEIGHT
        else:
            self.quant_method.create_weights(self, input_size, output_size, full_input_size or input_size)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.packed_dims["bias"] = COLUMN_BIAS
        else:
            self.register_parameter("bias", None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias."""
        return F.linear(x, self.weight) if self.quant_method is None else self.quant_method.apply(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = self.quant_method.apply(self, x)
            y = y if self.bias is None else y + self.bias
        return y if self.lora is None else self.lora.add(x, y)

    def part_rows(self, index: int) -> tuple[int, int]:
        """(start, size) of this rank's rows in the checkpoint's matrix of output part `index`."""
        raise NotImplementedError

    def input_columns(self) -> tuple[int, int]:
        """(start, size) of this rank's columns of the checkpoint's input features."""
        return 0, self.input_size_per_rank

    def output_parts(self) -> list[tuple[int, int]]:
        """(offset, size) of each merged matrix in this rank's output features."""
        return [(0, self.output_size_per_rank)]

    def load(self, param: nn.Parameter, loaded: CheckpointTensor, out_range: tuple[int, int, int] | None = None,
             in_range: tuple[int, int] | None = None) -> None:
        name = next(n for n, p in self._parameters.items() if p is param)
        dims, target = self.packed_dims[name], param.data
        if dims.is_per_part:  # the part starting at out_range's offset gets its own row
            offsets = [offset for offset, _ in self.output_parts()]
            target = target[offsets.index(out_range[0] if out_range else 0)]
        load_features(target, loaded, dims, out_range, in_range)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *shard) -> None:
        """Copy this rank's shard of `loaded` into `param`; each subclass knows its split."""
        raise NotImplementedError


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank (routers, small projections)."""

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *shard) -> None:
        self.load(param, loaded)

    def part_rows(self, index: int) -> tuple[int, int]:
        return 0, self.output_size_per_rank


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

    def part_rows(self, index: int) -> tuple[int, int]:
        return shard_range(self.output_size, self.tp_rank, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *shard) -> None:
        self.load(param, loaded, out_range=(0, *self.part_rows(0)))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked in one (gate and up -> gate_up). The checkpoint's
    separate tensors load through shard index i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 dtype: torch.dtype | None = None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, dtype=dtype)

    def output_parts(self) -> list[tuple[int, int]]:
        return [(sum(self.output_sizes[:i]) // self.tp_size, size // self.tp_size)
                for i, size in enumerate(self.output_sizes)]

    def part_rows(self, index: int) -> tuple[int, int]:
        return shard_range(self.output_sizes[index], self.tp_rank, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_index: int | None = None) -> None:
        indices = range(len(self.output_sizes)) if shard_index is None else [shard_index]
        for index in indices:  # all of them when already fused in the checkpoint
            base = sum(self.output_sizes[:index]) if shard_index is None else 0
            offset = sum(self.output_sizes[:index]) // self.tp_size
            start, size = self.part_rows(index)
            self.load(param, loaded, out_range=(offset, base + start, size))


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

    def output_parts(self) -> list[tuple[int, int]]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)]

    def part_rows(self, index: int) -> tuple[int, int]:
        """q (0) by this rank's heads; k (1) and v (2) by its KV heads, shared by kv_replicas ranks."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (self.tp_rank * q_size, q_size) if index == 0 else \
            (self.tp_rank // self.kv_replicas * kv_size, kv_size)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str | None = None) -> None:
        total_q, total_kv = self.num_heads * self.head_dim * self.tp_size, self.total_num_kv_heads * self.head_dim
        bases = {"q": 0, "k": total_q, "v": total_q + total_kv}  # fused q|k|v in the checkpoint (GPT-2's c_attn)
        for part in ("q", "k", "v") if shard_id is None else (shard_id,):
            index = "qkv".index(part)
            start, size = self.part_rows(index)
            base = bases[part] if shard_id is None else 0
            self.load(param, loaded, out_range=(self.output_parts()[index][0], base + start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed by the all-reduce here.
    The bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, dtype: torch.dtype | None = None):
        tp_size = get_parallel_state().tp_size
        self.input_size = input_size
        super().__init__(shard_range(input_size, 0, tp_size)[1], output_size, bias, dtype, full_input_size=input_size)
        if bias:
            self.packed_dims["bias"] = WHOLE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.lora is not None:  # its partial product over this rank's columns joins the reduction
            y = self.lora.add(x, y)
        y = tensor_parallel_all_reduce(y)
        return y if self.bias is None else y + self.bias

    def part_rows(self, index: int) -> tuple[int, int]:
        return 0, self.output_size_per_rank

    def input_columns(self) -> tuple[int, int]:
        return shard_range(self.input_size, self.tp_rank, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *shard) -> None:
        self.load(param, loaded, in_range=self.input_columns())
