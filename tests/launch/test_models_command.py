"""`shardserve models` lists the catalog and the local Hugging Face cache (marked), filtered by id, with the
GPUs each needs by the planner's memory model, as a table, JSON or YAML; a filter matching nothing is one
red line."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from shardserve.launch.cli import app
from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.planner import InfeasibleError
from tests.planner.factories import plan_for


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["models", *args], env=env)


def rows(*args: str, env: dict | None = None) -> dict:
    result = run(*args, "--format", "json", env=env)
    assert result.exit_code == 0, result.output
    return {r["id"]: r for r in json.loads(result.output)["models"]}


def test_the_catalog_is_listed_with_shapes_and_the_gpus_each_needs(tmp_path):
    found = rows("llama-3.1-405b", env={"HF_HUB_CACHE": str(tmp_path)})
    assert set(found) == {"meta-llama/Llama-3.1-405B-Instruct", "meta-llama/Llama-3.1-405B",
                          "meta-llama/Llama-3.1-405B-Instruct-FP8"}
    bf16 = found["meta-llama/Llama-3.1-405B-Instruct"]
    assert bf16["architecture"] == "LlamaForCausalLM" and bf16["max_context_len"] == 131072
    assert 400e9 < bf16["num_params"] < 410e9 and bf16["quantization"] is None and bf16["source"] == "catalog"
    assert bf16["gpus"] is None and bf16["gpus_fp8"] == 8  # more than one node at bf16; one node at fp8
    fp8 = found["meta-llama/Llama-3.1-405B-Instruct-FP8"]
    assert fp8["quantization"] == "fp8" and fp8["gpus"] == 8 and not fp8["can_quantize_fp8"]


def test_the_counts_agree_with_plan():
    found = rows("Qwen/Qwen3-32B", "--gpu", "L40S")
    needed = found["Qwen/Qwen3-32B"]["gpus"]
    assert needed is not None and needed > 1
    assert plan_for("Qwen/Qwen3-32B", f"{needed}xL40S").chosen.layout.num_gpus <= needed
    with pytest.raises(InfeasibleError):  # not on fewer
        plan_for("Qwen/Qwen3-32B", f"{needed // 2}xL40S")


def test_yaml_and_the_table(tmp_path):
    result = run("qwen3-8b", "--format", "yaml", env={"HF_HUB_CACHE": str(tmp_path)})
    assert result.exit_code == 0
    assert {r["id"] for r in yaml.safe_load(result.output)["models"]} == {"Qwen/Qwen3-8B", "Qwen/Qwen3-8B-FP8"}
    table = run("qwen3-8b", env={"HF_HUB_CACHE": str(tmp_path), "COLUMNS": "200"})
    assert table.exit_code == 0 and "Qwen/Qwen3-8B-FP8" in table.output and "fp8" in table.output


def test_models_in_the_hugging_face_cache_are_listed_and_marked(tmp_path):
    snapshot = tmp_path / "models--acme--tiny-chat" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    shutil.copy(DEMO_MODEL_DIR / "config.json", snapshot / "config.json")
    broken = tmp_path / "models--acme--broken" / "snapshots" / "def456"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{not json")
    found = rows("acme", env={"HF_HUB_CACHE": str(tmp_path)})
    assert found["acme/tiny-chat"]["source"] == "hf-cache" and found["acme/tiny-chat"]["gpus"] == 1
    assert found["acme/broken"]["architecture"] is None and "not valid JSON" in found["acme/broken"]["problem"]
    table = run("acme", env={"HF_HUB_CACHE": str(tmp_path), "COLUMNS": "200"})
    assert "acme/tiny-chat *" in table.output and "unreadable" in table.output


def test_a_filter_matching_nothing_and_an_unknown_gpu_are_one_line():
    for args, named in [(["no-such-model"], "no catalog or cached model id holds 'no-such-model'"),
                        (["--gpu", "X100"], "unknown GPU 'X100'")]:
        result = run(*args)
        assert result.exit_code == 1 and named in result.output and "Traceback" not in result.output


def test_piped_the_list_keeps_whole_ids_one_row_a_line(tmp_path):
    """Piped (as CliRunner runs it: no terminal), rich fitted the table to 80 columns and cut ids across lines,
    so `shardserve models | grep ID` found nothing."""
    result = run(env={"HF_HUB_CACHE": str(tmp_path), "COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["id", "architecture", "params", "context", "quant", "GPUs", "fp8"]
    row = next(line for line in lines if line.startswith("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4 "))
    assert row.split()[-2:] == ["2", "-"]
    assert not any(line.startswith(" ") for line in lines)  # no folded cell on a line of its own
