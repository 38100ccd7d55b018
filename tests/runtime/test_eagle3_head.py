"""The EAGLE-3 head's arithmetic against a reference built from transformers' Llama parts (its norms, rotary
embedding and GQA key repeat) as the EAGLE-3 paper and the authors' checkpoints describe the layer, and the states
a forward keeps for it against transformers' own hidden states."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from draft_heads import random_head_tensors, save_eagle3_head
from runtime_forward import BLOCK_SIZE, PROMPT
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend
from shardserve.runtime.config import load_model_config
from shardserve.runtime.models.eagle3 import Eagle3Head
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.worker.forward_context import ForwardContext, HiddenCapture, forward_context
from shardserve.runtime.worker.inputs import RequestState, prepare_inputs
from shardserve.runtime.worker.loader import load_model

CPU = torch.device("cpu")


def _run(module, tokens: list[int], *extra, capture: HiddenCapture | None = None):
    """One forward of `module` over `tokens` (positions 0 on) through a paged cache of its own."""
    for layer in [m for m in module.modules() if isinstance(m, Attention)]:
        layer.kv_cache = torch.zeros(2, 16, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
        layer.kv_group = 0
    state = RequestState("r", list(tokens), len(tokens), SamplingParams(), 0, frozenset(), list(range(15, 5, -1)), 0)
    inputs = prepare_inputs([state], {"r": len(tokens)}, BLOCK_SIZE, CPU)
    with torch.inference_mode(), forward_context(ForwardContext(inputs.attn_metadata, TorchAttentionBackend(),
                                                                capture=capture)):
        return module(inputs.input_ids, inputs.positions, *extra)


def test_a_forward_keeps_the_hidden_states_transformers_hands_out(checkpoint_factory):
    """The states entering layers 0 and 1 are transformers' hidden_states[0] and [1] (the embedding, the first
    layer's output); index 2 of a 2-layer model is the last layer's output before the final norm."""
    folder, reference = checkpoint_factory("llama3")
    model = load_model(load_model_config(folder), CPU)
    capture = HiddenCapture((0, 1, 2))
    final = _run(model, PROMPT, capture=capture)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    for captured, want in zip(capture.captured[:2], expected[:2]):
        torch.testing.assert_close(captured, want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(reference.model.norm(capture.captured[2]), final, atol=1e-4, rtol=1e-4)


def reference_head(tensors: dict[str, torch.Tensor], config: dict, tokens: torch.Tensor, aux: torch.Tensor):
    """(the logits' input, the prenorm output) of the EAGLE-3 layer for `tokens` (x_{p+1} at position p) and the
    captured states `aux` [n, 3h], written from the description with transformers' parts."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb,
                                                          repeat_kv)

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    heads, kv_heads, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    head_dim = hidden // heads

    def norm(name, x):
        layer = LlamaRMSNorm(hidden, cfg.rms_norm_eps)
        layer.weight.data.copy_(tensors[name])
        return layer(x)

    def linear(name, x):
        return x @ tensors[f"midlayer.{name}.weight"].T

    feature = aux @ tensors["fc.weight"].T
    x = torch.cat([norm("midlayer.input_layernorm.weight", tensors["embed_tokens.weight"][tokens]),
                   norm("midlayer.hidden_norm.weight", feature)], dim=-1)
    n = len(tokens)
    q = linear("self_attn.q_proj", x).view(1, n, heads, head_dim).transpose(1, 2)
    k = linear("self_attn.k_proj", x).view(1, n, kv_heads, head_dim).transpose(1, 2)
    v = linear("self_attn.v_proj", x).view(1, n, kv_heads, head_dim).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(cfg)(x[None], torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = repeat_kv(k, heads // kv_heads), repeat_kv(v, heads // kv_heads)
    scores = (q @ k.transpose(2, 3)) / head_dim ** 0.5 + torch.full((n, n), float("-inf")).triu(1)
    attended = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(n, heads * head_dim)
    residual = feature + linear("self_attn.o_proj", attended)
    mlp_in = norm("midlayer.post_attention_layernorm.weight", residual)
    gate, up = linear("mlp.gate_proj", mlp_in), linear("mlp.up_proj", mlp_in)
    prenorm = residual + linear("mlp.down_proj", torch.nn.functional.silu(gate) * up)
    return norm("norm.weight", prenorm), prenorm


def test_the_head_computes_the_eagle3_layer(checkpoint_factory, tmp_path):
    target, _ = checkpoint_factory("llama3")
    tensors = random_head_tensors(target, seed=11)
    folder = save_eagle3_head(str(tmp_path / "head"), target, tensors)
    config = load_model_config(folder)
    head = load_model(config, CPU, lambda c: Eagle3Head(c, set(load_file(os.path.join(folder, "model.safetensors")))))
    assert isinstance(head, Eagle3Head) and head.has_embedding
    aux = torch.randn(len(PROMPT), 3 * config.hf_config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        normed, prenorm = _run(head, PROMPT, head.combine([aux]))
    with open(os.path.join(folder, "config.json")) as f:
        expected_normed, expected_prenorm = reference_head(tensors, json.load(f), torch.tensor(PROMPT), aux)
    torch.testing.assert_close(prenorm, expected_prenorm, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(normed, expected_normed, atol=2e-4, rtol=2e-4)
    logits = normed @ tensors["lm_head.weight"].T
    assert head.draft_tokens(normed).tolist() == logits.argmax(dim=-1).tolist()


def test_a_head_that_cannot_map_or_embed_its_drafts_is_refused(checkpoint_factory, tmp_path):
    """A draft vocabulary other than the model's needs d2t; a head of another width needs an embedding of its own."""
    target, _ = checkpoint_factory("llama3")
    model = load_model(load_model_config(target), CPU)
    tensors = random_head_tensors(target, seed=1, own_embedding=False)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:64]
    folder = save_eagle3_head(str(tmp_path / "small_vocab"), target, tensors, draft_vocab_size=64)
    with pytest.raises(ValueError, match="drafts over 64 ids, the model's vocabulary has 320, and its checkpoint has "
                                         "no d2t"):
        load_model(load_model_config(folder), CPU, lambda c: Eagle3Head(c, set(tensors)))
    plain = save_eagle3_head(str(tmp_path / "plain"), target, random_head_tensors(target, seed=2, own_embedding=False))
    head = Eagle3Head(load_model_config(plain), set())  # (built, not loaded: only its width matters here)
    head.norm.weight = torch.nn.Parameter(torch.ones(32), requires_grad=False)  # (as a 32-wide head's)
    with pytest.raises(ValueError, match="the EAGLE-3 head is 32 wide, the model's embedding 64"):
        head.share_embedding(model)
