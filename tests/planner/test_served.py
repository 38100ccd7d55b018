"""Plan-time refusals of what the runtime does not serve, each naming the feature."""

import json

import pytest

from shardserve.planner import PlanError
from shardserve.planner.catalog import model_catalog
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


def test_quantized_models_are_served_and_act_order_experts_refused_by_name(tmp_path):
    assert plan_for("Qwen/Qwen2.5-72B-Instruct-AWQ", "8xA100-80GB").model.spec.quantization.method == "awq"
    assert plan_for("Qwen/Qwen3-30B-A3B-FP8", "H100").model.spec.quantization.block_shape == (128, 128)
    config = dict(model_catalog()["mistralai/Mixtral-8x7B-Instruct-v0.1"])
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    path = tmp_path / "mixtral-gptq"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match="gptq act-order \\(desc_act\\) experts are not served; quantized experts "
                                        "served: awq, gptq without desc_act, fp8"):
        plan_for(str(path), "8xH100-80GB")
    config["quantization_config"]["desc_act"] = False
    (path / "config.json").write_text(json.dumps(config))
    assert plan_for(str(path), "8xH100-80GB").model.spec.quantization.method == "gptq"


def test_moe_families_are_served():
    for arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in ARCHITECTURES
    assert plan_for("Qwen/Qwen3-30B-A3B", "H100").model.spec.num_experts == 128
