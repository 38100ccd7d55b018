"""Model sources: folders (safetensors headers), the HF cache, the catalog, and bad input."""

import json
from pathlib import Path

import pytest
import torch
import transformers

from shardserve.planner import PlanError, load_model
from shardserve.planner.model_source import DEMO_MODEL_NAME, demo_model_dir, is_demo_model
from shardserve.planner.model_spec import SUPPORTED_ARCHITECTURES, QuantSpec
from shardserve.planner.sharding import total_weight_bytes

from tests.planner.factories import plan_for

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)


def save(folder, config, model_cls, **kwargs):
    torch.manual_seed(0)
    model = model_cls(config)
    model.save_pretrained(folder, **kwargs)
    return model


@pytest.mark.parametrize("name, config, model_cls", [
    ("llama", transformers.LlamaConfig(**TINY), transformers.LlamaForCausalLM),
    ("qwen2", transformers.Qwen2Config(**TINY), transformers.Qwen2ForCausalLM),
    ("qwen3", transformers.Qwen3Config(**TINY, head_dim=32), transformers.Qwen3ForCausalLM),
    ("mixtral", transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
     transformers.MixtralForCausalLM),
    ("qwen2_moe", transformers.Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, decoder_sparse_step=2,
                                              shared_expert_intermediate_size=48),
     transformers.Qwen2MoeForCausalLM),
    ("qwen3_moe", transformers.Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, mlp_only_layers=[1]),
     transformers.Qwen3MoeForCausalLM),
    ("gpt2", transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=128,
                                     vocab_size=300), transformers.GPT2LMHeadModel),
    ("opt", transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=3,
                                   num_attention_heads=4, vocab_size=300,
                                   max_position_embeddings=128, word_embed_proj_dim=64),
     transformers.OPTForCausalLM),
])
def test_folder_sizes_come_from_safetensors_headers(tmp_path, name, config, model_cls):
    model = save(tmp_path, config, model_cls)
    info = load_model(str(tmp_path))
    assert info.tensors_from == "safetensors" and info.source == "folder"
    assert info.num_params == model.num_parameters()
    d = plan_for(str(tmp_path), "cpu").to_dict()
    assert d["model"]["weight_bytes"] == 4 * model.num_parameters()  # float32 on CPU
    # the config-derived tensor list agrees with the checkpoint
    (tmp_path / "model.safetensors").unlink()
    derived = load_model(str(tmp_path))
    assert derived.tensors_from == "config"
    assert derived.num_params == model.num_parameters()


def test_sharded_checkpoint_reads_every_file(tmp_path):
    model = save(tmp_path, transformers.LlamaConfig(**TINY), transformers.LlamaForCausalLM,
                 max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert load_model(str(tmp_path)).num_params == model.num_parameters()


def test_hf_cache_lookup(tmp_path, monkeypatch):
    snapshot = tmp_path / "models--acme--tiny-llama" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-llama" / "refs" / "main").write_text("abc123")
    transformers.LlamaConfig(**TINY).save_pretrained(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    info = load_model("acme/tiny-llama")
    assert info.source == "hf-cache" and info.spec.num_layers == 4


def test_catalog_ids_case_insensitive_and_short():
    assert load_model("META-LLAMA/llama-3.1-8b-instruct").spec.num_layers == 32
    assert load_model("Qwen3-32B").spec.num_attention_heads == 64


def test_catalog_has_the_promised_models():
    for model in ["meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B",
                  "meta-llama/Llama-3.1-405B", "meta-llama/Llama-2-7b-hf",
                  "meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-70b-hf",
                  "mistralai/Mistral-7B-v0.1", "mistralai/Mixtral-8x7B-v0.1",
                  "mistralai/Mixtral-8x22B-v0.1", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-14B",
                  "Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-72B", "Qwen/Qwen3-8B", "Qwen/Qwen3-32B",
                  "Qwen/Qwen3-30B-A3B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", "gpt2",
                  "facebook/opt-13b"]:
        assert load_model(model).source == "catalog"


@pytest.mark.parametrize("model, billions", [
    ("meta-llama/Llama-3.1-70B-Instruct", 70.55), ("meta-llama/Llama-3.1-405B", 405.85),
    ("mistralai/Mixtral-8x7B-v0.1", 46.70), ("Qwen/Qwen3-30B-A3B", 30.53),
    ("Qwen/Qwen2.5-72B-Instruct", 72.71), ("gpt2", 0.124), ("facebook/opt-13b", 12.85),
    ("Qwen/Qwen3-0.6B", 0.596), ("Qwen/Qwen3-235B-A22B", 235.0),
])
def test_catalog_parameter_counts_match_published(model, billions):
    assert load_model(model).num_params / 1e9 == pytest.approx(billions, rel=0.005)


def test_quantized_weight_bytes():
    """Sized exactly, and planned with those bytes."""
    fp8, bf16 = (load_model(m) for m in ("meta-llama/Llama-3.1-405B-Instruct-FP8",
                                         "meta-llama/Llama-3.1-405B-Instruct"))
    ratio = (total_weight_bytes(fp8.spec, fp8.groups, "bfloat16")
             / total_weight_bytes(bf16.spec, bf16.groups, "bfloat16"))
    assert 0.5 < ratio < 0.53  # embeddings stay 16-bit
    assert plan_for("meta-llama/Llama-3.1-405B-Instruct-FP8", "2x8xH100").model.spec.quantization.method == "fp8"
    awq = load_model("Qwen/Qwen2.5-72B-Instruct-AWQ")
    assert awq.spec.quantization.bits == 4 and awq.spec.quantization.group_size == 128


def write_config(folder, **config):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_missing_config(tmp_path):
    with pytest.raises(PlanError, match="has no config.json"):
        load_model(str(tmp_path))


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PlanError, match="is not valid JSON"):
        load_model(str(tmp_path))


def test_missing_required_field_is_named(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], **TINY}
    del config["num_attention_heads"]
    with pytest.raises(PlanError, match="config.json has no num_attention_heads"):
        load_model(write_config(tmp_path / "m", **config))


