"""Configs as transformers 5 saves them (renamed keys, rope_parameters, dtype) and bad values: one line each."""

import json
import os
import subprocess
import sys

import pytest
import transformers

from shardserve.planner import PlanError, load_model
from shardserve.planner.hf_config import LAYER_TYPES, rope_parameters

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)
LEGACY_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], **TINY, "num_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1],
                    "torch_dtype": "bfloat16", "rope_theta": 1000000.0}


def write_config(folder, config):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_transformers5_qwen3_moe_reads_like_the_published_config(tmp_path):
    config = transformers.Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, mlp_only_layers=[1],
                                         dtype="bfloat16", rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 1e6})
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path / "new")
    saved = json.loads((tmp_path / "new" / "config.json").read_text())
    assert "num_local_experts" in saved and "num_experts" not in saved and "dtype" in saved
    new = load_model(str(tmp_path / "new")).spec
    old = load_model(write_config(tmp_path / "old", LEGACY_QWEN3_MOE)).spec
    assert new == old.__class__(**{**old.__dict__, "id": new.id})
    assert new.num_experts == 4 and new.moe_layers == (0, 2, 3) and new.dtype == "bfloat16"


@pytest.mark.parametrize("rope, expected", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "llama3"),
    ({"rope_parameters": {"rope_theta": 5e5}}, "default"),
    ({}, "default"),
])
def test_rope_type_from_either_spelling(tmp_path, rope, expected):
    path = write_config(tmp_path / "m", {"architectures": ["LlamaForCausalLM"], **TINY, **rope})
    assert load_model(path).spec.rope_type == expected


def test_sliding_window_only_where_used(tmp_path):
    mistral = {"architectures": ["MistralForCausalLM"], **TINY, "sliding_window": 64}
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], **TINY, "sliding_window": 64}
    assert load_model(write_config(tmp_path / "a", mistral)).spec.sliding_window == 64
    assert load_model(write_config(tmp_path / "b", qwen2)).spec.sliding_window == 64
    off = {**qwen2, "use_sliding_window": False}
    assert load_model(write_config(tmp_path / "c", off)).spec.sliding_window is None


GEMMA = {**TINY, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16}


def saved_by_transformers(tmp_path, config_class, architecture: str, **values) -> dict:
    config = config_class(**values)
    config.architectures = [architecture]
    config.save_pretrained(tmp_path / "new")
    return json.loads((tmp_path / "new" / "config.json").read_text())


def test_gemma3_transformers4_and_5_spellings_read_the_same(tmp_path):
    """transformers 4 wrote rope_theta, rope_local_base_freq, rope_scaling (global layers only) and
    sliding_window_pattern; 5 writes layer_types and one rope_parameters entry per layer type."""
    legacy = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **GEMMA,
              "sliding_window_pattern": 2, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    saved = saved_by_transformers(tmp_path, transformers.Gemma3TextConfig, "Gemma3ForCausalLM", **{
        k: v for k, v in legacy.items() if k != "architectures"})
    assert "layer_types" in saved and set(saved["rope_parameters"]) == set(LAYER_TYPES)
    new = load_model(str(tmp_path / "new")).spec
    old = load_model(write_config(tmp_path / "old", legacy)).spec
    assert new == old.__class__(**{**old.__dict__, "id": new.id})
    assert old.layer_types == ("sliding_attention", "full_attention") * 2 and old.kv_groups.windows == (None, 8)
    assert old.rope_type == "linear" and old.max_context_len == 256  # max_position_embeddings counts the stretch
    for layer_type in LAYER_TYPES:
        assert rope_parameters(saved, layer_type=layer_type) == rope_parameters(legacy, layer_type=layer_type)
    assert rope_parameters(legacy, layer_type="sliding_attention") == {"rope_type": "default", "rope_theta": 1e4}


def test_gemma2_without_layer_types_alternates_from_a_local_layer(tmp_path):
    """Gemma 2 configs saved before layer_types existed: even layers local, odd layers global."""
    legacy = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **GEMMA}
    saved = saved_by_transformers(tmp_path, transformers.Gemma2Config, "Gemma2ForCausalLM",
                                  **{k: v for k, v in legacy.items() if k != "architectures"})
    new = load_model(str(tmp_path / "new")).spec
    old = load_model(write_config(tmp_path / "old", legacy)).spec
    assert saved["layer_types"] == list(old.layer_types) == ["sliding_attention", "full_attention"] * 2
    assert old.kv_groups == new.kv_groups and new.kv_groups.windows == (None, 8)  # a table per kind
    assert new.layer_types == old.layer_types and new.tie_word_embeddings and old.tie_word_embeddings


