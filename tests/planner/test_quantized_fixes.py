"""A refusal names quantized weights of the same model where they would fit, found by planning them with the
planner's own memory model: the catalog's releases (fp8, AWQ, GPTQ) and fp8 quantized while loading."""

from __future__ import annotations

import pytest

from shardserve.planner import InfeasibleError, PlanOptions, load_model, make_plan, parse_declared
from shardserve.planner.quantized_releases import base_name, catalog_releases
from tests.planner.factories import plan_for

LLAMA_405B = "meta-llama/Llama-3.1-405B-Instruct"


def refusal(model: str, hardware: str, **options) -> str:
    with pytest.raises(InfeasibleError) as e:
        plan_for(model, hardware, **options)
    return str(e.value)


def test_release_names_reduce_to_their_models():
    assert base_name("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4") == "llama-3.1-8b-instruct"
    assert base_name("TheBloke/Llama-2-70B-Chat-GPTQ") == base_name("meta-llama/Llama-2-70b-chat-hf")
    assert base_name("Qwen/Qwen3-32B-FP8") == "qwen3-32b"


def test_the_catalog_knows_the_releases_of_a_model_and_only_of_it():
    def ids(model):
        return [r.model for r in catalog_releases(load_model(model).spec)]
    assert ids(LLAMA_405B) == ["meta-llama/Llama-3.1-405B-Instruct-FP8"]
    assert ids("meta-llama/Llama-3.1-8B-Instruct") == [  # most bits first
        "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8", "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4"]
    assert ids("meta-llama/Llama-3.1-8B") == []  # the Instruct releases are another model's weights
    assert ids("Qwen/Qwen2.5-72B-Instruct") == ["Qwen/Qwen2.5-72B-Instruct-AWQ"]  # its padded MLP kept


def test_the_405b_at_bf16_on_8_h100_names_fp8_weights_at_tp8():
    message = refusal(LLAMA_405B, "8xH100-80GB")
    assert "does not fit on 8xH100-80GB" in message
    assert ("fp8 weights would fit at tp=8 pp=1 dp=1: meta-llama/Llama-3.1-405B-Instruct-FP8 or "
            "--quantization fp8 on these weights") in message
    # what it says is what the planner does with the suggestion
    for model, quantization in [("meta-llama/Llama-3.1-405B-Instruct-FP8", None), (LLAMA_405B, "fp8")]:
        options = PlanOptions(quantization=quantization)
        chosen = make_plan(load_model(model, quantization), parse_declared("8xH100-80GB"), options).chosen
        assert str(chosen.layout) == "tp=8 pp=1 dp=1"


def test_a_gpu_without_fp8_gets_the_catalogs_fp8_release_only():
    message = refusal(LLAMA_405B, "8xA100-80GB")
    assert "fp8 weights would fit at tp=8 pp=1 dp=1: meta-llama/Llama-3.1-405B-Instruct-FP8." in message
    assert "--quantization fp8" not in message  # quantizing while loading needs fp8 on the GPU


def test_int4_is_named_when_fp8_does_not_fit():
    message = refusal("meta-llama/Llama-3.1-70B-Instruct", "1xH100-80GB", max_model_len=8000)
    assert "int4 AWQ weights would fit at tp=1 pp=1 dp=1: hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4" \
        in message
    assert "fp8 weights would fit" not in message
    plan = plan_for("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "1xH100-80GB", max_model_len=8000)
    assert str(plan.chosen.layout) == "tp=1 pp=1 dp=1"


def test_nothing_is_suggested_when_no_weights_fit_either_way():
    message = refusal(LLAMA_405B, "1xL4")
    assert "does not fit on 1xL4" in message and "weights would fit" not in message
