"""Mixtral: the Llama decoder with a top-k routed mixture of experts in place of the MLP."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.linear import ReplicatedLinear
from shardserve.runtime.layers.moe import FusedMoE, wrapped_moe_target
from shardserve.runtime.layers.quantization.methods import quantized_layers
from shardserve.runtime.models.llama import ComposedLlama, LlamaForCausalLM, LlamaVariant
from shardserve.runtime.models.weight_map import WeightTarget

_EXPERT_KINDS = {"w1": "w1", "w3": "w3", "w2": "w2"}


class MixtralMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        with quantized_layers(None):  # quantized checkpoints keep the router in float
            self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class MixtralForCausalLM(ComposedLlama):
    """Composes LlamaForCausalLM with MixtralMoE as each layer's MLP; checkpoint names
    `block_sparse_moe.*` map to the layer's `mlp` slot."""

    def __init__(self, model_config: ModelConfig):
        config = model_config.hf_config
        super().__init__(LlamaForCausalLM(model_config, LlamaVariant(has_sliding_window=True),
                                          build_mlp=lambda i: MixtralMoE(config)))

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        return wrapped_moe_target(self.inner, name.replace(".block_sparse_moe.", ".mlp."), _EXPERT_KINDS)
