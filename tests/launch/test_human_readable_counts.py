"""max_model_len, max_num_batched_tokens and kv_cache_memory_bytes read 32k (x1000) and 32K (x1024) as
vLLM does, the same through a flag, --set, a profile, a plan file and the Python API; a bad count is one
line naming the setting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from shardserve.launch.cli import app
from shardserve.launch.deploy_config import load_yaml_config, parse_set
from shardserve.launch.launcher import settle
from shardserve.planner import PlanError, PlanOptions
from shardserve.planner.plan_file import PlanFile
from shardserve.planner.settings import BY_NAME, SettingError

MAX_MODEL_LEN = BY_NAME["max_model_len"]


@pytest.mark.parametrize("text, value", [
    ("32k", 32_000), ("1M", 1_048_576), ("128K", 131_072), ("2048", 2048), ("auto", "auto"),
    ("1.5k", 1500), ("25.6k", 25_600), ("2m", 2_000_000), (" 4K ", 4096),
])
def test_counts_read_as_vllm_reads_them(text, value):
    assert MAX_MODEL_LEN.check(text) == value


@pytest.mark.parametrize("text, named", [
    ("1.5K", "did you mean 1.5k?"), ("32x", "must be a whole number"), ("0k", "must be at least 1"),
    ("1.0005k", "not a whole number"), ("-1", "must be a whole number"), ("k", "must be a whole number"),
])
def test_a_bad_count_is_refused_naming_the_setting(text, named):
    with pytest.raises(SettingError, match="max_model_len") as e:
        MAX_MODEL_LEN.check(text)
    assert named in str(e.value)


def test_other_settings_read_counts_and_plain_ints_stay_plain():
    assert BY_NAME["kv_cache_memory_bytes"].check("2G") == 2 << 30
    assert BY_NAME["max_num_batched_tokens"].check("16k") == 16_000
    with pytest.raises(SettingError):
        BY_NAME["max_num_seqs"].check("1k")  # vLLM reads only these three as counts


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", "--model", "shardserve-demo", "--hardware", "cpu",
                                      "--format", "json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("text, value", [("1k", 1000), ("1K", 1024), ("2048", 2048)])
def test_the_plan_flag_reads_counts(text, value):
    assert plan_json("--max-model-len", text)["runtime"]["max_model_len"] == value


def test_auto_still_means_the_longest_that_fits():
    assert plan_json("--max-model-len", "auto")["runtime"]["max_model_len"] == 2048  # the demo's positions


@pytest.mark.slow
def test_a_bad_flag_is_one_line():
    done = subprocess.run([sys.executable, "-m", "shardserve.launch", "plan", "--model", "shardserve-demo",
                           "--hardware", "cpu", "--max-model-len", "1.5K"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert "did you mean 1.5k?" in done.stderr and "Traceback" not in done.stderr


def test_a_profile_and_set_read_counts(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("model: shardserve-demo\nhardware: cpu\nmax_model_len: 1K\n")
    assert plan_json("--profile", str(profile))["runtime"]["max_model_len"] == 1024
    _, plan = settle(None, None, parse_set(["model=shardserve-demo", "hardware=cpu", "max_model_len=1k",
                                            "kv_cache_memory_bytes=16M"]), None)
    assert plan.runtime.max_model_len == 1000 and plan.runtime.kv_cache_memory_bytes == 16 << 20


def test_a_profile_with_a_bad_count_names_the_key(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("model: shardserve-demo\nmax_model_len: 2.5M\n")
    with pytest.raises(PlanError, match=r"p.yaml: max_model_len \(line 2\): .*did you mean 2.5m"):
        load_yaml_config(profile)


def test_a_hand_edited_plan_and_the_python_api_read_counts():
    plan = plan_json("--max-model-len", "1000")
    plan["runtime"]["max_model_len"] = "1K"
    assert PlanFile.from_dict(yaml.safe_load(yaml.safe_dump(plan)), "p.yaml").runtime.max_model_len == 1024
    assert PlanOptions(max_model_len="32k", max_num_batched_tokens="8K").max_model_len == 32_000
