"""LoRA adapter slots on a linear layer: y += B_slot @ (A_slot @ x) for each token's adapter, batched.

A layer whose output merges parts (q|k|v, gate|up) has an A per part and one B over its output rows:

    a  [slots, parts, max_rank, input features of this rank]
    b  [slots, output features of this rank, max_rank]      (the adapter's scaling folded in)

    shrink:  s = x @ a[slot].view(parts * rank, in).T           one gathered matmul, [tokens, parts * rank]
    expand:  y[:, part p's rows] += s[:, p's rank] @ b[slot, p's rows].T      one per part

Sharded as the layer is: a column-parallel layer keeps A whole and B's rows of the rank; a row-parallel
one keeps A's columns of the rank and B whole, and its partial product joins the layer's all-reduce.
A slot's rank and parts beyond the adapter's are zeros, so every slot runs the same shapes."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from shardserve.runtime.worker.forward_context import get_forward_context
from shardserve.runtime.layers.linear import LinearBase
from shardserve.runtime.layers.lora_ops import gathered_matmul

# the model's module names that carry slots, and the checkpoint modules each merges, in part order
LORA_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRASlotWeights(nn.Module):
    a: torch.Tensor
    b: torch.Tensor

    def __init__(self, parts: list[tuple[int, int]], in_features: int, out_features: int, num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.parts = parts  # (offset, size) of each part in this rank's output features
        self.max_rank = max_rank
        self.register_buffer("a", torch.zeros(num_slots, len(parts), max_rank, in_features, dtype=dtype,
                                              device=device), persistent=False)
        self.register_buffer("b", torch.zeros(num_slots, out_features, max_rank, dtype=dtype, device=device),
                             persistent=False)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus the adapters' products for this step's tokens (y itself when no token has one)."""
        batch = get_forward_context().lora
        if batch is None:  # no token of this step has an adapter
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        slots, parts, rank = self.a.shape[:3]
        shrunk = torch.empty(x2.shape[0], parts * rank, dtype=x2.dtype, device=x2.device)
        gathered_matmul(x2, self.a.view(slots, parts * rank, -1), shrunk, batch, add=False)
        for index, (offset, size) in enumerate(self.parts):
            gathered_matmul(shrunk[:, index * rank:(index + 1) * rank], self.b[:, offset:offset + size],
                            y2[:, offset:offset + size], batch, add=True)
        return y

    def set_slot(self, slot: int, a_parts: list[torch.Tensor | None], b_parts: list[torch.Tensor | None]) -> None:
        """Fill `slot` with one adapter's shard: A [rank, in] and B [part rows, rank] (scaled) per part,
        None for a part it does not adapt."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, ((offset, size), a, b) in enumerate(zip(self.parts, a_parts, b_parts)):
            if a is not None and b is not None:
                rank = a.shape[0]
                self.a[slot, index, :rank].copy_(a)
                self.b[slot, offset:offset + size, :rank].copy_(b)


def attach_lora_slots(model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
                      device: torch.device) -> dict[str, LoRASlotWeights]:
    """Give every adaptable linear layer of this rank's stage its slots; returns them by module name."""
    slots = {}
    for name, layer in _adaptable(model):
        layer.lora = slots[name] = LoRASlotWeights(layer.output_parts(), layer.input_size_per_rank,
                                                   layer.output_size_per_rank, num_slots, max_rank, dtype, device)
    return slots


def _adaptable(model: nn.Module) -> Iterator[tuple[str, LinearBase]]:
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LORA_LAYERS and isinstance(module, LinearBase):
            yield name, module
