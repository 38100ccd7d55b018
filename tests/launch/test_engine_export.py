"""`plan --format vllm|sglang`: a real plan as the other engine's serve command, flag for flag, with what
has no equivalent named and what differs in meaning noted."""

from __future__ import annotations

import dataclasses
import shlex
import shutil

import pytest
from typer.testing import CliRunner

from shardserve.launch import engine_export
from shardserve.launch.cli import app
from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.launch.engine_export import HANDLED_SETTINGS, MOE_ARCHITECTURES, export_plan
from shardserve.planner import load_model
from shardserve.planner.catalog import model_catalog
from shardserve.planner.plan_file import ParallelSection, PlanFile, RuntimeSection, ServiceSection
from shardserve.planner.served import ARCHITECTURES
from tests.planner.factories import plan_for

LLAMA_8B, QWEN_14B, LLAMA_405B = ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-14B-Instruct",
                                  "meta-llama/Llama-3.1-405B-Instruct")
QWEN3_MOE = "Qwen/Qwen3-30B-A3B"


def record(model: str, hardware: str, **options):
    return plan_for(model, hardware, **options).record()


def shell_words(text: str) -> list[str]:
    """The words a shell runs for rendered text (comment lines dropped, continuations joined)."""
    command = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return shlex.split(command.replace("\\\n", " "))


def test_a_single_gpu_replica_plan_on_vllm():
    plan = record(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=1, pipeline_parallel_size=1)
    par, rt = plan.parallel, plan.runtime
    cmd = export_plan(plan, "vllm")
    assert cmd.program == ("vllm", "serve", LLAMA_8B)
    assert cmd.options == {
        "--tensor-parallel-size": "1", "--pipeline-parallel-size": "1",
        "--data-parallel-size": str(par.data_parallel_size), "--max-model-len": str(rt.max_model_len),
        "--dtype": rt.dtype, "--max-num-seqs": str(rt.max_num_seqs),
        "--max-num-batched-tokens": str(rt.max_num_batched_tokens)}
    assert par.data_parallel_size == 8 and rt.dtype == "bfloat16"  # spare GPUs became replicas (rule 1)
    assert cmd.env == () and cmd.unsupported == () and cmd.how_to_run == ()  # defaults: nothing more


def test_the_same_plan_on_sglang():
    plan = record(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=1, pipeline_parallel_size=1)
    rt, mem = plan.runtime, plan.memory
    cmd = export_plan(plan, "sglang")
    assert cmd.program == ("python", "-m", "sglang.launch_server")
    options = cmd.options
    assert options["--model-path"] == LLAMA_8B
    assert (options["--tp-size"], options["--pp-size"], options["--dp-size"]) == ("1", "1", "8")
    assert options["--context-length"] == str(rt.max_model_len)
    assert options["--max-running-requests"] == str(rt.max_num_seqs)
    assert options["--chunked-prefill-size"] == str(rt.max_num_batched_tokens)
    assert options["--page-size"] == str(rt.block_size) == "16"
    fraction = float(options["--mem-fraction-static"])  # weights + KV, not gpu_memory_utilization
    expected = (mem.per_gpu.weights_bytes + mem.per_gpu.kv_cache_bytes) / plan.hardware.gpu.memory_bytes
    assert expected - 0.001 < fraction <= expected < rt.gpu_memory_utilization
    assert any(n.startswith(f"--mem-fraction-static {fraction:.3f} ") and "gpu_memory_utilization 0.9" in n
               for n in cmd.notes)
    assert any(n.startswith("--chunked-prefill-size") for n in cmd.notes)
    assert not {"--ep-size", "--nnodes", "--disable-radix-cache", "--disable-cuda-graph"} & set(options)


@pytest.mark.parametrize("engine, variable", [("vllm", "VLLM_PP_LAYER_PARTITION"),
                                              ("sglang", "SGLANG_PP_LAYER_PARTITION")])
def test_an_uneven_pipeline_split_travels_as_the_engines_partition_variable(engine, variable):
    plan = record(QWEN_14B, "3xL4", tensor_parallel_size=1, pipeline_parallel_size=3)
    split = plan.parallel.layer_split
    assert len(set(split)) > 1 and sum(split) == plan.model.num_layers, split  # uneven, as rule 7 chose
    cmd = export_plan(plan, engine)
    assert cmd.env == ((variable, ",".join(map(str, split))),)
    assert shell_words(cmd.render())[0] == f"{variable}={','.join(map(str, split))}"
    assert "no equivalent" not in cmd.render()


