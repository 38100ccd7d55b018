"""Qwen2-MoE and Qwen3-MoE: the Llama decoder with routed experts in the sparse layers (and Qwen2-MoE's
sigmoid-gated shared expert); dense layers keep the Llama MLP."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.planner.model_spec import is_qwen_moe_layer
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.linear import ReplicatedLinear
from shardserve.runtime.layers.moe import FusedMoE, wrapped_moe_target
from shardserve.runtime.layers.quantization.methods import quantized_layers
from shardserve.runtime.models.llama import ComposedLlama, LlamaForCausalLM, LlamaMLP, LlamaVariant
from shardserve.runtime.models.weight_map import WeightTarget

_EXPERT_KINDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class QwenSparseMoeBlock(nn.Module):
    """Routed experts, plus (Qwen2-MoE) one shared expert every token passes through, scaled by
    sigmoid(shared_expert_gate(x)). NOTE: experts and shared expert each all-reduce their partial
    sums; one reduction of the sum would save a collective per layer, at the cost of a switch in
    FusedMoE and RowParallelLinear."""

    def __init__(self, config, has_shared_expert: bool):
        super().__init__()
        with quantized_layers(None):  # quantized checkpoints keep the routers in float
            self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size,
                                renormalize=bool(getattr(config, "norm_topk_prob", False)))
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if has_shared_expert:
            self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)
            with quantized_layers(None):
                self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is None:
            return out
        assert self.shared_expert_gate is not None  # made with the shared expert
        return out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)


def is_sparse_layer(config, index: int) -> bool:
    return config.num_experts > 0 and is_qwen_moe_layer(
        index, getattr(config, "decoder_sparse_step", 1) or 1, getattr(config, "mlp_only_layers", None) or ())


class QwenMoeForCausalLM(ComposedLlama):
    """Composes LlamaForCausalLM with a QwenSparseMoeBlock as the MLP of each sparse layer."""

    def __init__(self, model_config: ModelConfig, variant: LlamaVariant, has_shared_expert: bool):
        config = model_config.hf_config

        def build_mlp(index: int) -> nn.Module:
            if is_sparse_layer(config, index):
                return QwenSparseMoeBlock(config, has_shared_expert)
            return LlamaMLP(config)

        super().__init__(LlamaForCausalLM(model_config, variant, build_mlp=build_mlp))

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        return wrapped_moe_target(self.inner, name, _EXPERT_KINDS)


def qwen2_moe(model_config: ModelConfig) -> QwenMoeForCausalLM:
    qkv_bias = bool(getattr(model_config.hf_config, "qkv_bias", True))
    return QwenMoeForCausalLM(model_config, LlamaVariant(qkv_bias=qkv_bias, has_sliding_window=True), has_shared_expert=True)


def qwen3_moe(model_config: ModelConfig) -> QwenMoeForCausalLM:
    return QwenMoeForCausalLM(model_config, LlamaVariant(qk_norm=True, has_sliding_window=True), has_shared_expert=False)
