"""Qwen3.5 and Qwen3-Next (dense and MoE, text): hybrid decoders of Gated DeltaNet layers
(layers/gated_delta_net.py) and gated full attention, zero-centred (1 + weight) RMSNorms, partial rotary.

    layer_types:  linear_attention  linear_attention  linear_attention  full_attention  ...
    mixer:        linear_attn       linear_attn       linear_attn       self_attn
    MLP:          Llama's (Qwen3.5), or routed experts + a sigmoid-gated shared expert (MoE; Qwen3-Next's
                  sparse layers by decoder_sparse_step and mlp_only_layers)
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from shardserve.planner.served import ARCHITECTURES
from shardserve.planner.tensors import language_model_name
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.distributed.parallel_state import get_parallel_state
from shardserve.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.runtime.layers.gated_delta_net import FusedGatedDeltaNet, GatedDeltaNet
from shardserve.runtime.layers.linear import QKVParallelLinear, RowParallelLinear
from shardserve.runtime.layers.moe import expert_weight
from shardserve.runtime.layers.rotary import RotaryEmbedding, rope_parameters
from shardserve.runtime.models.gemma import GemmaRMSNorm
from shardserve.runtime.models.llama import LLAMA_PACKED, LlamaMLP, attention_head_dim, run_stage
from shardserve.runtime.models.qwen_moe import QwenSparseMoeBlock, is_sparse_layer
from shardserve.runtime.models.weight_map import WeightTarget, fold_packed, tied_head_target
from shardserve.runtime.worker.pipeline import IntermediateTensors, make_layers

logger = logging.getLogger(__name__)

_EXPERT_KINDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PACKED = {**LLAMA_PACKED, "in_proj_z": ("in_proj_zba", 0), "in_proj_b": ("in_proj_zba", 1),
           "in_proj_a": ("in_proj_zba", 2)}


@dataclass(frozen=True)
class Qwen3_5Variant:
    """What distinguishes the family members; everything else comes from config.json."""

    has_experts: bool = False  # routed experts in the sparse layers
    renormalizes_top_k: bool | None = None  # None: config.norm_topk_prob (Qwen3-Next); Qwen3.5-MoE always does
    has_fused_projections: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj gives each head's query and gate ([query | gate] per
    head), (1 + weight) q/k norms, partial rotary, and attention out * sigmoid(gate) before o_proj.
    NOTE: q_proj's rows load as QKVParallelLinear's q part of 2 * heads "heads" of head_dim: a rank's
    contiguous rows are its heads' [query | gate] pairs."""

    def __init__(self, config, rotary_emb: RotaryEmbedding):
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, attention_head_dim(config)
        tp_size = get_parallel_state().tp_size
        if heads % tp_size:
            raise ValueError(f"{heads} attention heads do not divide over tensor_parallel_size={tp_size}")
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, 2 * heads, kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.num_heads, self.num_kv_heads, self.head_dim = heads // tp_size, self.qkv_proj.num_kv_heads, head_dim
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # shared by every full-attention layer
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        kv_size = self.num_kv_heads * self.head_dim
        query_gate, k, v = self.qkv_proj(hidden).split([2 * self.num_heads * self.head_dim, kv_size, kv_size], dim=-1)
        q, gate = query_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        out = self.attn(q, k, v, positions, self.rotary_emb)  # [num_tokens, num_heads * head_dim]
        return self.o_proj(out * torch.sigmoid(gate.flatten(1)))


def qwen3_5_rotary(config, max_position: int) -> RotaryEmbedding:
    """Rotary over the first partial_rotary_factor of each head. NOTE: Qwen3.5's interleaved mrope
    rotates frequency i by the t, h or w position; for text the three are the token's position, so it is
    this plain rotary."""
    head_dim, rope = attention_head_dim(config), rope_parameters(config)
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return RotaryEmbedding(head_dim, max_position, rope, int(head_dim * factor))


class Qwen3_5DecoderLayer(nn.Module):
    """h += mixer(input_norm(h)); h += mlp(post_attention_norm(h)), the residual carried beside h."""

    def __init__(self, config, mixer: nn.Module, mlp: nn.Module, is_linear: bool):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_linear = is_linear
        if is_linear:  # the checkpoint's names for the mixer
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        hidden, residual = self.post_attention_layernorm(mixer(positions, hidden), residual)
        return self.mlp(hidden), residual


class Qwen3_5Model(nn.Module):
    def __init__(self, config, variant: Qwen3_5Variant, max_position: int):
        super().__init__()
        state = get_parallel_state()
        self.is_first_stage, self.is_last_stage = state.is_first_stage, state.is_last_stage
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = qwen3_5_rotary(config, max_position)
        build_mlp = mlp_builder(config, variant)
        linear = FusedGatedDeltaNet if variant.has_fused_projections else GatedDeltaNet

        def build_layer(index: int) -> nn.Module:
            is_linear = config.layer_types[index] == "linear_attention"
            mixer = linear(config) if is_linear else GatedAttention(config, rotary_emb)
            return Qwen3_5DecoderLayer(config, mixer, build_mlp(index), is_linear)

        self.layers, self.start_layer, self.end_layer = make_layers(config.num_hidden_layers, build_layer)
        if self.is_last_stage:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None = None):
        embedded = self.embed_tokens(input_ids) if self.is_first_stage else None  # [num_tokens, hidden_size]
        return run_stage(self, embedded, positions, intermediate)


def mlp_builder(config, variant: Qwen3_5Variant) -> Callable[[int], nn.Module]:
    def build(index: int) -> nn.Module:
        if not variant.has_experts or not is_sparse_layer(config, index):
            return LlamaMLP(config)
        block = QwenSparseMoeBlock(config, has_shared_expert=True)
        if variant.renormalizes_top_k is not None:  # Qwen3.5-MoE's config has no norm_topk_prob
            block.experts.renormalize = variant.renormalizes_top_k
        return block

    return build


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM, and the language model of
    Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration (its vision tower skipped).
    The multi-token-prediction head (mtp.*) loads apart, with speculative_config method mtp (qwen3_5_mtp.py)."""

    supports_cuda_graphs = True  # decode steps read no tensor value on the host

    def __init__(self, model_config: ModelConfig, variant: Qwen3_5Variant):
        super().__init__()
        config = model_config.hf_config
        self.has_text_config = ARCHITECTURES[model_config.architecture].has_text_config
        self.tie_word_embeddings = ties_word_embeddings(model_config)
        self.model = Qwen3_5Model(config, variant, model_config.max_model_len)
        self.layer_range = (self.model.start_layer, self.model.end_layer)
        self.has_logged_mtp = False
        if get_parallel_state().is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids, positions, intermediate=None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if name.startswith("mtp."):
            if not self.has_logged_mtp:
                logger.info("MTP head (mtp.*) not loaded: it drafts with speculative_config method mtp")
                self.has_logged_mtp = True
            return WeightTarget("", skip=True)
        if self.has_text_config or name.startswith("model.language_model."):
            text_name = language_model_name(name)
            if text_name is None:
                return WeightTarget("", skip=True)  # the vision tower (model.visual.*)
            name = text_name
        expert = expert_weight(name, _EXPERT_KINDS)
        if expert:
            return WeightTarget(*expert)
        if self.tie_word_embeddings:
            return tied_head_target(name, "model.embed_tokens.weight", self.model.is_first_stage) or fold_packed(
                name, _PACKED)
        return fold_packed(name, _PACKED)


def ties_word_embeddings(model_config: ModelConfig) -> bool:
    """Whether the LM head is the embedding. NOTE: a multimodal checkpoint ties as its top-level config.json
    says (transformers' ConditionalGeneration reads that one), which its text_config need not repeat."""
    text_value = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
    if not ARCHITECTURES[model_config.architecture].has_text_config:
        return text_value
    with open(os.path.join(model_config.model, "config.json")) as f:
        top_value = json.load(f).get("tie_word_embeddings")
    return text_value if top_value is None else bool(top_value)


def qwen3_5(model_config: ModelConfig) -> Qwen3_5ForCausalLM:
    return Qwen3_5ForCausalLM(model_config, Qwen3_5Variant())


def qwen3_5_moe(model_config: ModelConfig) -> Qwen3_5ForCausalLM:
    return Qwen3_5ForCausalLM(model_config, Qwen3_5Variant(has_experts=True, renormalizes_top_k=True))


def qwen3_next(model_config: ModelConfig) -> Qwen3_5ForCausalLM:
    return Qwen3_5ForCausalLM(model_config, Qwen3_5Variant(has_experts=True, has_fused_projections=True))
