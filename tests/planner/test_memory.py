"""The memory model: KV bytes, whole blocks, the tightest stage, and plans that cannot fit."""

import re

import pytest

from shardserve.planner import InfeasibleError, PlanError
from shardserve.planner.memory import kv_heads_per_rank

from tests.planner.factories import plan_for

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def test_kv_bytes_per_token_is_two_layers_heads_head_dim_bytes():
    d = plan_for(LLAMA_8B, "H100").to_dict()
    assert d["model"]["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    fp8 = plan_for(LLAMA_8B, "H100", kv_cache_dtype="fp8").to_dict()
    assert fp8["model"]["kv_bytes_per_token"] == 2 * 32 * 8 * 128
    assert fp8["memory"]["kv_cache_tokens"] >= 2 * d["memory"]["kv_cache_tokens"] - 16


def test_kv_cache_in_whole_blocks_and_concurrency():
    d = plan_for(LLAMA_8B, "H100", max_model_len=8192, block_size=32).to_dict()
    mem = d["memory"]
    assert mem["kv_cache_tokens"] == mem["num_blocks"] * 32
    assert mem["max_concurrency"] == round(mem["kv_cache_tokens"] / 8192, 2)
    per_gpu = mem["per_gpu"]
    assert per_gpu["kv_cache_bytes"] == mem["kv_cache_tokens"] * d["model"]["kv_bytes_per_token"]
    used = sum(per_gpu[k] for k in ("weights_bytes", "activation_bytes", "overhead_bytes",
                                    "kv_cache_bytes"))
    assert used <= per_gpu["total_bytes"] * 0.9


def test_weights_match_the_parameter_count():
    d = plan_for(LLAMA_8B, "H100").to_dict()
    assert d["model"]["num_params"] == 8_030_261_248  # Llama-3.1-8B's published count
    assert d["model"]["weight_bytes"] == 2 * 8_030_261_248


def test_tensor_parallel_shards_weights_and_kv():
    one = plan_for("meta-llama/Llama-3.1-70B-Instruct", "8xH100", tensor_parallel_size=8)
    stage = one.chosen.memory.stages[0]
    assert stage.weights_bytes == pytest.approx(one.weight_bytes / 8, rel=0.01)
    assert stage.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # one of 8 KV heads per rank


def test_kv_heads_replicated_when_tp_exceeds_them():
    plan = plan_for("Qwen/Qwen3-30B-A3B", "8xH100", tensor_parallel_size=8)
    model = plan.model.spec
    assert model.num_kv_heads == 4 and kv_heads_per_rank(model, 8) == 1
    assert plan.chosen.memory.stages[0].kv_bytes_per_token == 2 * 48 * 1 * 128 * 2
    assert any("KV heads are replicated" in w for w in plan.warnings)


def test_gpu_memory_utilization_moves_the_kv_budget():
    low = plan_for(LLAMA_8B, "H100", gpu_memory_utilization=0.5).to_dict()["memory"]
    high = plan_for(LLAMA_8B, "H100", gpu_memory_utilization=0.9).to_dict()["memory"]
    extra = (0.4 * 81559 * 2**20) / (2 * 32 * 8 * 128 * 2)
    assert high["kv_cache_tokens"] - low["kv_cache_tokens"] == pytest.approx(extra, abs=32)


def test_cannot_fit_says_what_would():
    with pytest.raises(InfeasibleError) as info:
        plan_for("meta-llama/Llama-3.1-405B-Instruct", "8xH100-80GB")
    assert info.value.exit_code == 2
    assert "2x8xH100-80GB would fit (8 more GPUs)" in str(info.value)


def test_cannot_fit_context_suggests_max_model_len():
    with pytest.raises(InfeasibleError, match=r"--max-model-len (\d+) would fit") as info:
        plan_for(LLAMA_8B, "L4")
    suggested = int(re.search(r"--max-model-len (\d+)", str(info.value)).group(1))
    plan = plan_for(LLAMA_8B, "L4", max_model_len=suggested)
    assert plan.chosen.memory.kv_cache_tokens >= suggested
    assert "2xL4 would fit (1 more GPU)" in str(info.value)


def test_cannot_fit_suggests_fp8_kv_cache():
    with pytest.raises(InfeasibleError, match="--kv-cache-dtype fp8 would fit"):
        plan_for(LLAMA_8B, "H100", target_concurrency=5)
    assert plan_for(LLAMA_8B, "H100", target_concurrency=5, kv_cache_dtype="fp8")


def test_target_concurrency_adds_gpus():
    assert plan_for("meta-llama/Llama-3.1-70B-Instruct", "8xH100",
                    target_concurrency=10).chosen.layout.gpus_per_replica == 8


def test_cpu_plan_uses_the_runtime_kv_pool():
    d = plan_for("gpt2", "cpu").to_dict()
    assert d["runtime"]["device"] == "cpu" and d["runtime"]["dtype"] == "float32"
    kv_per_token = 2 * 12 * 12 * 64 * 4
    assert d["memory"]["kv_cache_tokens"] == (2 * 2**30 // (kv_per_token * 16)) * 16


def test_the_cpu_tier_is_counted_in_host_memory_and_tokens():
    """kv_offloading_size: GiB per replica over its ranks; a block costs every rank its share."""
    plan = plan_for(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1,
                    kv_offloading_size=16)
    d = plan.to_dict()
    per_rank_block = 16 * 2 * 32 * 4 * 128 * 2  # 16 tokens x K and V x 32 layers x 4 KV heads a rank x 128 x bf16
    blocks = 16 * 2**30 // (per_rank_block * 2)
    assert d["memory"]["offload_tokens"] == blocks * 16 == 131072
    assert d["memory"]["offload_bytes"] == blocks * per_rank_block * 2 <= 16 * 2**30
    assert d["runtime"]["kv_offloading_size"] == 16
    assert any(line.startswith("CPU tier (kv_offloading_size 16 GiB): 131072 tokens per replica")
               for line in d["rationale"])
    plain = plan_for(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=2, pipeline_parallel_size=1,
                     data_parallel_size=1).to_dict()
    assert "offload_tokens" not in plain["memory"] and "kv_offloading_size" not in plain["runtime"]
    assert plain["memory"]["kv_cache_tokens"] == d["memory"]["kv_cache_tokens"]  # GPU memory is untouched


def test_a_cpu_tier_that_holds_nothing_or_serves_nothing_is_refused():
    with pytest.raises(PlanError, match=r"^kv_offloading_size 1e-06 GiB holds no KV block \(2097152 bytes across"):
        plan_for(LLAMA_8B, "H100", kv_offloading_size=1e-6)
    with pytest.raises(PlanError, match="kv_offloading_size needs enable_prefix_caching"):
        plan_for(LLAMA_8B, "H100", kv_offloading_size=1.0, enable_prefix_caching=False)


def test_lora_slots_come_out_of_the_kv_cache_and_turn_graphs_off():
    """max_loras slots of max_lora_rank on every rank, q|k|v and gate|up split as the runtime keeps them:
    per layer A over the rank's inputs of each part and B over its outputs, in bf16."""
    plain = plan_for(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1)
    lora = plan_for(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1,
                    enable_lora=True, max_loras=4, max_lora_rank=64)
    d, p = lora.to_dict(), plain.to_dict()
    a = 3 * 4096 + 4096 // 2 + 2 * 4096 + 14336 // 2  # qkv's parts, o_proj's half, gate|up, down_proj's half
    b = (4096 // 2 + 2 * 4 * 128) + 4096 + 2 * 14336 // 2 + 4096
    assert d["memory"]["per_gpu"]["lora_bytes"] == 4 * (a + b) * 64 * 32 * 2 == 905969664
    assert "lora_bytes" not in p["memory"]["per_gpu"]
    assert d["runtime"]["enable_lora"] and d["runtime"]["max_loras"] == 4 and d["runtime"]["max_lora_rank"] == 64
    # the slots come out of the KV cache, but the CUDA graphs LoRA runs without give memory back
    graphs = p["memory"]["per_gpu"]["overhead_bytes"] - d["memory"]["per_gpu"]["overhead_bytes"]
    assert graphs > 0
    kv_change = p["memory"]["per_gpu"]["kv_cache_bytes"] - d["memory"]["per_gpu"]["kv_cache_bytes"]
    block = 16 * 2 * 32 * 4 * 128 * 2
    assert abs(kv_change - (905969664 - graphs)) < block
    assert any(line.startswith("LoRA: 4 adapter slot(s) of rank up to 64 take 864.0 MiB per GPU")
               for line in d["rationale"])
    with pytest.raises(PlanError, match="MixtralForCausalLM is not served with LoRA adapters"):
        plan_for("mistralai/Mixtral-8x7B-Instruct-v0.1", "8xH100-80GB", enable_lora=True)
