"""Pipeline stages: the layer split, placeholders for layers not owned, and the tensors handed on."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch
from torch import nn

from shardserve.planner.layer_split import split_layers as planner_split_layers
from shardserve.runtime.distributed.parallel_state import get_parallel_state


def split_layers(num_layers: int, num_stages: int,
                 layer_counts: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges per stage. `layer_counts` is the plan's split (from
    plan_layer_split); without it, the planner's function on equal layers gives the even split."""
    counts = list(layer_counts) if layer_counts is not None else planner_split_layers([1.0] * num_layers, num_stages)
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"layer split {counts} does not cover {num_layers} layers in {num_stages} stages")
    ends = list(accumulate(counts))
    return [(end - count, end) for count, end in zip(counts, ends)]


def plan_layer_split(model: str, tensor_parallel_size: int, pipeline_parallel_size: int,
                     dtype: torch.dtype, quantization: str | None = None) -> tuple[int, ...]:
    """Layers per stage exactly as the planner chooses them (weight bytes balanced, embedding on the
    first stage and head on the last): the one function both call."""
    from shardserve.planner.model_source import load_model as load_model_info

    info = load_model_info(model, quantization)
    name = str(dtype).removeprefix("torch.")
    return tuple(info.layer_split(tensor_parallel_size, pipeline_parallel_size, name))


class MissingLayer(nn.Module):
    """Stands in for a layer owned by another stage; holds no weights and is never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a layer owned by another pipeline stage was called")


def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> tuple[nn.ModuleList, int, int]:
    """Build this stage's layers; the others become MissingLayer. Returns (layers, start, end)."""
    state = get_parallel_state()
    start, end = split_layers(num_layers, state.pp_size, state.layer_split)[state.pp_rank]
    layers = [build(i) if start <= i < end else MissingLayer() for i in range(num_layers)]
    return nn.ModuleList(layers), start, end


@dataclass(slots=True)
class IntermediateTensors:
    """What one stage hands the next: the residual stream split as the layers expect it."""

    hidden_states: torch.Tensor  # [num_tokens, hidden_size]
    residual: torch.Tensor | None  # [num_tokens, hidden_size]


def send_intermediate(tensors: IntermediateTensors) -> None:
    """To the same tp_rank of the next stage: a header [has_residual, num_tokens, hidden_size],
    then the tensors. NOTE: the header keeps the receiver model-agnostic (GPT-2 hands no residual)."""
    dst = get_parallel_state().next_stage_rank
    hidden = tensors.hidden_states.contiguous()
    header = torch.tensor([tensors.residual is not None, *hidden.shape], dtype=torch.int64, device=hidden.device)
    torch.distributed.send(header, dst)
    torch.distributed.send(hidden, dst)
    if tensors.residual is not None:
        torch.distributed.send(tensors.residual.contiguous(), dst)


def _recv_header(device: torch.device) -> tuple[int, ...]:
    """(has_residual, num_tokens, hidden_size) from the previous stage's send_intermediate."""
    header = torch.empty(3, dtype=torch.int64, device=device)  # on the device: NCCL sends no CPU tensors
    torch.distributed.recv(header, get_parallel_state().previous_stage_rank)
    return tuple(header.tolist())


def recv_intermediate(dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
    """From the same tp_rank of the previous stage; mirrors send_intermediate."""
    src = get_parallel_state().previous_stage_rank
    has_residual, num_tokens, hidden_size = _recv_header(device)
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    torch.distributed.recv(hidden, src)
    residual = None
    if has_residual:
        residual = torch.empty_like(hidden)
        torch.distributed.recv(residual, src)
    return IntermediateTensors(hidden, residual)


def recv_intermediate_into(buffers: IntermediateTensors, num_tokens: int) -> None:
    """Like recv_intermediate, into the leading num_tokens rows of a CUDA graph's static buffers
    (buffers.residual is there whatever the model; it stays untouched when no residual comes)."""
    src = get_parallel_state().previous_stage_rank
    has_residual, sent_tokens, hidden_size = _recv_header(buffers.hidden_states.device)
    if (sent_tokens, hidden_size) != (num_tokens, buffers.hidden_states.shape[1]):
        raise RuntimeError(f"the previous stage sent [{sent_tokens}, {hidden_size}] hidden states; this "
                           f"stage's step expects [{num_tokens}, {buffers.hidden_states.shape[1]}]")
    torch.distributed.recv(buffers.hidden_states[:num_tokens], src)  # leading rows: contiguous
    if has_residual:
        assert buffers.residual is not None  # a graph's buffers always have one (above)
        torch.distributed.recv(buffers.residual[:num_tokens], src)
