"""Gemma 3 4b+ (Gemma3ForConditionalGeneration): the runtime serves the language model of the multimodal
checkpoint under both spellings of its config (transformers 5: layer_types, rope per layer type;
transformers 4: text_config without its defaults, rope_local_base_freq) and both namings of its
weights (language_model.model.*, as save_pretrained writes; model.language_model.*, the module
names), and the planner counts only the language model's tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from shardserve.planner import load_model
from shardserve.runtime import LLM
from test_runtime_matches_transformers import random_prompts, reference, token_outputs

PROMPTS = random_prompts(5, [1, 6, 13, 20])
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 56, "patch_size": 14}
# as transformers 4 wrote it: defaults left out (heads 8, kv 4, ...), local rope base on its own key
LEGACY_TEXT = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24,
               "sliding_window": 8, "sliding_window_pattern": 2, "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
               "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "final_logit_softcapping": 6.0,
               "vocab_size": 320, "max_position_embeddings": 256}
TOKENS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
# the saved names -> the module names
MODULE_PREFIXES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                   ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(transformers 5's folder, a folder with transformers 4's config and the module names, the model)."""
    config = transformers.Gemma3Config(text_config={**LEGACY_TEXT, **TOKENS}, vision_config=VISION,
                                       mm_tokens_per_image=4, image_token_index=319, **TOKENS)
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.15) if param.dim() >= 2 else param.normal_(0.0, 0.05)
    new, old = tmp_path_factory.mktemp("gemma3_mm_new"), tmp_path_factory.mktemp("gemma3_mm_old")
    hf_model.save_pretrained(new)
    tensors = load_file(new / "model.safetensors")
    save_file({module_name(name): value for name, value in tensors.items()}, old / "model.safetensors")
    legacy_config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                     "text_config": LEGACY_TEXT, "vision_config": {**VISION, "model_type": "siglip_vision_model"},
                     "mm_tokens_per_image": 4, "image_token_index": 319, "torch_dtype": "float32", **TOKENS}
    (old / "config.json").write_text(json.dumps(legacy_config))
    assert any(name.startswith("vision_tower.") for name in tensors)
    return str(new), str(old), hf_model


def module_name(name: str) -> str:
    for new, old in MODULE_PREFIXES:
        if name.startswith(new):
            return old + name[len(new):]
    raise AssertionError(name)


def test_both_layouts_serve_transformers_greedy_tokens(checkpoints):
    new, old, hf_model = checkpoints
    expected = reference(hf_model, PROMPTS)
    for folder in (new, old):
        llm = LLM(folder, device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=2**22, block_size=4)
        assert token_outputs(llm, PROMPTS) == expected, os.listdir(folder)


def test_planner_reads_both_layouts_alike_without_the_vision_tower(checkpoints):
    new, old, hf_model = checkpoints
    new_info, old_info = load_model(new), load_model(old)
    assert new_info.spec == old_info.spec.__class__(**{**old_info.spec.__dict__, "id": new_info.spec.id})
    assert new_info.tensors_from == "safetensors" and set(new_info.tensors) == set(old_info.tensors)
    language_model = hf_model.model.language_model
    assert {t.name for t in new_info.tensors} == {f"model.{name}" for name, _ in language_model.named_parameters()}
    assert new_info.spec.layer_types == ("sliding_attention", "full_attention")
    assert new_info.spec.rope_type == "linear" and new_info.spec.max_context_len == 256


@pytest.mark.slow
def test_legacy_layout_on_two_stages(checkpoints):
    _, old, hf_model = checkpoints
    with LLM(old, device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=2**22, block_size=4,
             pipeline_parallel_size=2, distributed_executor_backend="mp") as llm:
        assert token_outputs(llm, PROMPTS) == reference(hf_model, PROMPTS)
