"""DeepSeek-V2 and V3 (R1): multi-head latent attention (attention/mla.py), dense MLPs in the first
`first_k_dense_replace` layers, then routed experts plus always-on shared experts, routed by
DeepSeek's top-k (V2: softmax, greedy or group-limited; V3: sigmoid with a correction bias, groups
ranked by their top two, noaux_tc), the chosen weights scaled by routed_scaling_factor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.planner.model_spec import is_deepseek_moe_layer
from shardserve.runtime.attention.mla import MLAAttention, mla_rotary
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.moe import FusedMoE, wrapped_moe_target
from shardserve.runtime.models.llama import ComposedLlama, LlamaForCausalLM, LlamaMLP, LlamaVariant
from shardserve.runtime.models.weight_map import WeightTarget

_EXPERT_KINDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # q_proj stays itself (MLA)
ROUTINGS = ("greedy", "group_limited_greedy", "noaux_tc")  # topk_method values served


@dataclass(frozen=True)
class Routing:
    """How a DeepSeek router picks each token's experts (config.json's names)."""

    method: str  # one of ROUTINGS
    top_k: int
    num_groups: int
    top_groups: int
    renormalize: bool
    scaling: float

    @staticmethod
    def of(config, is_v3: bool) -> "Routing":
        method = getattr(config, "topk_method", None) or ("noaux_tc" if is_v3 else "greedy")
        expected = ("noaux_tc",) if is_v3 else ("greedy", "group_limited_greedy")
        if method not in expected:
            raise ValueError(f"topk_method {method!r} is not served for {'DeepSeek-V3' if is_v3 else 'DeepSeek-V2'}; "
                             f"served: {', '.join(expected)}")
        scoring = getattr(config, "scoring_func", None) or ("sigmoid" if is_v3 else "softmax")
        if scoring != ("sigmoid" if is_v3 else "softmax"):
            raise ValueError(f"scoring_func {scoring!r} is not served with topk_method {method!r}")
        return Routing(method, config.num_experts_per_tok, getattr(config, "n_group", None) or 1,
                       getattr(config, "topk_group", None) or 1, bool(getattr(config, "norm_topk_prob", False)),
                       float(getattr(config, "routed_scaling_factor", 1.0) or 1.0))


def route(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [tokens, experts] float32 -> (weights, expert ids), each [tokens, top_k]. Groups of experts
    are ranked (by their best score, or with the bias by the sum of their best two) and only the
    top_groups best groups' experts compete; the weights are the unbiased scores of the chosen."""
    scores = logits.sigmoid() if routing.method == "noaux_tc" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if routing.method != "greedy":
        grouped = choice.view(choice.shape[0], routing.num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if routing.method == "noaux_tc" \
            else grouped.max(dim=-1).values
        kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(routing.top_groups, dim=-1).indices, 1.0)
        choice = choice.masked_fill((kept[:, :, None].expand_as(grouped) == 0).reshape_as(choice), float("-inf"))
    experts = choice.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, experts


class DeepseekRouter(nn.Module):
    """The router (`mlp.gate`): float32 logits from the model-dtype weight, V3's e_score_correction_bias."""

    def __init__(self, config, routing: Routing):
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size), requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if routing.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(config.n_routed_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(F.linear(hidden.float(), self.weight.float()), self.routing, self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    """Routed experts (each rank's part, one all-reduce) plus the shared experts, a Megatron MLP of
    n_shared_experts * moe_intermediate_size features that every token passes through."""

    def __init__(self, config, routing: Routing):
        super().__init__()
        self.gate = DeepseekRouter(config, routing)
        self.experts = FusedMoE(config.n_routed_experts, routing.top_k, config.hidden_size,
                                config.moe_intermediate_size)
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = LlamaMLP(config, config.moe_intermediate_size * shared) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts.run(hidden, *self.gate(hidden))
        return out if self.shared_experts is None else out + self.shared_experts(hidden)


def is_moe_layer(config, index: int) -> bool:
    return bool(config.n_routed_experts) and is_deepseek_moe_layer(
        index, config.first_k_dense_replace or 0, getattr(config, "moe_layer_freq", None) or 1)


class DeepseekForCausalLM(ComposedLlama):
    """The Llama decoder with MLA as every layer's attention and DeepseekMoE in the sparse layers."""

    def __init__(self, model_config: ModelConfig, is_v3: bool):
        config = model_config.hf_config
        routing = Routing.of(config, is_v3)
        rotary_emb = mla_rotary(config, model_config.max_model_len)
        super().__init__(LlamaForCausalLM(
            model_config, LlamaVariant(),
            build_mlp=lambda i: DeepseekMoE(config, routing) if is_moe_layer(config, i) else LlamaMLP(config),
            build_attention=lambda i: MLAAttention(config, rotary_emb), packed_modules=_PACKED))

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        return wrapped_moe_target(self.inner, name, _EXPERT_KINDS)


def deepseek_v2(model_config: ModelConfig) -> DeepseekForCausalLM:
    return DeepseekForCausalLM(model_config, is_v3=False)


def deepseek_v3(model_config: ModelConfig) -> DeepseekForCausalLM:
    return DeepseekForCausalLM(model_config, is_v3=True)
