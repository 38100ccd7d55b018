"""GPT-2: learned positions, LayerNorm, fused c_attn, checkpoint weights stored [in, out] (Conv1D)."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.activation import get_activation
from shardserve.runtime.layers.embedding import ParallelLMHead, ReplicatedEmbedding, VocabParallelEmbedding
from shardserve.runtime.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shardserve.runtime.layers.norm import LayerNorm
from shardserve.runtime.models.weight_map import WeightTarget, tied_head_target
from shardserve.runtime.distributed.parallel_state import get_parallel_state
from shardserve.runtime.worker.pipeline import IntermediateTensors, make_layers

_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        heads, hidden = config.n_head, config.n_embd
        head_dim = hidden // heads
        self.c_attn = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        self.num_heads = self.c_attn.num_heads
        self.size = self.num_heads * head_dim
        scale = head_dim**-0.5 if config.scale_attn_weights else 1.0
        self.attn = Attention(self.num_heads, head_dim, scale, self.num_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).split([self.size] * 3, dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = ColumnParallelLinear(config.n_embd, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, config.n_embd, bias=True)
        self.act = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        state = get_parallel_state()
        self.is_first_stage, self.is_last_stage = state.is_first_stage, state.is_last_stage
        if self.is_first_stage:
            self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd)
            self.wpe = ReplicatedEmbedding(config.n_positions, config.n_embd)
        self.h, self.start_layer, self.end_layer = make_layers(config.n_layer, lambda i: GPT2Block(config))
        if self.is_last_stage:
            self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None = None):
        if self.is_first_stage:
            hidden = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, n_embd]
        else:
            assert intermediate is not None  # a later stage receives the previous one's hand-off
            hidden = intermediate.hidden_states
        for block in self.h[self.start_layer:self.end_layer]:
            hidden = block(hidden)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, None)
        return self.ln_f(hidden)


class GPT2LMHeadModel(nn.Module):
    supports_cuda_graphs = True  # the forward reads no tensor value on the host

    def __init__(self, model_config: ModelConfig):
        super().__init__()
        config = model_config.hf_config
        if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
            raise ValueError("GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        self.transformer = GPT2Model(config)
        self.layer_range = (self.transformer.start_layer, self.transformer.end_layer)
        if get_parallel_state().is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.n_embd)
            if self.transformer.is_first_stage:
                self.lm_head.tie_to(self.transformer.wte)  # GPT-2 always ties

    def forward(self, input_ids, positions, intermediate=None):
        return self.transformer(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if name.endswith(_BUFFERS):
            return None
        if not name.startswith("transformer.") and name != "lm_head.weight":  # OpenAI's originals: no prefix
            name = "transformer." + name
        tied = tied_head_target(name, "transformer.wte.weight", self.transformer.is_first_stage)
        return tied or WeightTarget(name, transpose=name.endswith(_CONV1D))
