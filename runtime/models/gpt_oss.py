"""gpt-oss (20b, 120b): the Llama decoder with biased attention and a learned softmax sink per head,
128-token sliding windows on alternate layers (config.json's layer_types), YaRN, and every layer's MLP
routed experts: a biased router's top k (softmax over the chosen), biased gate | up and down projections
and the clamped swigluoai activation, the experts in MXFP4 as released (or float)."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.activation import GatedActivation
from shardserve.runtime.layers.linear import ReplicatedLinear
from shardserve.runtime.layers.moe import FusedMoE, wrapped_moe_target
from shardserve.runtime.layers.quantization.methods import quantized_layers
from shardserve.runtime.models.llama import ComposedLlama, LlamaForCausalLM, LlamaVariant
from shardserve.runtime.models.weight_map import WeightTarget

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's swigluoai constants, where the config has no such fields


class GptOssMoE(nn.Module):
    """`mlp.router` (float, with a bias) and `mlp.experts`; the router's top-k logits are softmaxed, which
    is FusedMoE's renormalized top k of the softmax over all."""

    def __init__(self, config):
        super().__init__()
        with quantized_layers(None):
            self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        # NOTE: transformers 5.17 (the GPU image's) has neither field: its experts fix them at 1.702 and 7.0
        alpha, limit = getattr(config, "swiglu_alpha", SWIGLU_ALPHA), getattr(config, "swiglu_limit", SWIGLU_LIMIT)
        activation = GatedActivation("swigluoai", float(alpha), float(limit))
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=True, activation=activation, has_bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router(hidden))


class GptOssForCausalLM(ComposedLlama):
    # NOTE: transformers keeps gpt-oss's norms in float32 and rounds after the weight; the Llama norm here
    # rounds before it: the same in float32, one rounding apart in bfloat16
    def __init__(self, model_config: ModelConfig):
        config = model_config.hf_config
        variant = LlamaVariant(has_sliding_window=True, has_sinks=True)
        super().__init__(LlamaForCausalLM(model_config, variant, build_mlp=lambda i: GptOssMoE(config)))

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        return wrapped_moe_target(self.inner, name, {})  # the experts' tensors hold every expert