def test_a_pipeline_on_vllm_names_its_executor():
    plan = record(QWEN_14B, "3xL4", tensor_parallel_size=1, pipeline_parallel_size=3)
    options = export_plan(plan, "vllm").options
    assert options["--pipeline-parallel-size"] == "3"
    assert options["--distributed-executor-backend"] == plan.parallel.distributed_executor_backend == "mp"


def test_expert_parallel_moe():
    plan = record(QWEN3_MOE, "8xH100-80GB", tensor_parallel_size=8)
    assert plan.parallel.enable_expert_parallel  # rule 8: 768 / 8 features per expert and rank is thin
    vllm, sglang = export_plan(plan, "vllm"), export_plan(plan, "sglang")
    assert "--enable-expert-parallel" in vllm.options and vllm.options["--enable-expert-parallel"] is None
    assert vllm.options["--tensor-parallel-size"] == "8"
    assert sglang.options["--ep-size"] == sglang.options["--tp-size"] == "8"
    assert not any("couples the replicas" in n for n in vllm.notes)  # one replica: same meaning


def test_moe_replicas_are_coupled_in_vllm_and_it_says_so():
    plan = record(QWEN3_MOE, "8xH100-80GB", tensor_parallel_size=4, enable_expert_parallel=True)
    assert plan.parallel.data_parallel_size == 2
    (note,) = [n for n in export_plan(plan, "vllm").notes if "couples the replicas" in n]
    assert "all 2 x 4 ranks" in note and "--data-parallel-size 1" in note
    assert export_plan(plan, "sglang").options["--ep-size"] == "4"


def test_multi_node_on_vllm_runs_on_ray():
    plan = record(LLAMA_405B, "2x8xH100-80GB", tensor_parallel_size=8, pipeline_parallel_size=2)
    assert plan.hardware.nodes == 2 and plan.parallel.distributed_executor_backend == "ray"
    cmd = export_plan(plan, "vllm")
    assert cmd.options["--distributed-executor-backend"] == "ray"
    assert (cmd.options["--tensor-parallel-size"], cmd.options["--pipeline-parallel-size"]) == ("8", "2")
    assert cmd.env == (("VLLM_PP_LAYER_PARTITION", ",".join(map(str, plan.parallel.layer_split))),)
    (how,) = cmd.how_to_run
    assert "ray start --head --port=6379` on HEAD_IP" in how and "ray start --address=HEAD_IP:6379" in how
    assert cmd.render().startswith(f"# {how}\n")
    assert "--data-parallel-backend" not in cmd.options  # one replica


def test_multi_node_on_sglang_without_node_addresses():
    plan = record(LLAMA_405B, "2x8xH100-80GB", tensor_parallel_size=8, pipeline_parallel_size=2)
    cmd = export_plan(plan, "sglang")
    assert cmd.options["--dist-init-addr"] == "HEAD_IP:50000"
    assert cmd.how_to_run == ("run this on each of the 2 nodes, changing --node-rank: 0 on HEAD_IP, "
                              "1 on the other",)
    assert cmd.env == (("SGLANG_PP_LAYER_PARTITION", ",".join(map(str, plan.parallel.layer_split))),)


def test_multi_node_on_sglang_names_each_node(tmp_path):
    hardware = tmp_path / "hardware.yaml"
    hardware.write_text("nodes:\n  - {gpu: H100-80GB, count: 8, ip: 10.0.0.1}\n"
                        "  - {gpu: H100-80GB, count: 8, ip: 10.0.0.2}\n")
    plan = record(LLAMA_405B, str(hardware), tensor_parallel_size=8, pipeline_parallel_size=2)
    cmd = export_plan(plan, "sglang")
    options = cmd.options
    assert (options["--nnodes"], options["--node-rank"]) == ("2", "0")
    assert options["--dist-init-addr"] == "10.0.0.1:50000"
    assert cmd.how_to_run == ("run this on each of the 2 nodes, changing --node-rank: 0 on 10.0.0.1, "
                              "1 on 10.0.0.2",)
    assert any(n.startswith("distributed_executor_backend=ray") for n in cmd.notes)
    assert "ray start --head --port=6379` on 10.0.0.1" in export_plan(plan, "vllm").how_to_run[0]


def test_replicas_over_nodes_use_vllms_ray_data_parallel_backend():
    plan = record(LLAMA_8B, "2x8xH100-80GB", tensor_parallel_size=1, pipeline_parallel_size=1)
    assert plan.parallel.data_parallel_size == 16
    options = export_plan(plan, "vllm").options
    assert options["--data-parallel-backend"] == "ray"
    assert options["--distributed-executor-backend"] == "ray"


