"""Every setting of the table reaches every layer that declares it: set through `plan`, `launch` (its
flags and a profile) and `LLM(...)`, then read back from the plan or the engine's config. A setting
added to planner/settings.py without a way through fails here (no read-back known for it)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.main import get_command
from typer.testing import CliRunner

from shardserve.launch.cli import app
from shardserve.launch.cli_options import launch_command_settings, plan_command_settings
from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.launch.launcher import engine_kwargs, settle
from shardserve.planner.plan_file import PlanFile
from shardserve.planner.settings import ENGINE, PLAN, SERVER, SETTINGS, SettingError, names
from shardserve.runtime import LLM, AsyncEngine
from shardserve.planner.speculative import SpeculativeConfig

DEMO = str(DEMO_MODEL_DIR)
SMALL_POOL = 1 << 25  # 32 MiB: room for 3 requests of the demo's 2048 tokens
# a value other than the default for each setting, valid for the demo model (4 layers) on CPU
VALUES = {
    "model": DEMO, "download_dir": "/tmp/hf-models", "revision": "v1", "hf_token": "hf_t",  # a folder ignores the three
    "hardware": "2xcpu", "device": "cpu", "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
    "data_parallel_size": 2, "distributed_executor_backend": "mp", "layer_split": (3, 1), "max_model_len": 512,
    "dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": SMALL_POOL,
    "enable_expert_parallel": False,  # the default is None (the planner's choice); True needs a MoE model
    "block_size": 32, "max_num_seqs": 8, "max_num_batched_tokens": 1024, "enable_prefix_caching": False,
    "kv_offloading_size": 0.25,
    "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 3, "lora_modules": ["a=/x"],
    "enable_runtime_lora_updating": True,
    "load_format": "safetensors", "enable_chunked_prefill": True,  # the only value served (False is refused)
    "enforce_eager": True, "async_scheduling": True, "seed": 7,
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}', "chat_template": "{{ messages[0].content }}", "generation_config": "vllm",
    "runner": "pooling", "pooling_type": "MEAN", "normalize": False,
    "skip_tokenizer_init": True, "target_concurrency": 3, "host": "127.0.0.2",
    "port": 8123, "served_model_name": "tiny", "max_queued_requests": 5, "allowed_origins": ["https://app.example"],
    "shutdown_timeout": 2.5, "queue_timeout": 5.0, "max_request_body_bytes": 4096, "grammar_compile_timeout": 0.5,
    "request_read_timeout": 12.0, "record_trace": "/tmp/never-written.jsonl",
    "trust_request_chat_template": True,
    "max_logprobs": 64, "return_tokens_as_token_ids": True, "enable_force_include_usage": True,
    "enable_prompt_tokens_details": True, "enable_tokenizer_info_endpoint": True, "enable_server_load_tracking": True,
    "root_path": "/llm", "routing_policy": "least_loaded",
    "tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "qwen3",
    "env": {"SHARDSERVE_T": "1"},
    "description": "a note",
    # the traffic and targets a plan is for (the demo on CPU meets these loose targets)
    "input_len": 300, "output_len": 100, "prefix_len": 50, "concurrency": 4.0, "request_rate": 2.0,
    "ttft_ms": 100000.0, "tpot_ms": 10000.0, "target_percentile": 90, "draft_acceptance_rate": 0.5,
}
# settings that only make sense together (a split needs its stages)
COMPANIONS = {"pooling_type": {"runner": "pooling"}, "normalize": {"runner": "pooling"},
              "layer_split": {"pipeline_parallel_size": 2}, "distributed_executor_backend": {"tensor_parallel_size": 2},
              "ttft_ms": {"concurrency": 2.0}, "tpot_ms": {"request_rate": 1.0},
              "draft_acceptance_rate": {"speculative_config": VALUES["speculative_config"]},
              **{name: {"enable_lora": True} for name in ("max_loras", "max_lora_rank", "max_cpu_loras",
                                                          "lora_modules", "enable_runtime_lora_updating")}}
PLAN_READBACK = {
    "tensor_parallel_size": lambda p: p.parallel.tensor_parallel_size,
    "pipeline_parallel_size": lambda p: p.parallel.pipeline_parallel_size,
    "data_parallel_size": lambda p: p.parallel.data_parallel_size,
    "distributed_executor_backend": lambda p: p.parallel.distributed_executor_backend,
    "enable_expert_parallel": lambda p: p.parallel.enable_expert_parallel,
    "max_model_len": lambda p: p.runtime.max_model_len, "dtype": lambda p: p.runtime.dtype,
    "quantization": lambda p: p.runtime.quantization,
    "kv_cache_dtype": lambda p: p.runtime.kv_cache_dtype,
    "gpu_memory_utilization": lambda p: p.runtime.gpu_memory_utilization,
    "kv_cache_memory_bytes": lambda p: p.runtime.kv_cache_memory_bytes, "block_size": lambda p: p.runtime.block_size,
    "max_num_seqs": lambda p: p.runtime.max_num_seqs,
    "max_num_batched_tokens": lambda p: p.runtime.max_num_batched_tokens,
    "enable_prefix_caching": lambda p: p.runtime.enable_prefix_caching,
    "kv_offloading_size": lambda p: p.runtime.kv_offloading_size,
    "enforce_eager": lambda p: p.runtime.enforce_eager,
    "enable_lora": lambda p: p.runtime.enable_lora, "max_loras": lambda p: p.runtime.max_loras,
    "max_lora_rank": lambda p: p.runtime.max_lora_rank,
    "speculative_config": lambda p: VALUES["speculative_config"]  # every key written, as the JSON given reads
    if SpeculativeConfig.parse(p.runtime.speculative_config) == SpeculativeConfig.parse(VALUES["speculative_config"])
    else p.runtime.speculative_config,
    # the plan keeps KV room for target_concurrency full-length requests
    "target_concurrency": lambda p: min(3, int(p.memory.max_concurrency)),
    **{name: (lambda n: lambda p: getattr(p.service, n))(name) for name in (
        "input_len", "output_len", "prefix_len", "concurrency", "request_rate", "ttft_ms", "tpot_ms",
        "target_percentile", "draft_acceptance_rate")},
}
ENGINE_READBACK = {
    "model": lambda c: c.model.model, "device": lambda c: c.device,
    # where a Hub id is looked up: kept beside the folder it resolved to (a folder ignores them)
    "download_dir": lambda c: c.model.hub.download_dir, "revision": lambda c: c.model.hub.revision,
    "hf_token": lambda c: c.model.hub.hf_token,
    "tensor_parallel_size": lambda c: c.parallel.tensor_parallel_size,
    "pipeline_parallel_size": lambda c: c.parallel.pipeline_parallel_size,
    "distributed_executor_backend": lambda c: c.parallel.distributed_executor_backend,
    "layer_split": lambda c: c.parallel.layer_split,
    "enable_expert_parallel": lambda c: c.parallel.enable_expert_parallel, "max_model_len": lambda c: c.model.max_model_len,
    "dtype": lambda c: str(c.model.dtype).removeprefix("torch."),
    "quantization": lambda c: c.model.quantization.format, "kv_cache_dtype": lambda c: c.cache.kv_cache_dtype,
    "gpu_memory_utilization": lambda c: c.cache.gpu_memory_utilization,
    "kv_cache_memory_bytes": lambda c: c.cache.kv_cache_memory_bytes, "block_size": lambda c: c.cache.block_size,
    "max_num_seqs": lambda c: c.scheduler.max_num_seqs,
    "max_num_batched_tokens": lambda c: c.scheduler.max_num_batched_tokens,
    "enable_prefix_caching": lambda c: c.cache.enable_prefix_caching,
    "kv_offloading_size": lambda c: c.cache.kv_offloading_size, "enforce_eager": lambda c: c.model.enforce_eager,
    "load_format": lambda c: c.model.load_format,
    "enable_chunked_prefill": lambda c: c.scheduler.enable_chunked_prefill,
    "async_scheduling": lambda c: c.scheduler.async_scheduling, "seed": lambda c: c.seed,
    "speculative_config": lambda c: VALUES["speculative_config"]  # the parsed config, as the JSON reads
    if c.scheduler.speculative == SpeculativeConfig.parse(VALUES["speculative_config"]) else c.scheduler.speculative, "skip_tokenizer_init": lambda c: c.model.skip_tokenizer_init,
    "chat_template": lambda c: c.model.chat_template, "generation_config": lambda c: c.model.generation_config,
    "runner": lambda c: c.model.runner, "pooling_type": lambda c: c.model.pooler.pooling_type,
    "normalize": lambda c: c.model.pooler.normalize,
    "enable_lora": lambda c: c.lora is not None, "max_loras": lambda c: c.lora.max_loras,
    "max_lora_rank": lambda c: c.lora.max_lora_rank, "max_cpu_loras": lambda c: c.lora.max_cpu_loras,
}


def test_every_setting_has_a_value_and_a_read_back_for_each_of_its_layers():
    assert set(VALUES) == {s.name for s in SETTINGS}
    assert set(names(PLAN)) == set(PLAN_READBACK)
    assert set(names(ENGINE)) == set(ENGINE_READBACK)


def test_the_commands_take_every_setting_of_their_layers():
    commands = get_command(app).commands
    plan_params = {p.name for p in commands["plan"].params}
    launch_params = {p.name for p in commands["launch"].params}
    assert set(names(PLAN)) <= plan_params and set(plan_command_settings()) <= plan_params
    assert set(launch_command_settings()) <= launch_params
    # a list has no flag of its own: --set layer_split=[3,1] (env has --env NAME=VALUE)
    assert {s.name for s in SETTINGS if s.in_profile} - launch_params == {"layer_split", "description"}


@pytest.mark.parametrize("name", names(PLAN))
def test_plan_flag_reaches_the_plan(name):
    args = ["plan", "--model", DEMO, "--hardware", "2xcpu", "--format", "json", *flag_args(name)]
    for companion, value in COMPANIONS.get(name, {}).items():
        args += flag_args(companion, value)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = PlanFile.from_dict(json.loads(result.output), "stdout")
    assert PLAN_READBACK[name](plan) == VALUES[name]


def flag_args(name: str, value=None) -> list[str]:
    value = VALUES[name] if value is None else value
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, str(value)]


def engine_case(name: str) -> dict:
    settings = {"device": "cpu", "kv_cache_memory_bytes": SMALL_POOL, name: VALUES[name]}
    return settings | COMPANIONS.get(name, {})


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in names(ENGINE) if n != "model"])
def test_llm_keyword_reaches_the_engine_config(name):
    kwargs = engine_case(name)
    with LLM(DEMO, **kwargs) as llm:
        assert ENGINE_READBACK[name](llm.engine.config) == VALUES[name]
    torch.set_num_threads(1)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["flags", "profile"])
@pytest.mark.parametrize("name", [s.name for s in SETTINGS if s.in_profile and s.name not in ("model", "hardware")])
def test_launch_setting_reaches_its_layers(tmp_path, source, name):
    """launch settles profile < plan < flags, plans on 2 CPU ranks, then each layer gets its share."""
    values = {"model": DEMO, "hardware": "2xcpu", "kv_cache_memory_bytes": SMALL_POOL, name: VALUES[name],
              **COMPANIONS.get(name, {})}
    if source == "profile":
        path = tmp_path / "p.yaml"
        path.write_text(yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}))
        config, plan = settle(None, str(path), {}, None)
    else:
        config, plan = settle(None, None, values, None)
    setting = next(s for s in SETTINGS if s.name == name)
    if SERVER in setting.layers or setting.layers == {"profile"}:
        assert getattr(config, name) == VALUES[name]
    if PLAN in setting.layers:
        assert PLAN_READBACK[name](plan) == VALUES[name]
    if ENGINE in setting.layers:
        kwargs = engine_kwargs(config)
        engine = AsyncEngine(DEMO, **kwargs)
        try:
            assert ENGINE_READBACK[name](engine.engine.config) == VALUES[name]
        finally:
            engine.engine.shutdown()


def test_a_setting_the_engine_does_not_act_on_is_refused_by_name():
    with pytest.raises(SettingError, match="data_parallel_size is not used here"):
        LLM(DEMO, data_parallel_size=2)
    with pytest.raises(SettingError, match="unknown setting 'max_num_seqz'"):
        LLM(DEMO, max_num_seqz=2)


@pytest.mark.slow
def test_expert_parallel_on_reaches_the_moe_layers(tmp_path):
    """True (the demo is dense, so VALUES holds False): a MoE folder at tp 2 through plan, launch and the ranks."""
    from tests.runtime.runtime_checkpoints import save_checkpoint

    folder = str(tmp_path / "moe")
    save_checkpoint(folder, "qwen3_moe")
    config, plan = settle(None, None, {"model": folder, "hardware": "2xcpu", "tensor_parallel_size": 2,
                                       "enable_expert_parallel": True, "kv_cache_memory_bytes": SMALL_POOL}, None)
    assert plan.parallel.enable_expert_parallel is True
    assert any(line.startswith("rule 8: expert parallel") for line in plan.rationale)
    engine = AsyncEngine(folder, **engine_kwargs(config))
    try:
        assert [s.enable_expert_parallel for s in engine.engine.executor.states] == [True, True]
    finally:
        engine.engine.shutdown()


def test_expert_parallel_on_a_dense_model_is_a_clear_cli_error():
    result = CliRunner().invoke(app, ["plan", "--model", DEMO, "--hardware", "2xcpu", "--enable-expert-parallel"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "enable_expert_parallel: " in result.output and "has no routed experts" in result.output


AUTO_POOL = 1 << 22  # 4 MiB: under one request of the demo's 2048 tokens, so auto picks fewer


def test_max_model_len_auto_is_the_longest_the_plans_kv_cache_holds():
    result = CliRunner().invoke(app, ["plan", "--model", DEMO, "--hardware", "cpu", "--format", "json",
                                      "--max-model-len", "auto", "--kv-cache-memory-bytes", str(AUTO_POOL)])
    assert result.exit_code == 0, result.output
    plan = PlanFile.from_dict(json.loads(result.output), "stdout")
    assert plan.runtime.max_model_len == plan.memory.num_blocks * plan.memory.block_size < 2048
    assert any(line.startswith(f"max_model_len auto: {plan.runtime.max_model_len}") for line in plan.rationale)
    bad = CliRunner().invoke(app, ["plan", "--model", DEMO, "--hardware", "cpu", "--max-model-len", "long"])
    assert bad.exit_code != 0 and "max_model_len='long' must be a whole number" in bad.output


@pytest.mark.parametrize("source", ["flags", "profile"])
def test_launch_applies_the_plans_number_for_auto(tmp_path, source):
    values = {"model": DEMO, "hardware": "cpu", "kv_cache_memory_bytes": AUTO_POOL, "max_model_len": "auto"}
    if source == "profile":
        path = tmp_path / "p.yaml"
        path.write_text(yaml.safe_dump(values))
        config, plan = settle(None, str(path), {}, None)
    else:
        config, plan = settle(None, None, values, None)
    assert config.max_model_len == plan.runtime.max_model_len == plan.memory.kv_cache_tokens
    assert engine_kwargs(config)["max_model_len"] == plan.runtime.max_model_len


def test_auto_is_the_only_word_max_model_len_takes():
    from shardserve.launch.deploy_config import validate
    from shardserve.planner import PlanError, PlanOptions

    assert PlanOptions(max_model_len="auto").max_model_len == "auto"
    with pytest.raises(SettingError, match=r"max_model_len='long' must be a whole number .* or 'auto'"):
        PlanOptions(max_model_len="long")
    with pytest.raises(SettingError, match="max_model_len=0 must be at least 1"):
        PlanOptions(max_model_len=0)
    with pytest.raises(PlanError, match="max_model_len"):
        validate({"max_model_len": "long"}, "profile")
    assert validate({"max_model_len": "auto"}, "profile").max_model_len == "auto"


def test_llm_max_model_len_auto_measures_the_same_number_as_the_plan():
    """The no-plan path: the runtime fits max_model_len to the pool it measured, with the planner's function."""
    result = CliRunner().invoke(app, ["plan", "--model", DEMO, "--hardware", "cpu", "--format", "json",
                                      "--max-model-len", "auto", "--kv-cache-memory-bytes", str(AUTO_POOL)])
    planned = PlanFile.from_dict(json.loads(result.output), "stdout").runtime.max_model_len
    with LLM(DEMO, device="cpu", kv_cache_memory_bytes=AUTO_POOL, max_model_len="auto") as llm:
        assert llm.engine.config.model.max_model_len == llm.kv_cache_info.max_model_len == planned
        assert llm.engine.scheduler.max_model_len == llm.engine.input_processor.max_model_len == planned
        assert llm.kv_cache_info.max_concurrency == 1.0
    torch.set_num_threads(1)
