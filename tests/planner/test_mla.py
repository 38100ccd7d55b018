"""Multi-head latent attention (DeepSeek-V2/V3) in the planner: the cache is one latent and one rotated
key per token and layer, whole on every tensor-parallel rank; the catalog releases plan across nodes."""

import pytest

from shardserve.planner import InfeasibleError, load_model

from tests.planner.factories import plan_for

V3, V2_LITE = "deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V2-Lite"


def test_kv_bytes_are_the_latent_and_the_rotated_key_per_layer():
    spec = load_model(V3).spec
    assert spec.mla is not None and spec.mla.cache_width == 512 + 64
    assert spec.kv_bytes_per_token(2) == 61 * 576 * 2  # 70,272 (K and V of 128 heads: 61 * 2 * 128 * 128 * 2)
    assert spec.head_dim == 128 + 64  # the query/key width of a head
    lite = plan_for(V2_LITE, "H100").to_dict()
    assert lite["model"]["kv_bytes_per_token"] == 27 * 576 * 2
    assert lite["memory"]["per_gpu"]["kv_cache_bytes"] == lite["memory"]["kv_cache_tokens"] * 27 * 576 * 2


def test_tensor_parallel_does_not_split_the_latent_cache():
    """Each rank holds every token's whole latent (the heads split, the latent does not): per rank the
    same bytes per token at tp 1, 2 and 4."""
    per_rank = {tp: plan_for(V2_LITE, "4xH100", tensor_parallel_size=tp).chosen.memory.stages[0].kv_bytes_per_token
                for tp in (1, 2, 4)}
    assert per_rank == {1: 27 * 576 * 2, 2: 27 * 576 * 2, 4: 27 * 576 * 2}


@pytest.mark.parametrize("model, billions", [(V3, 671.07), (V2_LITE, 15.71), ("deepseek-ai/DeepSeek-V2", 235.74)])
def test_catalog_parameter_counts_match_published(model, billions):
    """DeepSeek publishes 671B (V3 without its 14B MTP layer), 15.7B and 236B."""
    assert load_model(model).num_params / 1e9 == pytest.approx(billions, rel=0.002)


@pytest.mark.parametrize("hardware, tp, pp, dp", [("2x8xH200", 8, 1, 2), ("2x8xH100", 8, 2, 1)])
def test_deepseek_v3_fp8_across_two_nodes(hardware, tp, pp, dp):
    """On H200s one node holds the fp8 weights (a replica per node); on H100s the two nodes form one
    replica, pipeline stages across them; experts whole per rank either way."""
    plan = plan_for(V3, hardware)
    parallel = plan.to_dict()["parallel"]
    assert (parallel["tensor_parallel_size"], parallel["pipeline_parallel_size"], parallel["data_parallel_size"]) == (
        tp, pp, dp)
    assert parallel["enable_expert_parallel"] and parallel["distributed_executor_backend"] == "ray"
    assert plan.model.spec.quantization.block_shape == (128, 128)
    stages = plan.chosen.memory.stages
    assert [s.kv_bytes_per_token for s in stages] == [n * 576 * 2 for n in parallel["layer_split"]]
    assert any("caches 576 values per layer" in line and "not the KV cache" in line for line in plan.rationale)


def test_one_node_of_h100_is_refused_with_the_layout_that_fits():
    with pytest.raises(InfeasibleError, match=r"2x8xH100-80GB would fit \(8 more GPUs\)"):
        plan_for(V3, "8xH100")
