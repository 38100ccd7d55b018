"""Each planner rule as a named test on catalog models and declared hardware."""

import pytest

from shardserve.planner import InfeasibleError, PlanError, load_model
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.rules import tensor_parallel_problem
from shardserve.planner.search import PREFERENCE_MARGIN

from tests.planner.factories import plan_for

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"
LLAMA_405B = "meta-llama/Llama-3.1-405B-Instruct"


def layout(plan) -> tuple[int, int, int]:
    p = plan.to_dict()["parallel"]
    return (p["tensor_parallel_size"], p["pipeline_parallel_size"], p["data_parallel_size"])


def test_rule1_one_gpu_when_it_fits_and_spare_gpus_become_replicas():
    plan = plan_for(LLAMA_8B, "8xH100-80GB")
    assert layout(plan) == (1, 1, 8)
    assert any(line.startswith("rule 1") for line in plan.rationale)


def test_rule1_single_gpu():
    assert layout(plan_for("Qwen/Qwen3-8B", "H200")) == (1, 1, 1)


def test_rule2_tensor_parallel_inside_a_node():
    plan = plan_for(LLAMA_70B, "8xH100-80GB")
    tp, pp, dp = layout(plan)
    assert pp == 1 and tp > 1 and tp * dp == 8
    assert any(line.startswith("rule 2") for line in plan.rationale)
    assert any("one GPU is not enough" in line for line in plan.rationale)


def test_rule3_tp_is_gpus_per_node_and_pp_is_nodes():
    plan = plan_for(LLAMA_405B, "2x8xH100-80GB")
    assert layout(plan) == (8, 2, 1)
    assert plan.executor == "ray"
    assert any(line.startswith("rule 3") for line in plan.rationale)


def test_rule4_pipeline_instead_of_idle_gpus_when_tp_cannot_divide():
    # 64 heads: tp=3 is impossible; tp=2 would leave a GPU idle
    plan = plan_for(LLAMA_70B, "3xH100-80GB")
    assert layout(plan) == (1, 3, 1)
    assert any(line.startswith("rule 4") and "not divisible by tensor_parallel_size 3" in line
               for line in plan.rationale)
    assert sum(plan.chosen.split) == 80 and len(set(plan.chosen.split)) > 1  # uneven


@pytest.mark.parametrize("tp, message", [
    (3, "32 attention heads are not divisible by tensor_parallel_size 3"),
    (5, "not divisible by tensor_parallel_size 5"),
])
def test_rule4_pinned_tp_that_does_not_divide_heads_is_refused(tp, message):
    with pytest.raises(PlanError, match=message) as info:
        plan_for(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=tp)
    assert not isinstance(info.value, InfeasibleError)


def _spec(**overrides) -> ModelSpec:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 768,
              "num_attention_heads": 12, "num_key_value_heads": 4, "num_hidden_layers": 4,
              "intermediate_size": 2048, "vocab_size": 1000, "max_position_embeddings": 512}
    return ModelSpec.from_config("test", {**config, **overrides})


def test_rule4_kv_heads_split_or_replicated_never_partly():
    assert tensor_parallel_problem(_spec(), 2) is None         # 4 KV heads split in 2
    assert tensor_parallel_problem(_spec(), 4) is None         # one KV head per rank
    assert tensor_parallel_problem(_spec(num_key_value_heads=2), 4) is None  # replicated
    problem = tensor_parallel_problem(_spec(num_key_value_heads=3, num_attention_heads=12), 4)
    assert "3 KV heads" in problem


def test_rule4_intermediate_size_must_divide():
    problem = tensor_parallel_problem(_spec(intermediate_size=2050), 4)
    assert problem == "intermediate_size 2050 is not divisible by tensor_parallel_size 4"


def test_rule4_quantization_group_must_divide_the_rank_share():
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    spec = _spec(intermediate_size=2304, quantization_config=gptq)
    assert tensor_parallel_problem(spec, 2) is None  # 1152 = 9 groups per rank
    assert "gptq group_size 128 does not divide the intermediate size per rank (2304 / 4 = " \
        "576)" in tensor_parallel_problem(spec, 4)
    # act-order: every rank keeps all groups (found through g_idx), so only whole packed words matter
    act_order = _spec(intermediate_size=2304, quantization_config={**gptq, "desc_act": True})
    assert tensor_parallel_problem(act_order, 4) is None
    assert tensor_parallel_problem(_spec(intermediate_size=2312, quantization_config={**gptq, "desc_act": True}),
                                   2) == ("gptq act-order: 4-bit words of 8 rows do not divide the intermediate "
                                          "size per rank (2312 / 2 = 1156)")
    # the AWQ release of Qwen2.5-72B pads its intermediate size so that tp 8 keeps groups whole
    assert tensor_parallel_problem(load_model("Qwen/Qwen2.5-72B-Instruct-AWQ").spec, 8) is None


def test_rule5_pcie_prefers_pipeline_parallel():
    plan = plan_for("Qwen/Qwen2.5-14B-Instruct", "3xL4")
    assert layout(plan) == (1, 3, 1)
    assert any(line.startswith("rule 5") for line in plan.rationale)
    nvlink = plan_for("Qwen/Qwen2.5-32B-Instruct", "2xA100-40GB", max_model_len=8192)
    assert layout(nvlink) == (2, 1, 1)


def test_rule5_is_an_input_not_an_override():
    """Over PCIe the rules prefer pipeline stages; a tensor-parallel layout estimated more than
    1/PREFERENCE_MARGIN faster still wins, and the rationale says by how much."""
    pcie = plan_for("Qwen/Qwen2.5-32B-Instruct", "2xRTXA6000", max_model_len=8192)
    assert layout(pcie) == (2, 1, 1)
    line = next(x for x in pcie.rationale if x.startswith("rule 5 (pipeline"))
    assert "prefers tp=1 pp=2 dp=1, but this layout is estimated" in line
    pp = next(a for a in pcie.alternatives if a["pipeline_parallel_size"] == 2)
    assert pcie.chosen.estimates.output_tokens_per_s * PREFERENCE_MARGIN > pp["output_tokens_per_s"]
    moe = plan_for("Qwen/Qwen3-30B-A3B", "4xA10G")  # the issue's case: pp 4 lost to tp 4's numbers
    assert layout(moe)[0] == 4


def test_rule6_executor():
    assert plan_for(LLAMA_70B, "8xH100").executor == "mp"
    assert plan_for(LLAMA_405B, "2x8xH100").executor == "ray"
    assert plan_for(LLAMA_70B, "8xH100", distributed_executor_backend="ray").executor == "ray"
    with pytest.raises(PlanError, match="mp runs on one node"):
        plan_for(LLAMA_405B, "2x8xH100", distributed_executor_backend="mp")


def test_rule6_replicas_across_nodes_use_ray():
    plan = plan_for(LLAMA_8B, "2x8xH100-80GB")
    assert layout(plan) == (1, 1, 16) and plan.executor == "ray"


def test_rule7_split_balances_memory_and_runtime_uses_the_same_split():
    plan = plan_for("Qwen/Qwen2.5-14B-Instruct", "3xL4")
    split = list(plan.chosen.split)
    # the embedding and the untied LM head each weigh ~2.7 layers: end stages hold fewer layers
    assert split[0] < split[1] and split[2] < split[1]
    weights = [s.weights_bytes for s in plan.chosen.memory.stages]
    assert max(weights) - min(weights) < 2 * (weights[1] / split[1])
    assert plan.model.layer_split(1, 3, "bfloat16") == split


def test_pins_are_respected():
    plan = plan_for(LLAMA_70B, "8xH100", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout(plan)[:2] == (2, 2)
    assert layout(plan_for(LLAMA_8B, "8xH100", data_parallel_size=3)) == (1, 1, 3)


def test_pinned_layout_larger_than_the_hardware_is_refused():
    with pytest.raises(PlanError, match="tensor parallel stays inside a node"):
        plan_for(LLAMA_8B, "2x4xA100-80GB", tensor_parallel_size=8)
    with pytest.raises(PlanError, match="needs 16 GPUs; the hardware has 8"):
        plan_for(LLAMA_8B, "8xH100", tensor_parallel_size=8, pipeline_parallel_size=2)
    with pytest.raises(PlanError, match="more stages than the model's 12 layers"):
        plan_for("gpt2", "2x8xH100", pipeline_parallel_size=16)


def test_moe_and_other_families_plan():
    for model, hardware in [("Qwen/Qwen3-30B-A3B", "H100"), ("mistralai/Mixtral-8x7B-v0.1",
                            "4xA100-80GB"), ("Qwen/Qwen1.5-MoE-A2.7B", "2xL40S"),
                            ("facebook/opt-13b", "2xA10G"), ("gpt2", "T4"),
                            ("mistralai/Mistral-7B-v0.1", "A10G")]:
        d = plan_for(model, hardware).to_dict()
        assert d["memory"]["kv_cache_tokens"] >= d["runtime"]["max_model_len"]


def test_a_pinned_layout_is_credited_to_the_settings_not_a_rule():
    plan = plan_for(LLAMA_8B, "2x8xH100-80GB", pipeline_parallel_size=2)
    assert layout(plan)[1] == 2
    assert "layout pinned by the settings: pipeline_parallel_size=2" in plan.rationale
    assert not any(line.startswith(("rule 1", "rule 2", "rule 3", "rule 4", "rule 5"))
                   for line in plan.rationale)