@pytest.mark.parametrize("kv_cache_dtype, sglang_name", [("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_an_fp8_kv_cache(kv_cache_dtype, sglang_name):
    plan = record(LLAMA_8B, "8xH100-80GB", kv_cache_dtype=kv_cache_dtype)
    assert plan.runtime.kv_cache_dtype == kv_cache_dtype
    assert export_plan(plan, "vllm").options["--kv-cache-dtype"] == kv_cache_dtype
    assert export_plan(plan, "sglang").options["--kv-cache-dtype"] == sglang_name


def test_every_runtime_choice_that_differs_from_the_defaults():
    plan = record(LLAMA_8B, "8xH100-80GB", block_size=32, enable_prefix_caching=False, enforce_eager=True,
                  gpu_memory_utilization=0.85, kv_cache_memory_bytes=8 * 2**30, quantization="fp8")
    vllm, sglang = export_plan(plan, "vllm").options, export_plan(plan, "sglang")
    assert vllm["--block-size"] == "32" and vllm["--gpu-memory-utilization"] == "0.85"
    assert vllm["--kv-cache-memory-bytes"] == str(8 * 2**30) and vllm["--quantization"] == "fp8"
    assert {"--no-enable-prefix-caching", "--enforce-eager"} <= set(vllm)
    options = sglang.options
    assert options["--page-size"] == "32" and options["--quantization"] == "fp8"
    assert {"--disable-radix-cache", "--disable-cuda-graph"} <= set(options)
    assert options["--max-total-tokens"] == str(plan.memory.kv_cache_tokens)
    assert any(n.startswith("--max-total-tokens") and str(8 * 2**30) in n for n in sglang.notes)


def test_a_block_size_vllm_cannot_take_is_named():
    plan = record(LLAMA_8B, "8xH100-80GB", block_size=4)
    cmd = export_plan(plan, "vllm")
    assert "--block-size" not in cmd.options
    assert cmd.unsupported == ("block_size=4 (vLLM's KV blocks hold 1, 8, 16, 32, 64, 128, 256 tokens)",)
    assert "# no equivalent: block_size=4 (" in cmd.render()
    assert export_plan(plan, "sglang").options["--page-size"] == "4"


def test_a_cpu_plan_and_a_path_that_needs_quoting(tmp_path):
    model = tmp_path / "my model"
    shutil.copytree(DEMO_MODEL_DIR, model)
    plan = record(str(model), "cpu")
    vllm, sglang = export_plan(plan, "vllm"), export_plan(plan, "sglang")
    assert vllm.unsupported[0].startswith("device=cpu (")
    assert sglang.options["--device"] == "cpu" and "--mem-fraction-static" not in sglang.options
    for cmd in (vllm, sglang):
        text = cmd.render()
        assert shlex.quote(str(model)) in text and shell_words(text) == cmd.args
        body = [line for line in text.splitlines() if not line.startswith("#")]
        assert all(line.endswith(" \\") for line in body[:-1]) and not body[-1].endswith("\\")
        assert len(body) == 1 + len(cmd.flags)  # one flag a line


def test_a_hub_ids_revision_and_download_folder_travel_but_old_plans_read_as_before():
    """The plan records them only when set (the token never); a plan without them reads and exports as before."""
    plan = record(LLAMA_8B, "H100-80GB")
    old = plan.to_dict()
    assert "revision" not in old["model"] and "download_dir" not in old["model"]
    assert PlanFile.from_dict(old, "old.yaml") == plan
    pinned = dataclasses.replace(plan, model=dataclasses.replace(plan.model, revision="v1.1", download_dir="/m m"))
    assert PlanFile.from_dict(pinned.to_dict(), "p.yaml").model.revision == "v1.1"
    assert export_plan(pinned, "vllm").args[:7] == ["vllm", "serve", LLAMA_8B, "--revision", "v1.1",
                                                    "--download-dir", "/m m"]
    assert export_plan(pinned, "sglang").args[3:9] == ["--model-path", LLAMA_8B, "--revision", "v1.1",
                                                       "--download-dir", "/m m"]
    assert not {"--revision", "--download-dir"} & set(export_plan(plan, "vllm").options)


def test_every_plan_setting_is_mapped_or_named(monkeypatch):
    sections = (RuntimeSection, ParallelSection, ServiceSection)
    settings = {f.name for section in sections for f in dataclasses.fields(section)}
    assert settings == HANDLED_SETTINGS
    plan = record(LLAMA_8B, "8xH100-80GB")
    monkeypatch.setattr(engine_export, "HANDLED_SETTINGS", HANDLED_SETTINGS - {"enforce_eager"})
    assert export_plan(plan, "sglang").unsupported == (
        "enforce_eager=False (a setting this export does not map yet)",)


def test_the_moe_architectures_are_the_served_moes():
    assert set(MOE_ARCHITECTURES) <= set(ARCHITECTURES)
    for model_id in model_catalog():
        spec = load_model(model_id).spec
        if spec.architecture in ARCHITECTURES:
            assert spec.is_moe == (spec.architecture in MOE_ARCHITECTURES), model_id


def test_latency_targets_are_named():
    plan = record(LLAMA_8B, "8xH100-80GB", ttft_ms=500.0, concurrency=64.0)
    assert plan.service.ttft_ms == 500.0 and plan.service.tpot_ms is None
    for engine, name in (("vllm", "vLLM"), ("sglang", "SGLang")):
        (line,) = export_plan(plan, engine).unsupported
        assert line.startswith(f"ttft_ms=500 at p{plan.service.target_percentile} (")
        assert f"{name} takes no latency target" in line


def test_an_overloaded_plan_says_so_in_the_command():
    plan = record(LLAMA_8B, "H100-80GB", request_rate=100.0, input_len=2000, output_len=300)
    assert plan.estimates.ttft_ms is None  # the rate outruns one H100
    for engine in ("vllm", "sglang"):
        text = export_plan(plan, engine).render()
        assert (f"# note: the plan's 100 req/s outrun this layout, which holds {plan.estimates.max_request_rate:g} "
                "req/s before overload: requests queue without end") in text
    served = record(LLAMA_8B, "H100-80GB", request_rate=5.0, input_len=2000, output_len=300)
    assert not any("outrun" in note for note in export_plan(served, "vllm").notes)


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="vllm, sglang"):
        export_plan(record(LLAMA_8B, "H100"), "trtllm")


@pytest.mark.parametrize("engine, variable, program", [
    ("vllm", "VLLM_PP_LAYER_PARTITION", f"vllm serve {QWEN_14B}"),
    ("sglang", "SGLANG_PP_LAYER_PARTITION", "python -m sglang.launch_server")])
def test_the_cli_prints_the_export(engine, variable, program):
    args = ["-m", QWEN_14B, "--hardware", "3xL4", "-tp", "1", "-pp", "3"]
    result = CliRunner().invoke(app, ["plan", *args, "--format", engine])
    assert result.exit_code == 0, result.output
    split = ",".join(map(str, record(QWEN_14B, "3xL4", tensor_parallel_size=1,
                                     pipeline_parallel_size=3).parallel.layer_split))
    assert result.output.splitlines()[0] == f"{variable}={split} {program} \\"
    flag = {"vllm": "--pipeline-parallel-size 3", "sglang": "--pp-size 3"}[engine]
    assert f"\n    {flag} \\\n" in result.output
    help_text = " ".join(CliRunner().invoke(app, ["plan", "--help"]).output.split())
    assert "vllm or sglang: that engine's equivalent serve command" in help_text


def test_the_cpu_tier_of_the_kv_cache():
    """kv_offloading_size is vLLM's own flag; SGLang's hierarchical cache takes whole GB per rank."""
    plan = record(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=2, kv_offloading_size=64)
    vllm, sglang = export_plan(plan, "vllm").options, export_plan(plan, "sglang")
    assert vllm["--kv-offloading-size"] == "64" and vllm["--kv-offloading-backend"] == "native"
    assert sglang.options["--hicache-size"] == str(int(64 * 2**30 / 2 / 1e9)) == "34"
    assert "--enable-hierarchical-cache" in sglang.options
    small = export_plan(record(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=8, kv_offloading_size=4), "sglang")
    assert "--hicache-size" not in small.options
    assert small.unsupported == ("kv_offloading_size=4 (under 1 GB per rank over 8 ranks: SGLang's --hicache-size "
                                 "takes whole GB per rank)",)


def test_lora_slots_map_to_both_engines():
    plan = record(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=2, enable_lora=True, max_loras=4, max_lora_rank=64)
    vllm, sglang = export_plan(plan, "vllm"), export_plan(plan, "sglang")
    assert "--enable-lora" in vllm.options and vllm.options["--max-loras"] == "4"
    assert vllm.options["--max-lora-rank"] == "64" and not vllm.unsupported
    assert sglang.options["--max-loras-per-batch"] == "4" and sglang.options["--max-lora-rank"] == "64"
    assert "--enable-lora" not in export_plan(record(LLAMA_8B, "8xH100-80GB", tensor_parallel_size=2), "vllm").options
