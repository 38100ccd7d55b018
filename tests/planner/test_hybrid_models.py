"""Linear-attention hybrids (Qwen3-Next, Qwen3.5/3.6): their configs read, their weights counted, their
recurrent state sized apart from the KV cache, and other hybrids refused by the kind of layer not served."""

import io
import json
import re
from typing import Any

import pytest
import transformers
from rich.console import Console

from shardserve.launch.plan_view import render_plan
from shardserve.planner import PlanError
from shardserve.planner.catalog import model_catalog
from shardserve.planner.hardware import GIB, GpuSpec
from shardserve.planner.linear_attention import recurrent_state_bytes, recurrent_state_slots
from shardserve.planner.memory import plan_memory
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.operators import Chunk, Operators, stage_step_ms
from shardserve.planner.plan_file import PlanFile
from shardserve.planner.rules import tensor_parallel_problem
from shardserve.planner.schema import plan_record
from shardserve.planner.speed import database_for, stage_shapes
from shardserve.planner.tensors import derive_tensors

from tests.planner.factories import plan_for

SMALL: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
             linear_conv_kernel_dim=4, vocab_size=320)
MOE: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# architecture -> (transformers config, model class) of a tiny model, built in the test
TINY = {
    "Qwen3_5ForCausalLM": lambda: (transformers.Qwen3_5TextConfig(intermediate_size=96, **SMALL),
                                   transformers.Qwen3_5ForCausalLM),
    "Qwen3_5ForConditionalGeneration": lambda: (
        transformers.Qwen3_5Config(text_config=dict(intermediate_size=96, **SMALL)),
        transformers.Qwen3_5ForConditionalGeneration),
    "Qwen3_5MoeForCausalLM": lambda: (transformers.Qwen3_5MoeTextConfig(**SMALL, **MOE),
                                      transformers.Qwen3_5MoeForCausalLM),
    "Qwen3_5MoeForConditionalGeneration": lambda: (transformers.Qwen3_5MoeConfig(text_config=dict(**SMALL, **MOE)),
                                                   transformers.Qwen3_5MoeForConditionalGeneration),
    "Qwen3NextForCausalLM": lambda: (transformers.Qwen3NextConfig(intermediate_size=96, mlp_only_layers=[1],
                                                                  **SMALL, **MOE),
                                     transformers.Qwen3NextForCausalLM),
}
HYBRIDS = [k for k in model_catalog() if model_catalog()[k]["architectures"][0] in TINY]
LINEAR, FULL = "linear_attention", "full_attention"
GPU = GpuSpec("X", 80 * GIB, 3e12, 1e15, 1e15, True, "nvlink", 4e11)


def tiny_spec(arch: str) -> ModelSpec:
    config, _ = TINY[arch]()
    return ModelSpec.from_config("tiny", {**config.to_dict(), "architectures": [arch]})


def folder(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("arch", TINY)
def test_spec_reads_the_hybrid_config(arch):
    spec = tiny_spec(arch)
    la = spec.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel_dim) == \
        (2, 4, 8, 16, 4)
    assert spec.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert spec.has_recurrent_layers and spec.recurrent_kind == "Gated DeltaNet"
    assert spec.has_attention_output_gate and spec.partial_rotary_factor == 0.25
    assert (spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (64, 4, 2, 16)
    if "Moe" in arch or "Next" in arch:
        assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size,
                spec.shared_expert_intermediate_size) == (8, 2, 32, 48)
        assert spec.moe_layers == ((0, 2, 3, 4, 5, 6, 7) if "Next" in arch else tuple(range(8)))
    else:
        assert not spec.is_moe and spec.intermediate_size == 96


@pytest.mark.parametrize("arch", TINY)
def test_parameter_count_is_transformers(arch):
    torch = pytest.importorskip("torch")
    config, model_class = TINY[arch]()
    with torch.device("meta"):
        model = model_class(config)
    # the vision tower of a multimodal checkpoint is not loaded, so not counted
    theirs = sum(p.numel() for name, p in model.named_parameters() if ".visual." not in f".{name}")
    assert sum(t.numel for t in derive_tensors(tiny_spec(arch))) == theirs


