"""DeepSeek-V3/R1's multi-token-prediction layer (speculative_config method mtp): the checkpoint's layer after the
last, `model.layers.{L}.`, drafting the model's next tokens from its final hidden states (DeepSeek-V3 technical
report, section 2.2; served as vLLM's DeepSeek MTP serves it).

    draft at position p:  eh_proj([enorm(embed(x_{p+1})), hnorm(h_p)]) through one decoder layer (MLA, and the
                          routed and shared experts of a sparse layer), plus its residual: the next draft
                          position's feature; shared_head.norm and shared_head.head give the logits
    h_p:                  the model's final (normed) hidden state at p, or the layer's own output for a draft

The embedding of position 0's token is zeroed, as the layer was trained. The model's embedding is shared (the
checkpoint's copy under the layer is the same table)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from shardserve.runtime.attention.mla import MLAAttention, mla_rotary
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.runtime.layers.linear import ReplicatedLinear
from shardserve.runtime.layers.moe import expert_weight
from shardserve.runtime.layers.norm import RMSNorm
from shardserve.runtime.layers.quantization.methods import quantized_layers
from shardserve.runtime.models.deepseek import _EXPERT_KINDS, _PACKED, DeepseekMoE, Routing, is_moe_layer
from shardserve.runtime.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaVariant
from shardserve.runtime.models.weight_map import WeightTarget, fold_packed


class SharedHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size)


class MTPLayer(LlamaDecoderLayer):
    """The decoder layer (attention, MLP and their norms, named as the model's layers are) with the MTP parts."""

    def __init__(self, config, index: int, max_position: int):
        routing = Routing.of(config, is_v3=True)
        mlp = DeepseekMoE(config, routing) if is_moe_layer(config, index) else LlamaMLP(config)
        super().__init__(config, LlamaVariant(), None, mlp, index, MLAAttention(config, mla_rotary(config, max_position)))
        hidden = config.hidden_size
        self.enorm, self.hnorm = RMSNorm(hidden, config.rms_norm_eps), RMSNorm(hidden, config.rms_norm_eps)
        with quantized_layers(None):  # float in the released checkpoints, as vLLM loads it
            self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(config)


class DeepseekMTP(nn.Module):
    """Parameters named as the checkpoint's (`model.layers.{L}.`), so the model's folder loads them as they are."""

    def __init__(self, model_config: ModelConfig):
        super().__init__()
        config = model_config.hf_config
        self.index = config.num_hidden_layers
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(self.index): MTPLayer(config, self.index, model_config.max_model_len)})
        self.embed_tokens: nn.Module | None = None  # the model's (share_embedding)
        self.layer_range = (self.index, self.index + 1)

    @property
    def mtp_layer(self) -> MTPLayer:
        return cast(MTPLayer, cast(nn.ModuleDict, self.model.layers)[str(self.index)])

    def share_embedding(self, model: nn.Module) -> None:
        self.embed_tokens = next(m for m in model.modules() if type(m) is VocabParallelEmbedding)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits' input, the next draft position's feature) for each token and its feature."""
        assert self.embed_tokens is not None  # the model's (share_embedding)
        layer = self.mtp_layer
        embeds = self.embed_tokens(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))
        x, residual = layer(positions, x, None)
        prenorm = x + residual
        return layer.shared_head.norm(prenorm), prenorm

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        return self.mtp_layer.shared_head.head.compute_logits(normed).argmax(dim=-1)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        prefix = f"model.layers.{self.index}."
        if not name.startswith(prefix) or name == prefix + "embed_tokens.weight":
            return None  # the model's own tensors, and the layer's copy of the embedding
        expert = expert_weight(name, _EXPERT_KINDS)
        return WeightTarget(*expert) if expert else fold_packed(name, _PACKED)
