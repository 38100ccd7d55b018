"""Copying a checkpoint slice into a parameter (packed or grouped features counted whole), with shape
checks that name the mismatch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardserve.runtime.worker.checkpoint import CheckpointTensor


def copy_into(target: torch.Tensor, loaded: CheckpointTensor) -> None:
    if tuple(target.shape) != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {loaded.shape} does not fit parameter slice "
                         f"of shape {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(loaded.load())


def default_weight_loader(param: torch.Tensor, loaded: CheckpointTensor) -> None:
    """For replicated parameters: the whole tensor."""
    copy_into(param.data, loaded)


def shard_range(size: int, rank: int, num_ranks: int) -> tuple[int, int]:
    if size % num_ranks:
        raise ValueError(f"dimension {size} does not divide evenly over {num_ranks} tensor-parallel ranks")
    part = size // num_ranks
    return rank * part, part


@dataclass(frozen=True, slots=True)
class PackedDims:
    """Where a parameter keeps its output and input features, and how many features share one stored
    index there (8 nibbles in an int32, a quantization group, an fp8 block). None: the parameter is
    whole on every rank along that feature axis."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_per_element: int = 1
    input_per_element: int = 1
    is_broadcast: bool = False  # a one-element checkpoint tensor fills the output range (per-tensor scale)
    is_per_part: bool = False  # a leading axis of the merged parts (q, k, v): each part's checkpoint tensor whole


FLOAT_WEIGHT = PackedDims()
COLUMN_BIAS = PackedDims(0, None)
WHOLE = PackedDims(None, None)


def narrow_features(tensor, dim: int, per_element: int, start: int, size: int):
    """tensor.narrow over features [start, start + size) of a dimension storing `per_element` each."""
    if start % per_element or size % per_element:
        raise ValueError(f"features [{start}, {start + size}) cut a packed element or quantization group of "
                         f"{per_element}: this tensor-parallel size splits the quantized weight unevenly")
    return tensor.narrow(dim, start // per_element, size // per_element)


def load_features(target: torch.Tensor, loaded: CheckpointTensor, dims: PackedDims,
                  out_range: tuple[int, int, int] | None = None, in_range: tuple[int, int] | None = None) -> None:
    """Copy features of `loaded` into `target`: out_range=(target offset, loaded start, size) and
    in_range=(loaded start, size), both counted in features (unpacked, ungrouped)."""
    if out_range is not None and dims.output_dim is not None:
        offset, start, size = out_range
        target = narrow_features(target, dims.output_dim, dims.output_per_element, offset, size)
        if not (dims.is_broadcast and math.prod(loaded.shape) == 1):
            loaded = narrow_features(loaded, dims.output_dim, dims.output_per_element, start, size)
    if dims.is_broadcast and math.prod(loaded.shape) == 1:
        with torch.no_grad():
            target.fill_(loaded.load().reshape(()).float().item())
        return
    if in_range is not None and dims.input_dim is not None:
        start, size = in_range
        loaded = narrow_features(loaded, dims.input_dim, dims.input_per_element, start, size)
    copy_into(target, loaded)
