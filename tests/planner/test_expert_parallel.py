"""Expert parallel in the planner: chosen where split experts get too thin (or would cut quantization
groups), forced either way by enable_expert_parallel, explained in the rationale, refused by name where it
cannot run, and accounted per rank."""

from __future__ import annotations

from dataclasses import replace

import pytest

from factories import plan_for
from shardserve.planner import PlanError, PlanOptions, load_model, parse_declared
from shardserve.planner.memory import activation_bytes
from shardserve.planner.model_spec import QuantSpec
from shardserve.planner.options import resolve_settings
from shardserve.planner.rules import expert_parallel_reason, tensor_parallel_problem

QWEN3_MOE, MIXTRAL, QWEN15_MOE = "Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-Instruct-v0.1", "Qwen/Qwen1.5-MoE-A2.7B"


def rule_8(plan) -> str:
    (line,) = [line for line in plan.rationale if line.startswith("rule 8")]
    return line


def test_thin_split_experts_choose_expert_parallel():
    plan = plan_for(QWEN3_MOE, "8xH100-80GB", tensor_parallel_size=8)
    assert plan.chosen.expert_parallel and plan.record().parallel.enable_expert_parallel
    assert rule_8(plan) == ("rule 8: expert parallel: 16 of the 128 experts whole on each rank, attention tensor "
                            "parallel: splitting experts leaves 768 / 8 = 96 features per expert and rank, below "
                            "an efficient GEMM width of 128")


def test_wide_experts_stay_split():
    plan = plan_for(MIXTRAL, "8xH100-80GB", tensor_parallel_size=8)
    assert not plan.chosen.expert_parallel and not plan.record().parallel.enable_expert_parallel
    assert rule_8(plan) == ("rule 8: experts split by tensor parallel (1792 features per expert and rank): "
                            "GEMMs stay wide enough")


def test_experts_that_do_not_divide_stay_split_and_say_so():
    spec = replace(load_model(QWEN15_MOE).spec, moe_intermediate_size=512)  # 64 per rank at tp 8: thin
    assert expert_parallel_reason(spec, 8) is None  # 60 experts over 8 ranks: uneven, so not an option
    plan = plan_for(QWEN15_MOE, "8xH100-80GB", tensor_parallel_size=8)
    assert not plan.chosen.expert_parallel
    assert rule_8(plan) == ("rule 8: experts split by tensor parallel (176 features per expert and rank): 60 "
                            "experts do not divide evenly over tensor_parallel_size 8 (every rank holds as many "
                            "experts)")


@pytest.mark.parametrize("model, forced", [(QWEN3_MOE, False), (MIXTRAL, True)])
def test_the_user_forces_it_either_way(model, forced):
    plan = plan_for(model, "8xH100-80GB", tensor_parallel_size=8, enable_expert_parallel=forced)
    assert plan.chosen.expert_parallel is forced
    assert rule_8(plan).endswith(f"as enable_expert_parallel={forced} asks")


def test_uneven_experts_are_refused_by_name():
    with pytest.raises(PlanError, match="enable_expert_parallel: 60 experts do not divide evenly over "
                                        "tensor_parallel_size 8"):
        plan_for(QWEN15_MOE, "8xH100-80GB", tensor_parallel_size=8, enable_expert_parallel=True)


def test_a_dense_model_is_refused_by_name():
    with pytest.raises(PlanError, match="enable_expert_parallel: meta-llama/Llama-3.1-8B-Instruct has no "
                                        "routed experts"):
        plan_for("meta-llama/Llama-3.1-8B-Instruct", "2xH100-80GB", enable_expert_parallel=True)


def test_one_rank_has_nothing_to_explain():
    plan = plan_for(QWEN3_MOE, "1xH100-80GB", max_model_len=4096)
    assert plan.chosen.layout.tensor_parallel_size == 1 and not plan.chosen.expert_parallel
    assert not [line for line in plan.rationale if line.startswith("rule 8")]


def test_quantization_groups_a_split_would_cut_choose_expert_parallel():
    spec = replace(load_model(QWEN3_MOE).spec, moe_intermediate_size=1536,
                   quantization=QuantSpec("gptq", 4, 256))  # 1536 / 8 = 192: not whole groups of 256
    assert "would cut gptq groups of 256 (1536 / 8 = 192)" in expert_parallel_reason(spec, 8)
    assert "group_size 256 does not divide the intermediate size per rank" in tensor_parallel_problem(spec, 8)
    assert tensor_parallel_problem(spec, 8, expert_parallel=True) is None  # experts whole: groups whole


def test_per_rank_weights_reflect_the_layout():
    """num_experts / tp whole experts weigh what 1/tp of every expert does; the rest is laid out alike."""
    split = plan_for(QWEN3_MOE, "8xH100-80GB", tensor_parallel_size=8, enable_expert_parallel=False)
    whole = plan_for(QWEN3_MOE, "8xH100-80GB", tensor_parallel_size=8, enable_expert_parallel=True)
    model = load_model(QWEN3_MOE)
    assert (model.sharded(8, "bfloat16", 1, True).expert_bytes
            == pytest.approx(model.sharded(1, "bfloat16", 1).expert_bytes / 8))
    assert whole.chosen.memory.tightest.weights_bytes == pytest.approx(split.chosen.memory.tightest.weights_bytes)


def test_activations_reflect_whole_experts():
    """The kernel's gate-up buffer holds every pair's features of its expert: all of them on an expert-parallel
    rank, 1/tp of them when experts are split."""
    spec = load_model(QWEN3_MOE).spec
    settings = resolve_settings(PlanOptions(), spec, parse_declared("8xH100-80GB").gpu)
    split, whole = (activation_bytes(spec, 8, settings, False, ep) for ep in (False, True))
    pairs = settings.max_num_batched_tokens * spec.num_experts_per_tok
    assert whole - split == pairs * (768 - 768 // 8) * settings.dtype_bytes
