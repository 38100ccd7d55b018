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
outputs] and transposed here. One expert is read at a time, and of it only this rank's features."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardserve.planner.model_spec import stacked_expert_part
from shardserve.runtime.worker.checkpoint import CheckpointTensor
from shardserve.runtime.layers.weights import narrow_features, shard_range

if TYPE_CHECKING:
    from shardserve.runtime.layers.moe import FusedMoE

@dataclass(frozen=True)
class StackedExperts:
    """The shard id of a tensor of every expert: which matrix, and which part of it."""

    kind: str  # "w13" | "w2"
    part: str  # "" (float weight) | "bias" | "blocks" | "scales"


def stacked_expert_weight(name: str) -> tuple[str, StackedExperts] | None:
    """`<prefix>.experts.gate_up_proj_blocks` -> (`<prefix>.experts.w13_blocks`, its StackedExperts); None
    when `name` is no such tensor."""
    stacked = stacked_expert_part(name)
    if stacked is None:
        return None
    kind, part = "w13" if stacked[0] == "gate_up_proj" else "w2", stacked[1]
    return f"{name.rpartition('.')[0]}.{kind}{'_' + part if part else ''}", StackedExperts(kind, part)


def load_stacked(layer: FusedMoE, param: nn.Parameter, loaded: CheckpointTensor, shard: StackedExperts) -> None:
    """Each of this rank's experts from the tensor of all, reading only this rank's features of it: w13's
    gate and up features [start, start + size), w2's inputs [start, start + size) (columns of several
    inputs each for blocks and scales); w2's bias on feature rank 0 only (the all-reduce adds the ranks'
    partial sums; elsewhere it stays zero)."""
    if shard.kind == "w2" and shard.part == "bias" and layer.feature_rank:
        return
    start, size = shard_range(layer.intermediate_size, layer.feature_rank, layer.feature_ranks)
    outputs, inputs = (2, 1) if shard.part == "" else (1, 2)  # float matrices are stored [inputs, outputs]
    for local in range(layer.num_local_experts):
        expert = loaded.narrow(0, layer.first_expert + local, 1)
        if shard.kind == "w13":  # gate j and up j are outputs 2j and 2j + 1
            expert = expert.narrow(outputs, 2 * start, 2 * size)
        elif shard.part != "bias":
            expert = narrow_features(expert, inputs, layer.intermediate_size // expert.shape[inputs], start, size)
        value = expert.load()[0]
        if shard.part == "":
            value = value.t()
        if value.dim() == 3:  # MXFP4 blocks [N, K / 32, 16] -> bytes [N, K / 2]
            value = value.flatten(1)
        if shard.kind == "w13":
            value = torch.cat((value[0::2], value[1::2]))
        with torch.no_grad():
            param.data[local].copy_(value)
