"""OPT: learned positions offset by 2, LayerNorm before or after each block, optional in/out projections."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.activation import get_activation
from shardserve.runtime.layers.embedding import ParallelLMHead, ReplicatedEmbedding, VocabParallelEmbedding
from shardserve.runtime.layers.linear import (ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                              RowParallelLinear)
from shardserve.runtime.layers.norm import LayerNorm
from shardserve.runtime.models.weight_map import WeightTarget, fold_packed, tied_head_target
from shardserve.runtime.distributed.parallel_state import get_parallel_state
from shardserve.runtime.worker.pipeline import IntermediateTensors, make_layers

POSITION_OFFSET = 2  # OPT's position table reserves its first two rows
OPT_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


class OPTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        heads, hidden = config.num_attention_heads, config.hidden_size
        head_dim = hidden // heads
        bias = getattr(config, "enable_bias", True)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias=bias)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        self.size = self.qkv_proj.num_heads * head_dim
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.size] * 3, dim=-1)
        return self.out_proj(self.attn(q, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "enable_bias", True)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        if not affine:
            raise ValueError("OPT with layer_norm_elementwise_affine=False is not supported")
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = LayerNorm(config.hidden_size, bias=bias)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_dim, bias=bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias=bias)
        self.final_layer_norm = LayerNorm(config.hidden_size, bias=bias)
        self.act = get_activation(config.activation_function)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self._residual(hidden, self.self_attn_layer_norm, self.self_attn)
        return self._residual(hidden, self.final_layer_norm, lambda x: self.fc2(self.act(self.fc1(x))))

    def _residual(self, hidden, norm, block):
        if self.pre_norm:
            return hidden + block(norm(hidden))
        return norm(hidden + block(hidden))


class OPTDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        state = get_parallel_state()
        self.is_first_stage, self.is_last_stage = state.is_first_stage, state.is_last_stage
        embed_dim = config.word_embed_proj_dim
        has_projection = embed_dim != config.hidden_size
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim)
            self.embed_positions = ReplicatedEmbedding(config.max_position_embeddings + POSITION_OFFSET,
                                                       config.hidden_size)
            self.project_in = ReplicatedLinear(embed_dim, config.hidden_size, bias=False) if has_projection else None
        self.layers, self.start_layer, self.end_layer = make_layers(config.num_hidden_layers,
                                                                    lambda i: OPTDecoderLayer(config))
        if self.is_last_stage:
            has_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
            self.final_layer_norm = LayerNorm(config.hidden_size) if has_final_norm else None
            self.project_out = ReplicatedLinear(config.hidden_size, embed_dim, bias=False) if has_projection else None

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None = None):
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
            if self.project_in is not None:
                hidden = self.project_in(hidden)
            hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        else:
            assert intermediate is not None  # a later stage receives the previous one's hand-off
            hidden = intermediate.hidden_states
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden = layer(hidden)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, None)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        return hidden if self.project_out is None else self.project_out(hidden)


class OPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    supports_cuda_graphs = True  # the forward reads no tensor value on the host

    def __init__(self, model_config: ModelConfig):
        super().__init__()
        config = model_config.hf_config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.model = OPTModel(config)
        decoder = self.model.decoder
        self.layer_range = (decoder.start_layer, decoder.end_layer)
        if get_parallel_state().is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim)
            if self.tie_word_embeddings and decoder.is_first_stage:
                self.lm_head.tie_to(decoder.embed_tokens)

    def forward(self, input_ids, positions, intermediate=None):
        return self.model.decoder(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if name.startswith("decoder."):  # some OPT checkpoints drop the "model." prefix
            name = "model." + name
        if self.tie_word_embeddings:
            return tied_head_target(name, "model.decoder.embed_tokens.weight",
                                    self.model.decoder.is_first_stage) or fold_packed(name, OPT_PACKED)
        return fold_packed(name, OPT_PACKED)