def test_older_configs_give_the_full_attention_interval(tmp_path):
    config = {**SMALL, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "intermediate_size": 96,
              **MOE, "max_position_embeddings": 4096}
    spec = ModelSpec.from_config("next", {**config, "full_attention_interval": 2})
    assert spec.layer_types == (LINEAR, FULL) * 4
    assert ModelSpec.from_config("next", config).layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2  # transformers' 4
    with pytest.raises(PlanError, match="layer_types has linear_attention layers, which llama models do not have"):
        ModelSpec.from_config("llama", {**SMALL, "architectures": ["LlamaForCausalLM"], "intermediate_size": 96,
                                        "max_position_embeddings": 4096, "layer_types": [LINEAR, FULL] * 4})


def test_state_bytes_per_request_and_layer():
    la = tiny_spec("Qwen3_5ForCausalLM").linear_attention
    # conv: (2 * key_dim + value_dim) / tp channels x (kernel - 1), in the model dtype; delta rule: float32
    assert la.state_bytes_per_layer(1, 2) == (2 * 16 + 64) * 3 * 2 + 4 * 8 * 16 * 4
    assert la.state_bytes_per_layer(2, 2) == (16 + 32) * 3 * 2 + 2 * 8 * 16 * 4
    spec = plan_for("Qwen/Qwen3.5-397B-A17B", "2x8xH100-80GB").model.spec  # 16 key, 64 value heads of 128
    per_layer = (2 * 2048 + 8192) * 3 * 2 + 64 * 128 * 128 * 4
    assert spec.linear_attention.state_bytes_per_layer(1, 2) == per_layer
    assert recurrent_state_bytes(spec, 8, range(60), recurrent_state_slots(256), 2) == 45 * per_layer // 8 * 257


def test_state_and_kv_split_by_stage_and_rank():
    spec = tiny_spec("Qwen3_5ForCausalLM")  # layers 3 and 7 full attention
    settings = plan_for("Qwen/Qwen3.5-0.8B", "H100-80GB", max_num_seqs=16).settings
    one = plan_memory(spec, [0.0], [8], 1, GPU, settings).stages[0]
    rows, per_layer = 17, (2 * 16 + 64) * 3 * 2 + 4 * 8 * 16 * 4  # max_num_seqs and the scratch row
    assert one.recurrent_state_bytes == 6 * per_layer * rows
    assert one.kv_bytes_per_token == 2 * 2 * 2 * 16 * settings.kv_dtype_bytes  # two full layers of 2 KV heads
    two = plan_memory(spec, [0.0], [8], 2, GPU, settings).stages[0]
    assert two.recurrent_state_bytes == 6 * ((16 + 32) * 3 * 2 + 2 * 8 * 16 * 4) * rows
    for stage in (one, two):  # the state comes out of the budget before blocks are counted
        assert stage.kv_budget_bytes + stage.recurrent_state_bytes + stage.activation_bytes + stage.overhead_bytes \
            == int(GPU.memory_bytes * settings.gpu_memory_utilization)
    first, second = plan_memory(spec, [0.0, 0.0], [5, 3], 1, GPU, settings).stages  # layers 0-4 | 5-7
    assert (first.recurrent_state_bytes, second.recurrent_state_bytes) == (4 * per_layer * rows, 2 * per_layer * rows)
    assert first.kv_bytes_per_token == second.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert spec.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2


def test_linear_stages_hold_no_kv():
    spec = tiny_spec("Qwen3_5ForCausalLM")
    settings = plan_for("Qwen/Qwen3.5-0.8B", "H100-80GB").settings
    memory = plan_memory(spec, [0.0, 0.0], [3, 5], 1, GPU, settings)  # layers 0-2: linear only
    assert memory.stages[0].kv_bytes_per_token == 0
    assert memory.num_blocks == memory.stages[1].num_blocks_fit(settings.block_size)


def test_tensor_parallel_must_split_the_linear_heads():
    spec = tiny_spec("Qwen3_5ForCausalLM")  # 2 key heads, 4 value heads
    assert tensor_parallel_problem(spec, 2) is None
    assert tensor_parallel_problem(spec, 4) == ("linear_num_key_heads 2 is not divisible by tensor_parallel_size 4 "
                                                "(each rank holds whole linear-attention heads and their state)")


