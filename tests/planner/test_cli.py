"""`shardserve plan` as a user runs it: output formats, files, errors without tracebacks."""

import json
import os
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.slow  # every test here starts a process

SCHEMA = {
    "model": {"id", "architecture", "num_layers", "num_attention_heads", "num_kv_heads",
              "head_dim", "hidden_size", "intermediate_size", "vocab_size", "num_params",
              "weight_bytes", "dtype", "quantization", "kv_bytes_per_token"},
    "hardware": {"source", "nodes", "gpus_per_node", "gpu", "interconnect", "node_ips"},
    "parallel": {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                 "layer_split", "distributed_executor_backend"},
    "memory": {"per_gpu", "block_size", "num_blocks", "kv_cache_tokens", "max_concurrency"},
    "runtime": {"dtype", "kv_cache_dtype", "max_model_len", "gpu_memory_utilization",
                "max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching"},
    "service": {"input_len", "output_len", "prefix_len", "concurrency", "request_rate", "ttft_ms", "tpot_ms",
                "target_percentile"},
    "estimates": {"workload", "ttft_ms", "tpot_ms", "output_tokens_per_s", "output_tokens_per_s_per_gpu",
                  "output_tokens_per_s_per_user", "max_request_rate", "decode_tokens_per_s_batch1"},
}


def shardserve(*args):
    return subprocess.run([sys.executable, "-m", "shardserve.launch", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})


def test_plan_writes_the_versioned_schema(tmp_path):
    out = tmp_path / "plan.yaml"
    r = shardserve("plan", "--model", "meta-llama/Llama-3.1-70B-Instruct",
                   "--hardware", "8xH100-80GB", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "rule 2" in r.stdout and "Memory per GPU: 79.6 GiB, used up to gpu_memory_utilization 0.9" in r.stdout
    plan = yaml.safe_load(out.read_text())
    assert plan["version"] == 2
    for section, keys in SCHEMA.items():
        assert keys <= set(plan[section]), (section, keys - set(plan[section]))
    assert set(plan["memory"]["per_gpu"]) >= {"total_bytes", "weights_bytes",
                                              "activation_bytes", "overhead_bytes",
                                              "kv_cache_bytes"}
    assert plan["rationale"] and isinstance(plan["warnings"], list) and plan["alternatives"]
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]  # no temporary left behind


def test_json_on_stdout_for_tools():
    r = shardserve("plan", "-m", "Qwen/Qwen2.5-14B-Instruct", "--hardware", "3xL4",
                   "--format", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["parallel"]["pipeline_parallel_size"] == 3
    assert sum(plan["parallel"]["layer_split"]) == plan["model"]["num_layers"]


def test_an_overloaded_plan_says_so_in_json_and_the_table():
    args = ("plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--hardware", "H100-80GB",
            "--request-rate", "100", "--input-len", "2000", "--output-len", "300")
    r = shardserve(*args, "--format", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["estimates"]["ttft_ms"] is None and plan["estimates"]["output_tokens_per_s"] < 100 * 300
    assert any(w.startswith("overloaded: serves at most") for w in plan["warnings"])
    table = shardserve(*args).stdout
    assert "TTFT p50" in table and "unbounded" in table and "(overloaded: see the warning)" in table


def test_version_and_help():
    assert shardserve("--version").stdout.startswith("shardserve ")
    r = shardserve("plan", "--help")
    assert r.returncode == 0 and "--tensor-parallel-size" in r.stdout


@pytest.mark.parametrize("args, code, message", [
    (["-m", "nobody/nothing", "--hardware", "H100"], 1, "not in the catalog"),
    (["-m", "gpt2", "--hardware", "4xZ9000"], 1, "unknown GPU 'Z9000'"),
    (["-m", "meta-llama/Llama-3.1-8B", "--hardware", "8xH100", "-tp", "3"], 1,
     "32 attention heads are not divisible by tensor_parallel_size 3"),
    (["-m", "meta-llama/Llama-3.1-405B", "--hardware", "8xH100"], 2,
     "2x8xH100-80GB would fit"),
    (["-m", "gpt2", "--hardware", "H100", "--gpu-memory-utilization", "1.5"], 1,
     "--gpu-memory-utilization: input should be less than or equal to 1"),
    (["-m", "gpt2", "--hardware", "H100", "--max-model-len", "4096"], 1,
     "beyond the model's 1024 positions"),
])
def test_bad_input_is_one_clear_line_and_writes_nothing(tmp_path, args, code, message):
    out = tmp_path / "plan.yaml"
    r = shardserve("plan", *args, "-o", str(out))
    assert r.returncode == code
    assert message in " ".join(r.stderr.split())
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_bad_config_folder(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    r = shardserve("plan", "-m", str(tmp_path), "--hardware", "cpu")
    assert r.returncode == 1 and "must hold a JSON object" in r.stderr
    assert "Traceback" not in r.stderr


def test_planning_never_imports_torch():
    code = ("import sys; from shardserve.launch.cli import app; "
            "from typer.testing import CliRunner; "
            "r = CliRunner().invoke(app, ['plan', '-m', 'Qwen/Qwen3-30B-A3B', '--hardware', "
            "'8xH100', '--format', 'json']); assert r.exit_code == 0, r.output; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr
