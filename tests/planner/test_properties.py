"""Invariants of every plan, for random model configs and hardware (hypothesis)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardserve.planner import InfeasibleError, PlanOptions, make_plan
from shardserve.planner.catalog import gpu_catalog
from shardserve.planner.hardware import GpuSpec, Hardware, Node
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.tensors import derive_tensors


@st.composite
def models(draw):
    heads = draw(st.sampled_from([4, 8, 12, 16, 32, 40, 64]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8, heads) if heads % k == 0]))
    head_dim = draw(st.sampled_from([64, 128]))
    arch = draw(st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM"]))
    config = {"architectures": [arch], "hidden_size": heads * head_dim,
              "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": draw(st.integers(2, 96)),
              "intermediate_size": draw(st.integers(1, 64)) * 256 * draw(st.sampled_from([1, 3])),
              "vocab_size": draw(st.integers(1000, 160000)),
              "max_position_embeddings": draw(st.sampled_from([2048, 8192, 32768, 131072])),
              "tie_word_embeddings": draw(st.booleans()), "torch_dtype": "bfloat16"}
    if arch == "MixtralForCausalLM":
        config |= {"num_local_experts": draw(st.sampled_from([4, 8])), "num_experts_per_tok": 2}
    spec = ModelSpec.from_config("random", config)
    return ModelInfo(spec, tuple(derive_tensors(spec)), "catalog", None, "config")


@st.composite
def hardware(draw):
    gpu = GpuSpec.from_catalog(draw(st.sampled_from(sorted(gpu_catalog()))))
    per_node = draw(st.integers(1, 8))
    nodes = draw(st.integers(1, 4))
    return Hardware("declared", tuple(Node(gpu, per_node) for _ in range(nodes)),
                    gpu.interconnect)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models(), hw=hardware(), max_len=st.sampled_from([None, 1024, 4096]),
       gmu=st.floats(0.5, 0.95), block_size=st.sampled_from([8, 16, 32]))
def test_plan_invariants(model, hw, max_len, gmu, block_size):
    if max_len:
        max_len = min(max_len, model.spec.max_position_embeddings)
    options = PlanOptions(max_model_len=max_len, gpu_memory_utilization=gmu,
                          block_size=block_size)
    try:
        plan = make_plan(model, hw, options)
    except InfeasibleError as e:
        assert "would fit" in str(e) or "does not fit" in str(e)
        return
    d = plan.to_dict()
    par, mem = d["parallel"], d["memory"]
    tp, pp, dp = (par["tensor_parallel_size"], par["pipeline_parallel_size"],
                  par["data_parallel_size"])
    assert tp * pp * dp <= hw.total_gpus
    assert tp <= hw.gpus_per_node
    assert sum(par["layer_split"]) == model.spec.num_layers and len(par["layer_split"]) == pp
    assert min(par["layer_split"]) >= 1
    assert mem["kv_cache_tokens"] % block_size == 0
    assert mem["kv_cache_tokens"] == mem["num_blocks"] * block_size
    assert mem["kv_cache_tokens"] >= d["runtime"]["max_model_len"]
    for stage in mem["per_stage"]:  # no GPU over budget
        used = (stage["weights_bytes"] + stage["activation_bytes"] + stage["overhead_bytes"]
                + stage["kv_cache_bytes"])
        assert used <= stage["total_bytes"] * gmu
    est = d["estimates"]
    assert est["decode_tokens_per_s_batch1"] > 0 and est["output_tokens_per_s"] > 0
    # full batches: at least one user's tokens/s, and no user faster than one request decoding alone
    assert est["output_tokens_per_s"] >= est["output_tokens_per_s_per_user"] * 0.99
    assert est["output_tokens_per_s_per_user"] <= est["decode_tokens_per_s_batch1"] * 1.01
    assert est["ttft_ms"] > 0 and est["max_request_rate"] > 0
