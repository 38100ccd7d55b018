"""Planner and runtime agree: every plan the planner makes from the catalog names an architecture and
features the runtime serves (the rest refused by name), and a tiny checkpoint with the architecture
and features of each catalog entry serves transformers' greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from shardserve.planner import PlanError, PlanOptions, load_model, make_plan, parse_declared
from shardserve.planner.catalog import model_catalog
from shardserve.planner.hf_config import TEXT_CONFIG_DEFAULTS
from shardserve.planner.served import ARCHITECTURES, ROPE_TYPES
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.layers.rotary import SUPPORTED_ROPE_TYPES
from shardserve.runtime.models.registry import MODEL_BUILDERS
from tests.runtime.runtime_checkpoints import FULL_FORWARD_REFERENCE

HARDWARE = "2x8xH100-80GB"
SMALL = {"hidden_size": 64, "n_embd": 64, "intermediate_size": 96, "ffn_dim": 96, "num_hidden_layers": 2,
         "n_layer": 2, "num_attention_heads": 4, "n_head": 4, "head_dim": 16, "vocab_size": 320,
         "word_embed_proj_dim": 64, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "sliding_window": 8,
         # MLA and DeepSeek's experts: 4 groups of 2 of the 8 routed experts, the first layer dense
         "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
         "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "n_shared_experts": 1}
PROMPTS = [[5, 17, 42, 9], [300, 7, 7, 120, 64, 3, 88]]


def plan_or_refusal(model_id: str):
    """Made in the test, not at collection (79 plans take half a minute)."""
    try:
        return make_plan(load_model(model_id), parse_declared(HARDWARE), PlanOptions())
    except PlanError as e:
        return str(e)


def test_runtime_builds_exactly_the_served_table():
    assert set(MODEL_BUILDERS) == set(ARCHITECTURES)
    assert SUPPORTED_ROPE_TYPES == ROPE_TYPES


@pytest.mark.parametrize("model_id", model_catalog())
def test_every_catalog_plan_is_served(model_id):
    plan = plan_or_refusal(model_id)
    assert not isinstance(plan, str), plan  # quantized releases included
    spec = plan.model.spec
    assert spec.architecture in MODEL_BUILDERS
    assert spec.rope_type in ARCHITECTURES[spec.architecture].rope_types or spec.rope_type is None


TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 56, "patch_size": 14}


def tiny_config(config: dict) -> dict:
    """The catalog config with small sizes: same architecture, rope, window, ties, expert layout (a
    multimodal one's language model small, its vision tower smaller)."""
    if "text_config" in config:
        text = {**TEXT_CONFIG_DEFAULTS[config["text_config"]["model_type"]], **config["text_config"]}
        return {**tiny_config({k: v for k, v in config.items() if k not in ("text_config", "vision_config")}),
                "text_config": tiny_config(text), "vision_config": {**config["vision_config"], **TINY_VISION},
                "mm_tokens_per_image": 4}
    tiny = {k: v for k, v in config.items() if k not in ("quantization_config", "torch_dtype")}
    grouped = config.get("num_key_value_heads", config.get("num_attention_heads")) != config.get(
        "num_attention_heads")
    tiny.update({k: v for k, v in SMALL.items() if k in config})
    if "num_key_value_heads" in config:
        tiny["num_key_value_heads"] = 2 if grouped else 4
    if "layer_types" in config:  # the first layers' kinds (gpt-oss: a windowed layer, then a full one)
        tiny["layer_types"] = config["layer_types"][:tiny["num_hidden_layers"]]
    if config.get("full_attention_interval") or "linear_attention" in config.get("layer_types", ()):
        # a hybrid (Gated DeltaNet): a linear layer, then a full-attention one, with narrow linear heads
        tiny.update(layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    if config.get("q_lora_rank"):  # MLA's query compression (None: q_proj straight, V2-Lite)
        tiny["q_lora_rank"] = 48
    rope = config.get("rope_scaling") or {}
    if "short_factor" in rope:  # longrope: one factor per rotated pair of the 16-wide heads
        tiny["rope_scaling"] = {**rope, "short_factor": rope["short_factor"][:8], "long_factor": rope["long_factor"][:8]}
    return {**tiny, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "dtype": "float32"}


# every catalog entry's shapes once (each is planned and served: test_every_catalog_plan_is_served)
TINY = {json.dumps(tiny_config(config), sort_keys=True): m for m, config in model_catalog().items()}


@pytest.mark.parametrize("config_json", TINY, ids=list(TINY.values()))
def test_tiny_model_like_each_catalog_entry_matches_transformers(config_json, tmp_path):
    config = json.loads(config_json)
    model_class = getattr(transformers, config["architectures"][0])
    torch.manual_seed(0)
    hf_model = model_class(model_class.config_class(**config)).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.15) if param.dim() >= 2 else param.normal_(0.0, 0.05)
    hf_model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", skip_tokenizer_init=True, max_model_len=64,
              kv_cache_memory_bytes=2**22)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                         min_new_tokens=6, do_sample=False, pad_token_id=2,
                                         use_cache=hf_model.config.model_type not in FULL_FORWARD_REFERENCE)
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist(), TINY[config_json]
