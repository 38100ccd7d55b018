"""An EAGLE-3 draft head (speculative_config method eagle3; Li et al., "EAGLE-3", 2025): one Llama decoder layer
that drafts the model's next tokens from the model's own hidden states.

    feature of position p:  fc(the hidden states entering three of the model's layers at p, concatenated)
    draft at position p:    the layer over [input_layernorm(embed(x_{p+1})), hidden_norm(h_p)] (its q/k/v read
                            both, 2 x hidden wide), with h_p as the residual; norm gives the logits' input and,
                            before it, h for the next draft position (the head's own output stands in for the
                            model's feature there)
    logits:                 over the head's draft vocabulary; draft id d is the model's token d + d2t[d]

The checkpoint keeps the layer as `midlayer.` (vLLM's copies as `layers.0.`, either under `model.`), `fc`, `norm`,
`lm_head`, `d2t` (with `t2d`, the inverse map, unused here) and an `embed_tokens` of its own or none (the model's
is shared then)."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.runtime.layers.linear import QKVParallelLinear, ReplicatedLinear
from shardserve.runtime.layers.norm import RMSNorm
from shardserve.runtime.models.llama import (LLAMA_PACKED, LlamaAttention, LlamaMLP, LlamaVariant, attention_head_dim,
                                             llama_rotary)
from shardserve.runtime.models.weight_map import WeightTarget, fold_packed


class Eagle3Layer(nn.Module):
    def __init__(self, config, max_position: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.hidden_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(config, LlamaVariant(), llama_rotary(config, LlamaVariant(), max_position), None)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        self.self_attn.qkv_proj = QKVParallelLinear(2 * hidden, attention_head_dim(config), heads, kv_heads,
                                                    bias=bool(getattr(config, "attention_bias", False)))
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = LlamaMLP(config)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor):
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """`tensor_names`: the checkpoint's, which say whether it has an embedding and a d2t map of its own."""

    def __init__(self, model_config: ModelConfig, tensor_names: set[str]):
        super().__init__()
        config = model_config.hf_config
        hidden = config.hidden_size
        names = {_canonical(name) for name in tensor_names}
        self.fc = ReplicatedLinear(3 * (getattr(config, "target_hidden_size", None) or hidden), hidden, bias=False)
        # the model's embedding is shared (attached by share_embedding) when the checkpoint has none
        self.has_embedding = "embed_tokens.weight" in names
        self.embed_tokens: nn.Module | None = \
            VocabParallelEmbedding(config.vocab_size, hidden) if self.has_embedding else None
        self.midlayer = Eagle3Layer(config, model_config.max_model_len)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False) \
            if "d2t" in names else None
        if self.d2t is None and self.draft_vocab_size != config.vocab_size:
            raise ValueError(f"the EAGLE-3 head drafts over {self.draft_vocab_size} ids, the model's vocabulary has "
                             f"{config.vocab_size}, and its checkpoint has no d2t to map them")
        self.layer_range = (0, 1)
        self.packed_modules = LLAMA_PACKED

    def share_embedding(self, model: nn.Module) -> None:
        """The model's token embedding, when the checkpoint has none of its own."""
        if not self.has_embedding:
            embedding = next(m for m in model.modules() if type(m) is VocabParallelEmbedding)
            if embedding.weight.shape[1] != self.norm.weight.shape[0]:
                raise ValueError(f"the EAGLE-3 head is {self.norm.weight.shape[0]} wide, the model's embedding "
                                 f"{embedding.weight.shape[1]}, and its checkpoint has no embed_tokens of its own")
            self.embed_tokens = embedding

    def combine(self, captured: list[torch.Tensor]) -> torch.Tensor:
        """The features of a forward's positions from the hidden states captured there: [num_tokens, hidden]."""
        return self.fc(torch.cat(captured, dim=-1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits' input, the next draft position's feature) for each token and its feature."""
        assert self.embed_tokens is not None  # its own, or the model's (share_embedding)
        x, residual = self.midlayer(positions, self.embed_tokens(input_ids), hidden)
        return self.norm(x, residual)

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row, as the model's token ids."""
        ids = self.lm_head.compute_logits(normed).argmax(dim=-1)
        return ids if self.d2t is None else ids + self.d2t[ids]

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        name = _canonical(name)
        if name == "t2d" or "rotary_emb.inv_freq" in name:
            return None
        return WeightTarget(name) if "." not in name else fold_packed(name, self.packed_modules)


def _canonical(name: str) -> str:
    """A checkpoint name as this module names it: `model.` dropped, vLLM's `layers.0.` as `midlayer.`."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
