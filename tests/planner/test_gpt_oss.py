"""gpt-oss in the planner: MXFP4 experts (4-bit values and a byte of scale per 32 inputs) beside bfloat16
attention and embeddings, every layer's K and V cached in full (windowed layers too), and the splits
that would cut an MXFP4 group refused."""

import pytest

from shardserve.planner import PlanError, load_model

from tests.planner.factories import plan_for

SMALL, LARGE = "openai/gpt-oss-20b", "openai/gpt-oss-120b"
GIB = 2**30


@pytest.mark.parametrize("model, billions", [(SMALL, 20.91), (LARGE, 116.83)])
def test_parameter_counts_match_published(model, billions):
    """OpenAI's model card: 20.91B and 116.83B parameters (the MXFP4 bytes hold two each)."""
    assert load_model(model).num_params / 1e9 == pytest.approx(billions, rel=0.001)


def test_weights_are_mxfp4_experts_and_bfloat16_rest():
    """120b: 36 layers x 128 experts x (2 x 2880 x 2880 gate|up + 2880 x 2880 down) values at 4.25 bits
    (4-bit values, a byte of scale per 32), every other tensor in bfloat16: the released 60.8 GiB."""
    model = load_model(LARGE)
    spec = model.spec
    assert (spec.dtype, spec.quantization.method, spec.quantization.group_size) == ("bfloat16", "mxfp4", 32)
    expert_values = 36 * 128 * 3 * 2880 * 2880
    expert_bytes = sum(t.stored_bytes for t in model.tensors if t.name.endswith(("_blocks", "_scales")))
    assert expert_bytes == expert_values // 2 + expert_values // 32
    assert all(t.dtype == "BF16" for t in model.tensors if t.is_float and not t.name.endswith("sinks"))
    plan = plan_for(LARGE, "H100")
    assert plan.chosen.memory.stages[0].weights_bytes / GIB == pytest.approx(60.8, abs=0.1)


def test_windowed_layers_keep_only_their_window():
    """A block table for the 12 full-attention layers and one for the 12 windowed ones (planner/kv_groups.py):
    a page is a block of 12 layers, and a long request holds every block of the first table but only its
    window's of the second."""
    spec = load_model(SMALL).spec
    plan = plan_for(SMALL, "H100").to_dict()
    assert plan["model"]["kv_bytes_per_token"] == 24 * 2 * 8 * 64 * 2  # every layer's K and V, before windows
    assert spec.kv_groups.windows == (None, 128) and spec.kv_groups.group_size == 12
    mem = plan["memory"]
    length = plan["runtime"]["max_model_len"]
    full = -(-length // 16)
    assert mem["kv_cache_tokens"] > mem["num_blocks"] * 16 // 2  # more than if both kinds kept every token
    assert round(mem["num_blocks"] / mem["max_concurrency"]) in range(full + 1, 2 * full)


def test_splits_that_cut_an_mxfp4_group_are_refused():
    """2880 / 4 = 720 inputs per rank is not whole groups of 32: tp 4 needs whole experts per rank."""
    with pytest.raises(PlanError, match=r"mxfp4 group_size 32 does not divide the intermediate size per rank"):
        plan_for(LARGE, "4xL40S", tensor_parallel_size=4, enable_expert_parallel=False)
    plan = plan_for(LARGE, "4xL40S", tensor_parallel_size=4, enable_expert_parallel=True).to_dict()
    assert plan["parallel"]["enable_expert_parallel"]


def test_one_l40s_is_refused_with_the_layout_that_fits():
    with pytest.raises(PlanError, match=r"2xL40S would fit \(1 more GPU\)"):
        plan_for(LARGE, "L40S")
