"""Qwen3.5's and Qwen3-Next's multi-token-prediction layer (speculative_config method mtp): the checkpoint's `mtp.`
tensors, drafting the model's next tokens from its final hidden states (served as vLLM's Qwen3-Next MTP serves it).

    draft at position p:  fc([pre_fc_norm_embedding(embed(x_{p+1})), pre_fc_norm_hidden(h_p)]) through one gated
                          full-attention decoder layer (its MLP the model's kind: dense, or routed experts and the
                          gated shared one), then mtp.norm: the logits' input (the model's LM head) and the next
                          draft position's feature
    h_p:                  the model's final (normed) hidden state at p, or the layer's own output for a draft

Every norm is the zero-centred (1 + weight) kind; the embedding and the LM head are the model's."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.embedding import VocabParallelEmbedding
from shardserve.runtime.layers.linear import ReplicatedLinear
from shardserve.runtime.layers.moe import expert_weight
from shardserve.runtime.models.gemma import GemmaRMSNorm
from shardserve.runtime.models.qwen3_5 import (_EXPERT_KINDS, _PACKED, GatedAttention, Qwen3_5DecoderLayer,
                                               Qwen3_5Variant, mlp_builder, qwen3_5_rotary)
from shardserve.runtime.models.weight_map import WeightTarget, fold_packed

VARIANTS = {"Qwen3_5ForCausalLM": Qwen3_5Variant(), "Qwen3_5ForConditionalGeneration": Qwen3_5Variant(),
            "Qwen3_5MoeForCausalLM": Qwen3_5Variant(has_experts=True, renormalizes_top_k=True),
            "Qwen3_5MoeForConditionalGeneration": Qwen3_5Variant(has_experts=True, renormalizes_top_k=True),
            "Qwen3NextForCausalLM": Qwen3_5Variant(has_experts=True)}


class MTPBlock(nn.Module):
    def __init__(self, model_config: ModelConfig):
        super().__init__()
        config = model_config.hf_config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = GemmaRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(hidden, eps)
        attention = GatedAttention(config, qwen3_5_rotary(config, model_config.max_model_len))
        mlp = mlp_builder(config, VARIANTS[model_config.architecture])(0)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, attention, mlp, is_linear=False)])
        self.norm = GemmaRMSNorm(hidden, eps)


class Qwen3_5MTP(nn.Module):
    """Parameters named as the checkpoint's (`mtp.`), so the model's folder loads them as they are."""

    def __init__(self, model_config: ModelConfig):
        super().__init__()
        self.mtp = MTPBlock(model_config)
        self.embed_tokens: nn.Module | None = None  # the model's (share_embedding)
        self.lm_head: nn.Module | None = None
        self.layer_range = (0, 1)

    def share_embedding(self, model: nn.Module) -> None:
        """The model's embedding and LM head."""
        self.embed_tokens = next(m for m in model.modules() if type(m) is VocabParallelEmbedding)
        self.lm_head = model.lm_head  # type: ignore[assignment]  # the last (only) stage has it

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits' input, the next draft position's feature: the same normed states) for each token."""
        assert self.embed_tokens is not None  # the model's (share_embedding)
        mtp = self.mtp
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(self.embed_tokens(input_ids)), mtp.pre_fc_norm_hidden(hidden)],
                             dim=-1))
        x, residual = mtp.layers[0](positions, x, None)
        out, _ = mtp.norm(x, residual)
        return out, out

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None  # the model's (share_embedding)
        return self.lm_head.compute_logits(normed).argmax(dim=-1)  # type: ignore[operator]

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if not name.startswith("mtp."):
            return None  # the model's own tensors
        expert = expert_weight(name, _EXPERT_KINDS)
        return WeightTarget(*expert) if expert else fold_packed(name, _PACKED)
