"""RoPE scaling (linear, llama3, yarn, dynamic, longrope) against transformers: every position's
rotation, and greedy tokens and logits of generations that run past the pretraining length."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from runtime_checkpoints import ROPE_SCALING, family_config
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.config import load_model_config
from shardserve.runtime.layers.rotary import RotaryEmbedding, rope_parameters
from test_runtime_matches_transformers import random_prompts

FAMILIES = ["llama3", *ROPE_SCALING]
# Within the pretraining length of 16, and shorter: transformers' dynamic rope keeps the stretched
# frequencies of a previous generation for a prompt of exactly that length.
PROMPTS = random_prompts(11, [3, 9, 15])
CONTEXT = {"llama-linear": 32}  # 16 positions x factor 2; the others stretch to 64


@pytest.mark.parametrize("family", FAMILIES)
def test_rotation_matches_transformers_at_every_position(family):
    """transformers recomputes dynamic and longrope frequencies for the newest position: position p
    is compared with transformers run on a batch whose last position is p."""
    config = family_config(family, max_position_embeddings=64)
    reference = LlamaRotaryEmbedding(config)
    num_positions = CONTEXT.get(family, 64)
    ours = RotaryEmbedding(16, num_positions, rope_parameters(config))
    for position in range(num_positions):
        cos, sin = reference(torch.zeros(1), torch.tensor([[position]]))
        assert torch.allclose(cos[0, 0, :8], ours.cos[position], atol=1e-5), (family, position)
        assert torch.allclose(sin[0, 0, :8], ours.sin[position], atol=1e-5), (family, position)


@pytest.mark.parametrize("family", ROPE_SCALING)
def test_generation_past_the_pretraining_length_matches_transformers(family, checkpoint_factory):
    folder, hf_model = checkpoint_factory(family)
    num_positions = CONTEXT.get(family, 64)
    max_tokens = num_positions - 15
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4)
    assert llm.engine.config.model.max_model_len == num_positions
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    for prompt, output in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)):
        tokens, logits = reference(hf_model, prompt, max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, family
        expected = torch.log_softmax(logits.float(), dim=-1)
        for step, entries in enumerate(completion.logprobs):
            for token, logprob in entries.items():
                assert abs(logprob.logprob - expected[step, token].item()) < 1e-4, (family, step)


def test_phi3_longrope_past_the_pretraining_length_matches_transformers_step_by_step(checkpoint_factory):
    """Phi-3 with longrope factors (pretraining length 16, 64 positions), partial prompts and
    generations crossing into the long factors. NOTE: Phi3ForCausalLM.generate drops its cache when a
    sequence crosses the pretraining length and recomputes every key with the long factors; a paged
    cache keeps each key as it was written (vLLM does the same), so the reference is transformers'
    forward one token at a time over its own cache."""
    folder, hf_model = checkpoint_factory("phi3-longrope")
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4)
    assert llm.engine.config.model.max_model_len == 64
    params = SamplingParams(temperature=0.0, max_tokens=49, logprobs=1)
    for prompt, output in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)):
        tokens, logits = stepwise_reference(hf_model, prompt, 49)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        assert len(prompt) + len(tokens) > 17  # past the pretraining length
        expected = torch.log_softmax(logits.float(), dim=-1)
        for step, entries in enumerate(completion.logprobs):
            for token, logprob in entries.items():
                assert abs(logprob.logprob - expected[step, token].item()) < 1e-4, step


def stepwise_reference(hf_model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (cut after EOS) and each step's logits, one forward per token over a DynamicCache."""
    from transformers import DynamicCache

    cache, tokens, logits = DynamicCache(config=hf_model.config), [], []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        while len(tokens) < max_tokens and (not tokens or tokens[-1] != 1):
            logits.append(out.logits[0, -1])
            tokens.append(int(logits[-1].argmax()))
            out = hf_model(torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True)
    return tokens, torch.stack(logits)


def test_legacy_rope_scaling_spelling_reads_the_same(checkpoint_factory, tmp_path):
    """rope_theta + rope_scaling (transformers 4) and rope_parameters (5) are the same model."""
    folder, _ = checkpoint_factory("llama-yarn")
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    for name in os.listdir(folder):
        target = tmp_path / name
        target.write_bytes(json.dumps(config).encode() if name == "config.json"
                           else open(os.path.join(folder, name), "rb").read())
    new, old = load_model_config(folder), load_model_config(str(tmp_path))
    assert rope_parameters(new.hf_config) == rope_parameters(old.hf_config)
    assert old.max_model_len == 64


def reference(hf_model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (cut after EOS) and the raw logits of each step."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=2, output_logits=True,
                                return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    tokens = tokens[: tokens.index(1) + 1] if 1 in tokens else tokens
    return tokens, torch.cat(out.logits)[: len(tokens)]


def test_unserved_rope_type_is_named():
    config = SimpleNamespace(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported; supported: default, linear"):
        rope_parameters(config)
