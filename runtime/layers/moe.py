"""Top-k routed experts with gated SiLU MLPs, expert weights stacked per kind and split by tensor rank."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.runtime.checkpoint import CheckpointTensor
from shardserve.runtime.layers.weights import copy_into, shard_range
from shardserve.runtime.parallel_state import get_parallel_state, tensor_parallel_all_reduce

_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


def expert_weight(name: str, kinds: dict[str, str]) -> tuple[str, tuple[int, str]] | None:
    """`<prefix>.experts.<e>.<proj>.weight` -> (`<prefix>.experts.w13` or `.w2`, (e, "w1"|"w3"|"w2")),
    `kinds` naming the checkpoint's gate (w1), up (w3) and down (w2) projections; None otherwise."""
    found = _EXPERT_WEIGHT.search(name)
    if not found or found.group(2) not in kinds:
        return None
    kind = kinds[found.group(2)]
    param = "w2" if kind == "w2" else "w13"
    return f"{name[:found.start()]}.experts.{param}", (int(found.group(1)), kind)


def wrapped_moe_target(inner, name: str, kinds: dict[str, str]):
    """The checkpoint target of a model that wraps a Llama as `inner` and puts FusedMoE in its MLP
    slots: expert weights to the stacked experts, everything else as the Llama maps it."""
    from shardserve.runtime.models.weight_map import WeightTarget

    expert = expert_weight(name, kinds)
    if expert:
        return WeightTarget("inner." + expert[0], expert[1])
    target = inner.checkpoint_target(name)
    if target is None or target.skip:
        return target
    return WeightTarget("inner." + target.param_name, target.shard_id)


class FusedMoE(nn.Module):
    """w13: [num_experts, 2 * intermediate_per_rank, hidden] (gate | up), w2: [num_experts, hidden,
    intermediate_per_rank]. The checkpoint's per-expert w1/w3/w2 load via shard (expert, "w1"|"w3"|"w2")."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate = shard_range(intermediate_size, 0, self.tp_size)[1]
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard: tuple[int, str]) -> None:
        expert, kind = shard
        if kind == "w2":  # [hidden, intermediate]: split the input dimension
            start, size = shard_range(loaded.shape[1], self.tp_rank, self.tp_size)
            copy_into(param.data[expert], loaded.narrow(1, start, size))
            return
        start, size = shard_range(loaded.shape[0], self.tp_rank, self.tp_size)
        offset = 0 if kind == "w1" else self.intermediate
        copy_into(param.data[expert].narrow(0, offset, size), loaded.narrow(0, start, size))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], router_logits: [num_tokens, num_experts]."""
        weights, experts = self.route(router_logits)  # [num_tokens, top_k]
        weights = weights.to(hidden.dtype)
        out = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            token_index, slot = torch.nonzero(experts == expert, as_tuple=True)
            x = hidden[token_index]
            gate, up = F.linear(x, self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert]) * weights[token_index, slot, None]
            out.index_add_(0, token_index, y)
        return tensor_parallel_all_reduce(out)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over all experts, then the top k (renormalized to sum 1 when asked): float32
        weights and expert ids, each [num_tokens, top_k]."""
        weights = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(weights, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts
