"""Llama-style decoders: Llama 2/3/3.1, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.layers.activation import SiluAndMul, get_activation
from shardserve.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shardserve.runtime.layers.norm import RMSNorm
from shardserve.runtime.layers.rotary import RotaryEmbedding, rope_parameters
from shardserve.runtime.models.weight_map import WeightTarget, fold_packed, tied_head_target
from shardserve.runtime.distributed.parallel_state import get_parallel_state
from shardserve.runtime.worker.forward_context import get_forward_context
from shardserve.runtime.worker.pipeline import IntermediateTensors, make_layers


@dataclass(frozen=True)
class LlamaVariant:
    """What distinguishes the family members; everything else comes from config.json."""

    qkv_bias: bool | None = None  # None: config.attention_bias
    qk_norm: bool = False  # Qwen3
    has_sliding_window: bool = False  # config.sliding_window applies (Mistral, Qwen2, Qwen3; not Llama)
    has_partial_rotary: bool = False  # rope's partial_rotary_factor applies (Phi-3)
    has_sinks: bool = False  # a learned softmax sink per head (gpt-oss: self_attn.sinks)


LLAMA_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def layer_sliding_window(config, index: int) -> int | None:
    """The attention window of layer `index`: config.sliding_window on every layer (Mistral, Mixtral),
    or on the layers `layer_types` marks "sliding_attention" (Qwen2 with use_sliding_window)."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[index] != "sliding_attention":
        return None
    return window


def attention_head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama_rotary(config, variant: LlamaVariant, max_position: int) -> RotaryEmbedding:
    """One table for the whole model (every layer rotates alike): 64 MiB at 128k positions, not that per layer."""
    head_dim = attention_head_dim(config)
    rope = rope_parameters(config)
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0)) if variant.has_partial_rotary else None
    return RotaryEmbedding(head_dim, max_position, rope, rotary_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config, variant: LlamaVariant, rotary_emb: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        head_dim = attention_head_dim(config)
        qkv_bias = variant.qkv_bias if variant.qkv_bias is not None else getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False) and variant.qkv_bias is None)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        if variant.qk_norm:
            self.q_norm: nn.Module = RMSNorm(head_dim, config.rms_norm_eps)  # Gemma's are GemmaRMSNorm
            self.k_norm: nn.Module = RMSNorm(head_dim, config.rms_norm_eps)
        self.has_qk_norm = variant.qk_norm
        self.rotary_emb = rotary_emb  # shared by every layer
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, sliding_window,
                              has_sinks=variant.has_sinks)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:  # before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class LlamaMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        if config.hidden_act != "silu":
            get_activation(config.hidden_act)  # raises for unknown names
            raise ValueError(f"Llama-style MLP supports hidden_act='silu', got {config.hidden_act!r}")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """self_attn is `attention` (forward(positions, hidden)) or, when None, the Llama attention."""

    def __init__(self, config, variant: LlamaVariant, rotary_emb: RotaryEmbedding | None, mlp: nn.Module,
                 index: int, attention: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if attention is None:
            assert rotary_emb is not None  # the Llama attention rotates with the model's table
            window = layer_sliding_window(config, index) if variant.has_sliding_window else None
            attention = LlamaAttention(config, variant, rotary_emb, window)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderStage(Protocol):
    """What run_stage reads of a decoder (LlamaModel, GemmaModel); norm only on the last stage."""

    @property
    def is_first_stage(self) -> bool: ...
    @property
    def is_last_stage(self) -> bool: ...
    @property
    def layers(self) -> nn.ModuleList: ...
    @property
    def start_layer(self) -> int: ...
    @property
    def end_layer(self) -> int: ...
    @property
    def norm(self) -> nn.Module: ...


def run_stage(model: DecoderStage, embedded: torch.Tensor | None, positions: torch.Tensor,
              intermediate: IntermediateTensors | None):
    """A decoder stage over the embedded tokens on the first stage or the previous stage's hand-off
    after it: the hand-off for the next stage, or the final norm's output on the last."""
    residual: torch.Tensor | None = None
    if model.is_first_stage:
        assert embedded is not None  # the first stage embeds the tokens
        hidden = embedded
    else:
        assert intermediate is not None  # a later stage receives the previous one's hand-off
        hidden, residual = intermediate.hidden_states, intermediate.residual
    capture = get_forward_context().capture
    for index in range(model.start_layer, model.end_layer):
        if capture is not None and index in capture.layers:  # (vLLM's aux hidden states: the layer's input)
            capture.captured.append(hidden if residual is None else hidden + residual)
        hidden, residual = model.layers[index](positions, hidden, residual)
    if capture is not None and model.end_layer in capture.layers:
        capture.captured.append(hidden if residual is None else hidden + residual)
    if not model.is_last_stage:
        return IntermediateTensors(hidden, residual)
    return model.norm(hidden, residual)[0] if residual is not None else model.norm(hidden)


AttentionBuilder = Callable[[int], nn.Module]  # layer index -> its attention (DeepSeek's MLA)


class LlamaModel(nn.Module):
    def __init__(self, config, variant: LlamaVariant, max_position: int, build_mlp: Callable[[int], nn.Module],
                 build_attention: AttentionBuilder | None = None):
        super().__init__()
        state = get_parallel_state()
        self.is_first_stage, self.is_last_stage = state.is_first_stage, state.is_last_stage
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = llama_rotary(config, variant, max_position) if build_attention is None else None
        self.layers, self.start_layer, self.end_layer = make_layers(config.num_hidden_layers, lambda i: LlamaDecoderLayer(
            config, variant, rotary_emb, build_mlp(i), i, build_attention(i) if build_attention else None))
        if self.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None = None):
        embedded = self.embed_tokens(input_ids) if self.is_first_stage else None  # [num_tokens, hidden_size]
        return run_stage(self, embedded, positions, intermediate)


class LlamaForCausalLM(nn.Module):
    supports_cuda_graphs = True  # the forward reads no tensor value on the host

    def __init__(self, model_config: ModelConfig, variant: LlamaVariant = LlamaVariant(),
                 build_mlp: Callable[[int], nn.Module] | None = None, build_attention: AttentionBuilder | None = None,
                 packed_modules: Mapping[str, tuple[str, object]] = LLAMA_PACKED):
        """packed_modules: the checkpoint projections fused into one layer here (DeepSeek keeps q_proj)."""
        super().__init__()
        self.packed_modules = packed_modules
        config = model_config.hf_config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, variant, model_config.max_model_len,
                                build_mlp or (lambda i: LlamaMLP(config)), build_attention)
        self.layer_range = (self.model.start_layer, self.model.end_layer)
        if get_parallel_state().is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids, positions, intermediate=None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if "rotary_emb.inv_freq" in name:
            return None
        if self.tie_word_embeddings:
            return tied_head_target(name, "model.embed_tokens.weight", self.model.is_first_stage) or fold_packed(
                name, self.packed_modules)
        return fold_packed(name, self.packed_modules)


class ComposedLlama(nn.Module):
    """A family built as a LlamaForCausalLM (`inner`) with its own MLPs or attention: forward and logits
    are the Llama's; the family maps its checkpoint names onto `inner.` in checkpoint_target."""

    supports_cuda_graphs = True  # on CUDA the MoE and MLA layers read no tensor value on the host

    def __init__(self, inner: LlamaForCausalLM):
        super().__init__()
        self.inner = inner
        self.layer_range = inner.layer_range

    def forward(self, input_ids, positions, intermediate=None):
        return self.inner(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)
