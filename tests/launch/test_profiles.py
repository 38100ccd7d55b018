"""Profiles: every shipped one validates and plans; a broken one names its field and line."""

import json
import os
import subprocess
import sys

import pytest

from shardserve.launch.deploy_config import parse_set
from shardserve.launch.plan_view import make_plan_from
from shardserve.launch.profiles import BUNDLED_DIR, list_profiles, load_profile
from shardserve.planner import PlanError

SHIPPED = ["demo", "single-gpu", "node-8xh100-tp8", "two-nodes-tp8-pp2", "pcie-l40s-pp", "chat-slo-h100",
           "cpu-tp2"]


def test_the_promised_profiles_ship():
    assert set(SHIPPED) <= set(list_profiles())


@pytest.mark.parametrize("name", sorted(p.stem for p in BUNDLED_DIR.glob("*.yaml")))
def test_each_shipped_profile_validates_and_plans(name):
    profile = load_profile(name)
    assert profile.model and profile.description
    # plan on the profile's declared hardware; single-gpu.yaml declares none: give it one
    hardware = None if profile.hardware else "H100-80GB"
    plan = make_plan_from({"hardware": hardware}, name, None)
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(profile, key):
            assert getattr(plan.parallel, key) == getattr(profile, key)


def test_flags_override_the_profile():
    plan = make_plan_from({"tensor_parallel_size": 4}, "node-8xh100-tp8", None)
    assert plan.parallel.tensor_parallel_size == 4


def test_broken_profile_names_the_field_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: gpt2\n# a comment\ngpu_memory_utilization: 1.7\nmax_num_seqz: 8\n")
    with pytest.raises(PlanError) as info:
        load_profile(str(path))
    message = str(info.value)
    assert "gpu_memory_utilization (line 3): input should be less than or equal to 1" in message
    assert "max_num_seqz (line 4): unknown key" in message


def test_profile_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model: gpt2\n")
    with pytest.raises(PlanError, match="a profile is a mapping"):
        load_profile(str(path))


def test_unknown_profile_lists_the_known():
    with pytest.raises(PlanError, match="no profile named 'nope'; available: chat-slo-h100, cpu-tp2, demo"):
        load_profile("nope")


def test_user_profile_folder(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("model: gpt2\nhardware: 2xL4\n")
    monkeypatch.setenv("SHARDSERVE_PROFILES", str(tmp_path))
    assert "mine" in list_profiles()
    assert make_plan_from({}, "mine", None).hardware.gpu.name == "L4"


def test_set_values_are_yaml_scalars():
    assert parse_set(["max_num_seqs=64", "enable_prefix_caching=false", "dtype=bf16"]) == {
        "max_num_seqs": 64, "enable_prefix_caching": False, "dtype": "bf16"}
    with pytest.raises(PlanError, match="write key=value"):
        parse_set(["max_num_seqs"])


@pytest.mark.slow
def test_cli_profiles_list_show_and_plan():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "shardserve.launch", *args],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "COLUMNS": "200"})
    listed = run("profiles", "list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in SHIPPED)
    shown = run("profiles", "show", "two-nodes-tp8-pp2")
    assert "pipeline_parallel_size: 2" in shown.stdout
    planned = run("plan", "--profile", "two-nodes-tp8-pp2", "--format", "json")
    assert json.loads(planned.stdout)["parallel"]["distributed_executor_backend"] == "ray"
    missing = run("profiles", "show", "nope")
    assert missing.returncode == 1 and "no profile named 'nope'" in missing.stderr
