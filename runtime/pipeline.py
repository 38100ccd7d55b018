"""Pipeline stages: the layer split, placeholders for layers not owned, and the tensors handed on."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch
from torch import nn

from shardserve.planner.layer_split import split_layers as planner_split_layers
from shardserve.runtime.parallel_state import get_parallel_state


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges per stage, from the planner's split (the one function
    both use). NOTE: layers weigh the same here and embedding/head are not counted; when the plan's
    split differs (its extras tip a layer to another stage), pass the plan's split instead."""
    counts = planner_split_layers([1.0] * num_layers, num_stages)
    ends = list(accumulate(counts))
    return [(end - count, end) for count, end in zip(counts, ends)]


class MissingLayer(nn.Module):
    """Stands in for a layer owned by another stage; holds no weights and is never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a layer owned by another pipeline stage was called")


def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> tuple[nn.ModuleList, int, int]:
    """Build this stage's layers; the others become MissingLayer. Returns (layers, start, end)."""
    state = get_parallel_state()
    start, end = split_layers(num_layers, state.pp_size)[state.pp_rank]
    layers = [build(i) if start <= i < end else MissingLayer() for i in range(num_layers)]
    return nn.ModuleList(layers), start, end


@dataclass(slots=True)
class IntermediateTensors:
    """What one stage hands the next: the residual stream split as the layers expect it."""

    hidden_states: torch.Tensor  # [num_tokens, hidden_size]
    residual: torch.Tensor | None  # [num_tokens, hidden_size]