def test_unsupported_architecture_lists_supported(tmp_path):
    path = write_config(tmp_path / "m", architectures=["FalconForCausalLM"], **TINY)
    with pytest.raises(PlanError) as info:
        load_model(path)
    assert "FalconForCausalLM is not supported" in str(info.value)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_unknown_model_id():
    with pytest.raises(PlanError, match="not in the catalog: the catalog's .* ids are in "):
        load_model("nobody/nothing-7b")


def test_mistyped_model_id_suggests_the_closest():
    with pytest.raises(PlanError) as info:
        load_model("meta-llama/Llama-3.1-70B-Instruc")
    message = str(info.value)
    assert "did you mean meta-llama/Llama-3.1-70B-Instruct" in message
    assert message.count(", ") < 3  # a suggestion, not the whole catalog


def test_demo_name_is_its_folder_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    info = load_model(DEMO_MODEL_NAME)
    assert Path(info.path).resolve() == demo_model_dir().resolve()
    assert is_demo_model(DEMO_MODEL_NAME) and is_demo_model(str(demo_model_dir()) + "/")
    assert not is_demo_model("meta-llama/Llama-3.1-8B")


def test_unknown_quantization(tmp_path):
    path = write_config(tmp_path / "m", architectures=["LlamaForCausalLM"],
                        quantization_config={"quant_method": "bitsandbytes"}, **TINY)
    with pytest.raises(PlanError, match="quant_method 'bitsandbytes' is not served; served formats: "
                                        "awq, gptq, fp8, compressed-tensors"):
        load_model(path)


def test_compressed_tensors_fp8_is_planned_as_fp8(tmp_path):
    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}
    qc = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights}}}
    path = write_config(tmp_path / "m", architectures=["LlamaForCausalLM"], quantization_config=qc, **TINY)
    assert load_model(path).spec.quantization == QuantSpec("fp8", 8, None, None)
    qc["config_groups"]["group_0"]["weights"] = {"num_bits": 4, "type": "int", "strategy": "group"}
    path = write_config(tmp_path / "n", architectures=["LlamaForCausalLM"], quantization_config=qc, **TINY)
    with pytest.raises(PlanError, match="compressed-tensors weights of type 'int' with 4 bits are not served"):
        load_model(path)


@pytest.mark.parametrize("quantized, base, method, most", [
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8", "meta-llama/Llama-3.1-8B-Instruct", "fp8", 0.6),
    ("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "meta-llama/Llama-3.1-70B-Instruct", "awq", 0.3),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "Qwen/Qwen2.5-7B-Instruct", "gptq", 0.4),
    ("Qwen/Qwen3-8B-FP8", "Qwen/Qwen3-8B", "fp8", 0.6),
    ("Qwen/Qwen3-32B-AWQ", "Qwen/Qwen3-32B", "awq", 0.3),
])
def test_catalog_quantized_releases_weigh_their_stored_bytes(quantized, base, method, most):
    plan = plan_for(quantized, "8xH100-80GB").record()
    assert plan.model.quantization["method"] == method
    assert plan.model.weight_bytes < most * plan_for(base, "8xH100-80GB").record().model.weight_bytes


def test_a_short_name_says_which_catalog_id_it_became():
    """`plan --model llama-3.1-70b` planned the base model and said nothing; the plan's warnings now name the id
    and the catalog's variants of it (the chat model)."""
    plan = plan_for("llama-3.1-70b", "8xH100-80GB")
    assert plan.model.spec.id == "meta-llama/Llama-3.1-70B"
    note = "model llama-3.1-70b is the catalog's meta-llama/Llama-3.1-70B (also in the catalog: " \
           "meta-llama/Llama-3.1-70B-Instruct"
    assert any(w.startswith(note) for w in plan.warnings), plan.warnings
    assert not any("is the catalog's" in w for w in plan_for("meta-llama/Llama-3.1-70B", "8xH100-80GB").warnings)