def test_gemma3_window_is_uniform_only_when_the_pattern_leaves_no_global_layer(tmp_path):
    """sliding_window_pattern 6 over 4 layers: every layer local, as transformers builds it."""
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **GEMMA, "sliding_window_pattern": 6}
    assert load_model(write_config(tmp_path / "a", config)).spec.kv_groups.windows == (8,)
    global_last = {**config, "num_hidden_layers": 6}
    assert load_model(write_config(tmp_path / "b", global_last)).spec.kv_groups.windows == (None, 8, 8, 8, 8, 8)


def test_phi3_su_rope_is_longrope(tmp_path):
    factors = [1.0] * 8
    config = {"architectures": ["Phi3ForCausalLM"], **TINY, "original_max_position_embeddings": 64,
              "rope_scaling": {"type": "su", "short_factor": factors, "long_factor": factors}}
    spec = load_model(write_config(tmp_path / "m", config)).spec
    assert spec.rope_type == "longrope" and spec.max_context_len == 256


def test_multimodal_gemma3_reads_its_text_config_with_transformers_defaults(tmp_path):
    """gemma-3-4b-it's config.json: text_config lists only what differs from Gemma3TextConfig."""
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
            "sliding_window": 1024, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
              "vision_config": {"model_type": "siglip_vision_model"}, "torch_dtype": "bfloat16"}
    spec = load_model(write_config(tmp_path / "m", config)).spec
    assert (spec.family, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == ("gemma3_text", 8, 4, 256)
    assert spec.vocab_size == 262208 and spec.max_context_len == 131072 and spec.dtype == "bfloat16"
    assert spec.layer_types.count("full_attention") == 5 and spec.tie_word_embeddings
    with pytest.raises(PlanError, match="config.json text_config is None; expected a mapping"):
        load_model(write_config(tmp_path / "bad", {**config, "text_config": None}))


BAD = [
    ({"hidden_size": "big"}, "config.json hidden_size is 'big'; expected an integer"),
    ({"num_local_experts": "8"}, "config.json num_local_experts is '8'; expected an integer"),
    ({"num_hidden_layers": 2.5}, "config.json num_hidden_layers is 2.5; expected an integer"),
    ({"num_attention_heads": 0}, "config.json num_attention_heads is 0; expected a positive integer"),
    ({"num_local_experts": None}, "config.json has no num_local_experts or num_experts or "
                                  "n_routed_experts (required)"),
    ({"mlp_only_layers": "1,2"}, "config.json mlp_only_layers is '1,2'; expected a list"),
    ({"decoder_sparse_step": 0}, "config.json decoder_sparse_step is 0; expected a positive"),
    ({"tie_word_embeddings": "no"}, "config.json tie_word_embeddings is 'no'; expected true or"),
    ({"dtype": "int8"}, "config.json dtype is 'int8'; expected float32, float16 or bfloat16"),
    ({"rope_parameters": {"chunked_attention": {"rope_type": "default"}}},
     "rope_parameters has entries for chunked_attention; expected full_attention and sliding_attention"),
    ({"rope_scaling": "yarn"}, "config.json rope_scaling is 'yarn'; expected a mapping"),
    ({"layer_types": ["sliding_attention"]}, "config.json layer_types is ['sliding_attention']; expected 4 entries"),
    ({"sliding_window_pattern": 0}, "config.json sliding_window_pattern is 0; expected a positive integer"),
    ({"quantization_config": "fp8"}, "config.json quantization_config is 'fp8'; expected a"),
    ({"architectures": "Qwen3MoeForCausalLM"}, "architectures is 'Qwen3MoeForCausalLM'; expected"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[next(iter(c)) for c, _ in BAD])
def test_bad_value_names_the_key(tmp_path, change, message):
    saved_by_transformers5 = {k: v for k, v in LEGACY_QWEN3_MOE.items() if k != "num_experts"}
    config = {**saved_by_transformers5, "num_local_experts": 4, **change}
    with pytest.raises(PlanError) as info:
        load_model(write_config(tmp_path / "m", config))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_cli_prints_one_line_not_a_traceback(tmp_path):
    path = write_config(tmp_path / "m", {**LEGACY_QWEN3_MOE, "num_experts": "many"})
    r = subprocess.run([sys.executable, "-m", "shardserve.launch", "plan", "--model", path,
                        "--hardware", "cpu"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert "config.json num_experts is 'many'; expected an integer" in r.stderr + r.stdout


@pytest.mark.parametrize("rope, max_positions, context", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     40960, 131072),  # Qwen3 as its model card extends it
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 4096, 8192),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, 4096, 16384),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     131072, 131072),
    ({}, 4096, 4096),
])
def test_context_limit_counts_rope_scaling(tmp_path, rope, max_positions, context):
    config = {"architectures": ["Qwen3ForCausalLM"], **TINY, "max_position_embeddings": max_positions,
              **rope}
    spec = load_model(write_config(tmp_path / "m", config)).spec
    assert spec.max_context_len == context and spec.max_position_embeddings == max_positions
