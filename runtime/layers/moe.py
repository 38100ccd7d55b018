"""Top-k routed experts with gated MLPs (SiLU, or gpt-oss's biased swigluoai), expert weights stacked per
kind (float, or quantized as the checkpoint ships them); across tensor ranks each expert is split
(Megatron) or, with expert parallel, whole experts are dealt out to the ranks."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.runtime.worker.checkpoint import CheckpointTensor
from shardserve.runtime.layers.activation import GatedActivation
from shardserve.runtime.layers.moe_stacked import StackedExperts, load_stacked, stacked_expert_weight
from shardserve.runtime.layers.quantization.methods import current_moe_method
from shardserve.runtime.layers.weights import FLOAT_WEIGHT, PackedDims, load_features, shard_range
from shardserve.runtime.distributed.parallel_state import get_parallel_state, tensor_parallel_all_reduce

_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.(\w+)$")


def expert_weight(name: str, kinds: dict[str, str]) -> tuple[str, tuple[int, str]] | None:
    """`<prefix>.experts.<e>.<proj>.<leaf>` -> (`<prefix>.experts.w13` or `.w2`, (e, "w1"|"w3"|"w2")),
    `kinds` naming the checkpoint's gate (w1), up (w3) and down (w2) projections; None otherwise. A leaf
    other than `weight` (qweight, scales, weight_scale_inv, ...) goes to `w13_<leaf>` or `w2_<leaf>`."""
    found = _EXPERT_TENSOR.search(name)
    if not found or found.group(2) not in kinds:
        return None
    kind, leaf = kinds[found.group(2)], found.group(3)
    param = ("w2" if kind == "w2" else "w13") + ("" if leaf == "weight" else f"_{leaf}")
    return f"{name[:found.start()]}.experts.{param}", (int(found.group(1)), kind)


def wrapped_moe_target(inner, name: str, kinds: dict[str, str]):
    """The checkpoint target of a model that wraps a Llama as `inner` and puts FusedMoE in its MLP
    slots: expert weights (one tensor per expert, or gpt-oss's of every expert) to the stacked experts,
    everything else as the Llama maps it."""
    from shardserve.runtime.models.weight_map import WeightTarget

    expert = expert_weight(name, kinds) or stacked_expert_weight(name)
    if expert:
        return WeightTarget("inner." + expert[0], expert[1])
    target = inner.checkpoint_target(name)
    if target is None or target.skip:
        return target
    return WeightTarget("inner." + target.param_name, target.shard_id)


class FusedMoE(nn.Module):
    """w13: [local_experts, 2 * intermediate_per_rank, hidden] (gate | up), w2: [local_experts, hidden,
    intermediate_per_rank]; built inside `quantized_layers(config)`, the quantized method's parameters in
    their place (fp8_moe.py, packed_int_moe.py), `packed_dims` saying where each keeps its features. The
    checkpoint's per-expert w1/w3/w2 tensors load via shard (expert, "w1"|"w3"|"w2").

        tensor parallel:  every rank holds all experts, 1/tp of each one's intermediate features
        expert parallel:  rank r holds experts [r * E / tp, (r + 1) * E / tp) whole
    Either way a rank's output is a partial sum over its share, and one all-reduce completes it."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, activation: GatedActivation = GatedActivation(), has_bias: bool = False):
        super().__init__()
        state = get_parallel_state()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.activation = activation
        if state.enable_expert_parallel:
            self.first_expert, self.num_local_experts = shard_range(num_experts, state.tp_rank, state.tp_size)
            self.feature_rank, self.feature_ranks = 0, 1  # experts whole
        else:
            self.first_expert, self.num_local_experts = 0, num_experts
            self.feature_rank, self.feature_ranks = state.tp_rank, state.tp_size
        self.intermediate_size = intermediate_size
        self.intermediate = shard_range(intermediate_size, 0, self.feature_ranks)[1]
        self.quant_method = current_moe_method()  # None: float experts
        self.packed_dims: dict[str, PackedDims] = {}
        self.w13_bias: nn.Parameter | None = None  # [local_experts, 2 * intermediate_per_rank] (gate | up)
        self.w2_bias: nn.Parameter | None = None  # [local_experts, hidden]: zeros but on feature rank 0
        if has_bias:  # gpt-oss; float whatever the experts' format
            self.w13_bias = nn.Parameter(torch.zeros(self.num_local_experts, 2 * self.intermediate), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(self.num_local_experts, hidden_size), requires_grad=False)
        if self.quant_method is not None:
            self.quant_method.create_weights(self, self.num_local_experts, hidden_size, self.intermediate)
            return
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.intermediate),
                               requires_grad=False)
        self.packed_dims.update(w13=FLOAT_WEIGHT, w2=FLOAT_WEIGHT)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard: tuple[int, str] | StackedExperts) -> None:
        """One expert's w1, w3 or w2 tensor (weight, or a quantized part: scales, zeros, ...): this rank's
        features of it into the expert's slice of `param`, laid out per expert as a linear layer's; or a
        tensor of every expert (gpt-oss, moe_stacked.py)."""
        if isinstance(shard, StackedExperts):
            return load_stacked(self, param, loaded, shard)
        expert, kind = shard
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert: never read
        dims = self.packed_dims[next(n for n, p in self._parameters.items() if p is param)]
        start, size = shard_range(self.intermediate_size, self.feature_rank, self.feature_ranks)
        if kind == "w2":  # [hidden, intermediate]: split the input features
            load_features(param.data[local], loaded, dims, in_range=(start, size))
        else:  # [intermediate, hidden] into the gate or the up half of w13's outputs
            offset = 0 if kind == "w1" else self.intermediate
            load_features(param.data[local], loaded, dims, out_range=(offset, start, size))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], router_logits: [num_tokens, num_experts]. On CUDA the Triton
        kernel (no host sync: capturable); elsewhere the torch loop, which is also its reference."""
        weights, experts = self.route(router_logits)  # [num_tokens, top_k]
        return self.run(hidden, weights, experts)

    def run(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts over tokens already routed (weights and expert ids, [num_tokens, top_k]): forward's
        second half, called directly by a model with its own routing (DeepSeek's grouped top-k)."""
        out = self.kernels(hidden, weights, experts) if hidden.is_cuda else self.forward_loop(hidden, weights, experts)
        return tensor_parallel_all_reduce(out)

    def kernels(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
        """This rank's share through the Triton kernels (run's CUDA path; the interpreter runs it on CPU):
        float experts, or the quantized method's matrices, with the biases and the activation; `blocks`:
        (BLOCK_M, BLOCK_N, BLOCK_K) instead of the kernels' own choice."""
        from shardserve.runtime.layers.triton_moe import ExpertOps, fused_moe  # triton is needed only on CUDA

        ops = ExpertOps(self.activation, self.w13_bias, self.w2_bias)
        if self.quant_method is None:
            return fused_moe(hidden, self.w13, self.w2, weights, experts, self.first_expert, blocks, ops)
        from shardserve.runtime.layers.quantization.triton_quant_moe import quantized_fused_moe

        w13, w2 = self.quant_method.expert_matrices(self)
        return quantized_fused_moe(hidden, w13, w2, weights, experts, self.first_expert, blocks, ops)

    def forward_loop(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """One pass per chosen expert of this rank: gather its tokens, gated MLP, scale, scatter-add.
        NOTE: lists the chosen experts on the host (a sync), so it is the CPU path, not a graph's."""
        weights = weights.to(hidden.dtype)
        out = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            local = expert - self.first_expert
            if not 0 <= local < self.num_local_experts:
                continue  # another rank's expert adds its part there
            token_index, slot = torch.nonzero(experts == expert, as_tuple=True)
            x = hidden[token_index]
            w13, w2 = self.expert_weights(local)
            b13 = None if self.w13_bias is None else self.w13_bias[local].to(x.dtype)
            b2 = None if self.w2_bias is None else self.w2_bias[local].to(x.dtype)
            gate, up = F.linear(x, w13.to(x.dtype), b13).chunk(2, dim=-1)
            y = F.linear(self.activation(gate, up), w2.to(x.dtype), b2) * weights[token_index, slot, None]
            out.index_add_(0, token_index, y)
        return out

    def expert_weights(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 [2 * intermediate_per_rank, hidden] and w2 [hidden, intermediate_per_rank] of this rank's
        expert `local` as float matrices (quantized experts dequantized)."""
        if self.quant_method is None:
            return self.w13[local], self.w2[local]
        return self.quant_method.expert_weights(self, local)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over all experts, then the top k (renormalized to sum 1 when asked): float32
        weights and expert ids, each [num_tokens, top_k]."""
        weights = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(weights, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts
