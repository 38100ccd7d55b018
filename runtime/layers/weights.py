"""Copying a checkpoint slice into a parameter, with shape checks that name the mismatch."""

from __future__ import annotations

import torch

from shardserve.runtime.checkpoint import CheckpointTensor


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
