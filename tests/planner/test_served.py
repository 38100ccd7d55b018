"""Plan-time refusals of what the runtime does not serve, each naming the feature."""

import json

import pytest

from shardserve.planner import PlanError
from shardserve.planner.served import ARCHITECTURES

from tests.planner.factories import plan_for

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)


def folder(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_unserved_rope_type_is_refused_by_name(tmp_path):
    path = folder(tmp_path, architectures=["LlamaForCausalLM"], **TINY,
                  rope_parameters={"rope_type": "mrope", "rope_theta": 1e4})
    with pytest.raises(PlanError, match="rope_type mrope is not served by the runtime; served: default"):
        plan_for(path, "cpu")


def test_sliding_window_models_plan_their_whole_context():
    plan = plan_for("mistralai/Mistral-7B-v0.1", "H100")
    assert plan.model.spec.sliding_window == 4096 and plan.settings.max_model_len == 32768


def test_quantized_checkpoints_are_refused_by_name():
    with pytest.raises(PlanError, match="awq quantization is not served by the runtime yet"):
        plan_for("Qwen/Qwen2.5-72B-Instruct-AWQ", "8xA100-80GB")


def test_moe_families_are_served():
    for arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in ARCHITECTURES
    assert plan_for("Qwen/Qwen3-30B-A3B", "H100").model.spec.num_experts == 128
