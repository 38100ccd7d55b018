"""Gemma 2 and Gemma 3 (text): (1 + weight) RMSNorms around attention and MLP, scaled embeddings, GeGLU,
soft-capped attention and final logits, and local (sliding window, own rope base) / global layers."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.planner import hf_config
from shardserve.planner.served import ARCHITECTURES
from shardserve.planner.tensors import language_model_name
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.attention.torch_backend import soft_cap
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.activation import get_activation
from shardserve.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shardserve.runtime.layers.rotary import RotaryEmbedding, rope_parameters
from shardserve.runtime.models.llama import LLAMA_PACKED, LlamaAttention, run_stage
from shardserve.runtime.models.weight_map import WeightTarget, fold_packed, tied_head_target
from shardserve.runtime.distributed.parallel_state import get_parallel_state
from shardserve.runtime.worker.pipeline import IntermediateTensors, make_layers


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32 and cast back at the end, as transformers' Gemma does
    (Llama's RMSNorm casts before the weight). forward(x, residual) adds the residual first and
    returns (normed, new_residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        out = (normed * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)


def gemma_layer_types(config) -> tuple[str, ...]:
    """Each layer's kind ("sliding_attention" or "full_attention") under every spelling the config has."""
    values = {key: getattr(config, key, None) for key in
              ("layer_types", "sliding_window_pattern", "num_hidden_layers", "model_type")}
    values["sliding_window_pattern"] = values["sliding_window_pattern"] or getattr(
        config, "_sliding_window_pattern", None)
    types = hf_config.layer_types(values, family=config.model_type)
    return types or ("full_attention",) * config.num_hidden_layers


class GemmaAttention(LlamaAttention):
    """Llama's forward over Gemma's pieces: (1 + weight) q/k norms, the query pre-attention scalar, a
    window on local layers, soft-capped scores."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_type: str, has_qk_norm: bool):
        nn.Module.__init__(self)  # NOTE: not LlamaAttention's: the same attributes, built differently
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.has_qk_norm = has_qk_norm
        if has_qk_norm:  # Gemma 3
            self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # shared by every layer of this type
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = Attention(self.num_heads, head_dim, config.query_pre_attn_scalar ** -0.5, self.num_kv_heads,
                              window, getattr(config, "attn_logit_softcapping", None))


class GemmaMLP(nn.Module):
    """GeGLU: down(act(gate) * up) with the config's activation (gelu_pytorch_tanh)."""

    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = get_activation(getattr(config, "hidden_activation", None) or config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    """h += post_attn_norm(attn(input_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h))), with the
    residual stream carried beside the hidden states (stream = hidden + residual) so each add is
    folded into the next norm."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_type: str, has_qk_norm: bool):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = GemmaAttention(config, rotary_emb, layer_type, has_qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(self, config, max_position: int, has_qk_norm: bool):
        super().__init__()
        state = get_parallel_state()
        self.is_first_stage, self.is_last_stage = state.is_first_stage, state.is_last_stage
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            # NOTE: sqrt(hidden_size) rounded to the model dtype first, as transformers multiplies it
            self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5).to(
                self.embed_tokens.weight.dtype), persistent=False)
        types = gemma_layer_types(config)
        # NOTE: one cos/sin table per layer type, not per layer: at 128k positions a table is 64+ MiB
        rotary = {kind: RotaryEmbedding(config.head_dim, max_position, rope_parameters(config, kind))
                  for kind in sorted(set(types))}
        self.layers, self.start_layer, self.end_layer = make_layers(
            config.num_hidden_layers, lambda i: GemmaDecoderLayer(config, rotary[types[i]], types[i], has_qk_norm))
        if self.is_last_stage:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None = None):
        embedded = self.embed_tokens(input_ids) * self.embed_scale if self.is_first_stage else None
        return run_stage(self, embedded, positions, intermediate)


class GemmaForCausalLM(nn.Module):
    """Gemma2ForCausalLM (has_qk_norm=False), Gemma3ForCausalLM and the language model of
    Gemma3ForConditionalGeneration (True); the LM head is tied unless config.json says otherwise."""

    packed_modules = LLAMA_PACKED
    supports_cuda_graphs = True  # the forward reads no tensor value on the host

    def __init__(self, model_config: ModelConfig, has_qk_norm: bool):
        super().__init__()
        config = model_config.hf_config
        self.has_text_config = ARCHITECTURES[model_config.architecture].has_text_config
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported: "
                             "the runtime generates with causal attention")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.model = GemmaModel(config, model_config.max_model_len, has_qk_norm)
        self.layer_range = (self.model.start_layer, self.model.end_layer)
        if get_parallel_state().is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids, positions, intermediate=None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head.compute_logits(hidden), self.final_logit_softcapping)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if self.has_text_config:  # Gemma 3 4b+: the language model of a multimodal checkpoint
            text_name = language_model_name(name)
            if text_name is None:
                return WeightTarget("", skip=True)  # the vision tower and its projector
            name = text_name
        if self.tie_word_embeddings:
            return tied_head_target(name, "model.embed_tokens.weight", self.model.is_first_stage) or fold_packed(
                name, self.packed_modules)
        return fold_packed(name, self.packed_modules)


def gemma2(model_config: ModelConfig) -> GemmaForCausalLM:
    return GemmaForCausalLM(model_config, has_qk_norm=False)


def gemma3(model_config: ModelConfig) -> GemmaForCausalLM:
    return GemmaForCausalLM(model_config, has_qk_norm=True)
