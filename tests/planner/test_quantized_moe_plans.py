"""Quantized experts in the planner: the catalog's fp8, AWQ and GPTQ mixture-of-experts releases plan with
their stored weight bytes, and tensor parallel keeps whole quantization groups and fp8 blocks per rank
(or deals whole experts out)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardserve.planner import load_model
from shardserve.planner.model_spec import QuantSpec
from shardserve.planner.rules import expert_parallel_reason, tensor_parallel_problem
from shardserve.planner.sharding import total_weight_bytes

from tests.planner.factories import plan_for

# (release, its float model, weight GB as stored, that of the float model): the releases' file sizes
RELEASES = [("Qwen/Qwen3-30B-A3B-FP8", "Qwen/Qwen3-30B-A3B", 31.2, 61.1),
            ("TheBloke/Mixtral-8x7B-Instruct-v0.1-AWQ", "mistralai/Mixtral-8x7B-Instruct-v0.1", 24.7, 93.4),
            ("Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4", "Qwen/Qwen1.5-MoE-A2.7B", 8.3, 28.6)]


def weight_gb(model_id: str) -> float:
    info = load_model(model_id)
    return total_weight_bytes(info.spec, info.groups, info.spec.dtype) / 1e9


@pytest.mark.parametrize("release, base, release_gb, base_gb", RELEASES, ids=[r[0] for r in RELEASES])
def test_quantized_moe_releases_plan_with_their_stored_bytes(release, base, release_gb, base_gb):
    assert weight_gb(release) == pytest.approx(release_gb, rel=0.02)
    assert weight_gb(base) == pytest.approx(base_gb, rel=0.02)
    plan = plan_for(release, "H100")
    assert plan.model.spec.quantization is not None and plan.model.spec.is_moe
    assert str(plan.chosen.layout) == "tp=1 pp=1 dp=1"


def test_fp8_blocks_a_split_would_cut_keep_experts_whole():
    """Qwen3-30B-A3B-FP8 at tp 8: 768 / 8 = 96 features per expert and rank cut its 128x128 blocks, so the
    experts go whole to the ranks (16 each), and the plan says why."""
    spec = load_model("Qwen/Qwen3-30B-A3B-FP8").spec
    assert tensor_parallel_problem(spec, 8) == ("fp8 weight blocks 128x128 do not divide the intermediate size "
                                                "per rank (768 / 8 = 96)")
    assert tensor_parallel_problem(spec, 8, expert_parallel=True) is None
    assert expert_parallel_reason(spec, 8) == "splitting experts would cut fp8 weight blocks (768 / 8 = 96)"
    plan = plan_for("Qwen/Qwen3-30B-A3B-FP8", "8xH100-80GB", tensor_parallel_size=8)
    assert plan.chosen.expert_parallel


def test_the_shared_expert_keeps_whole_groups():
    """Qwen1.5-MoE's shared expert stays split under expert parallel: with groups of 256, its 5632 / 4 = 1408
    features per rank would cut one."""
    spec = load_model("Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4").spec
    assert tensor_parallel_problem(spec, 4, expert_parallel=True) is None
    wider = replace(spec, quantization=QuantSpec("gptq", 4, 256))
    assert tensor_parallel_problem(wider, 4, expert_parallel=True) == (
        "gptq group_size 256 does not divide the shared expert intermediate size per rank (5632 / 4 = 1408)")