def test_linear_layers_cost_no_attention_over_the_context():
    plan = plan_for("Qwen/Qwen3.5-9B", "H100-80GB")
    spec, hw = plan.model.spec, plan.hardware
    ops = Operators(hw.gpu, database_for(hw), hw.gpu.link_bytes_per_s)
    (shape,) = stage_shapes(spec, [spec.num_layers], 1, False, plan.settings, hw)
    assert shape.num_linear_layers == 24 and shape.num_window_layers == 0
    short, long = (stage_step_ms(ops, shape, 32, context, ()) for context in (1_000, 100_000))
    dense_like = type(shape)(**{**shape.__dict__, "num_linear_layers": 0})
    dense_short, dense_long = (stage_step_ms(ops, dense_like, 32, context, ()) for context in (1_000, 100_000))
    assert long - short < (dense_long - dense_short) / 2  # a quarter of the layers read the context
    assert stage_step_ms(ops, shape, 0, 0, (Chunk(2048, 2048),)) > 0


@pytest.mark.parametrize("model_id", HYBRIDS)
def test_catalog_hybrids_plan(model_id):
    plan = plan_for(model_id, "2x8xH100-80GB")
    record = plan_record(plan)
    stage = record.memory.per_gpu
    assert stage.recurrent_state_bytes and stage.kv_cache_bytes > 0
    assert record.model.kv_bytes_per_token == plan.model.spec.kv_bytes_per_token(plan.settings.kv_dtype_bytes)
    assert PlanFile.from_dict(record.to_dict(), "plan.yaml") == record
    console = Console(file=io.StringIO(), width=160)
    render_plan(record, console)
    assert "Recurrent state of the linear-attention layers" in console.file.getvalue()


def test_small_hybrids_plan_on_one_gpu_and_old_plans_read():
    for model_id, options in (("Qwen/Qwen3.5-0.8B", {}), ("Qwen/Qwen3.5-9B", {}),
                              ("Qwen/Qwen3.5-27B", {"max_num_seqs": 32, "max_model_len": 65536})):
        plan = plan_for(model_id, "H100-80GB", **options)
        assert plan.chosen.layout.num_gpus == 1 and not plan.settings.enable_prefix_caching
    data = plan_record(plan).to_dict()
    for stage in [data["memory"]["per_gpu"], *data["memory"]["per_stage"]]:
        del stage["recurrent_state_bytes"]  # a plan written before the field
    assert PlanFile.from_dict(data, "old.yaml").memory.per_gpu.recurrent_state_bytes is None


def test_too_many_state_rows_are_named_with_the_max_num_seqs_that_fits(tmp_path):
    with pytest.raises(PlanError, match=r"recurrent state 36\.8 GiB \(max_num_seqs 256\) exceed") as info:
        plan_for("Qwen/Qwen3.5-27B", "H100-80GB")
    fits = int(re.search(r"--max-num-seqs (\d+) would fit", str(info.value)).group(1))
    assert plan_for("Qwen/Qwen3.5-27B", "H100-80GB", max_num_seqs=fits).chosen.layout.num_gpus == 1


@pytest.mark.parametrize("arch,kind", [("NemotronHForCausalLM", "Mamba-2"), ("JambaForCausalLM", "Mamba"),
                                       ("FalconH1ForCausalLM", "Mamba-2"), ("GraniteMoeHybridForCausalLM", "Mamba-2"),
                                       ("Zamba2ForCausalLM", "Mamba-2")])
def test_other_hybrids_are_refused_by_their_layers(tmp_path, arch, kind):
    path = folder(tmp_path, architectures=[arch], hidden_size=64, num_hidden_layers=4, vocab_size=320)
    with pytest.raises(PlanError, match=f"architecture {arch} is not served: {kind} layers are not served by the "
                                        "runtime \\(the recurrent hybrids served are Gated DeltaNet with attention: "
                                        "Qwen3NextForCausalLM, "):
        plan_for(path, "H100-80GB")
