"""Expert tensors that hold every expert at once, as gpt-oss ships them, loaded into FusedMoE's stacks:

    checkpoint (E experts, H hidden, I intermediate)     FusedMoE parameter (this rank's experts)
    experts.gate_up_proj         [E, H, 2I]  (float)      w13        [E', 2I', H]
    experts.gate_up_proj_blocks  [E, 2I, H / 32, 16]      w13_blocks [E', 2I', H / 2]   (MXFP4, mxfp4_moe.py)
    experts.gate_up_proj_scales  [E, 2I, H / 32]          w13_scales [E', 2I', H / 32]
    experts.gate_up_proj_bias    [E, 2I]                  w13_bias   [E', 2I']
    experts.down_proj            [E, I, H]   (float)      w2         [E', H, I']
    experts.down_proj_blocks / _scales / _bias            w2_blocks [E', H, I' / 2], ..., w2_bias [E', H]

gate_up's 2I features interleave gate and up (feature 2j is gate j, 2j + 1 is up j); FusedMoE keeps
gate | up, I' = I / tp features of each on a tensor-parallel rank. Float matrices are stored [inputs,
outputs] and transposed here. One expert is read at a time."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardserve.runtime.checkpoint import CheckpointTensor
from shardserve.runtime.layers.weights import narrow_features, shard_range

if TYPE_CHECKING:
    from shardserve.runtime.layers.moe import FusedMoE

_STACKED = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


@dataclass(frozen=True)
class StackedExperts:
    """The shard id of a tensor of every expert: which matrix, and which part of it."""

    kind: str  # "w13" | "w2"
    part: str  # "" (float weight) | "bias" | "blocks" | "scales"


def stacked_expert_weight(name: str) -> tuple[str, StackedExperts] | None:
    """`<prefix>.experts.gate_up_proj_blocks` -> (`<prefix>.experts.w13_blocks`, its StackedExperts); None
    when `name` is no such tensor."""
    found = _STACKED.search(name)
    if not found:
        return None
    kind, part = ("w13" if found.group(1) == "gate_up_proj" else "w2"), (found.group(2) or "")[1:]
    return f"{name[:found.start()]}.experts.{kind}{'_' + part if part else ''}", StackedExperts(kind, part)


def load_stacked(layer: FusedMoE, param: nn.Parameter, loaded: CheckpointTensor, shard: StackedExperts) -> None:
    """Each of this rank's experts from the tensor of all, its features of this rank, into `param`."""
    start, size = shard_range(layer.intermediate_size, layer.feature_rank, layer.feature_ranks)
    for local in range(layer.num_local_experts):
        expert = loaded.narrow(0, layer.first_expert + local, 1).load()[0]
        if shard.part == "":  # a float matrix, [inputs, outputs]
            expert = expert.t()
        if expert.dim() == 3:  # MXFP4 blocks [N, K / 32, 16] -> bytes [N, K / 2]
            expert = expert.flatten(1)
        with torch.no_grad():
            param.data[local].copy_(_rank_features(expert, shard, layer.intermediate_size, start, size,
                                                    layer.feature_rank))


def _rank_features(expert: torch.Tensor, shard: StackedExperts, intermediate: int, start: int, size: int,
                   feature_rank: int) -> torch.Tensor:
    """One expert's part on this rank: w13's gate and up features [start, start + size) as gate | up;
    w2's inputs [start, start + size) (columns holding several inputs each for blocks and scales); w2's
    bias only on feature rank 0 (the all-reduce adds the ranks' partial sums)."""
    if shard.kind == "w13":
        rows = expert[2 * start: 2 * (start + size)]
        return torch.cat((rows[0::2], rows[1::2]))
    if shard.part == "bias":
        return expert if feature_rank == 0 else torch.zeros_like(expert)
    return narrow_features(expert, 1, intermediate // expert.shape[1], start, size)
