"""What a newcomer sees of the CLI: help and tables never cut a name at 80 columns, usage errors exit 1
(2 means "does not fit"), yaml where asked, one broken profile leaves the others listed, plans not 0600."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import yaml

from shardserve.launch.cli_options import launch_command_settings, plan_command_settings
from shardserve.planner.settings import BY_NAME

pytestmark = pytest.mark.slow  # every test here starts a process


def cli(*args: str, columns: int = 80, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.launch", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": str(columns), **(env or {})})


@pytest.mark.parametrize("command, names", [
    (("plan",), plan_command_settings()), (("launch",), launch_command_settings()),
])
def test_help_at_80_columns_shows_every_option_name_whole(command, names):
    done = cli(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout and max(map(len, done.stdout.splitlines())) <= 80
    for name in names:
        assert BY_NAME[name].flag in done.stdout, name
        assert BY_NAME[name].short is None or f"{BY_NAME[name].short}, {BY_NAME[name].flag}" in done.stdout


def test_profiles_list_at_80_columns_shows_whole_paths_and_survives_a_broken_profile(tmp_path):
    (tmp_path / "broken.yaml").write_text("max_num_seqs: many\n")
    (tmp_path / "mine.yaml").write_text("description: my own\nmodel: shardserve-demo\n")
    done = cli("profiles", "list", env={"SHARDSERVE_PROFILES": str(tmp_path)})
    assert done.returncode == 1  # something is broken, and it says what
    assert "broken" in done.stdout and "max_num_seqs" in done.stdout
    assert "my own" in done.stdout and "the bundled demo model" in done.stdout
    assert f"mine: {tmp_path / 'mine.yaml'}" in done.stdout and "…" not in done.stdout


def test_usage_errors_exit_1_not_the_does_not_fit_code():
    assert cli("plan", "--no-such-flag").returncode == 1
    assert cli("plan", "--max-num-seqs", "many").returncode == 1
    assert cli("launch", "--port", "high").returncode == 1


def test_doctor_and_cluster_status_speak_yaml_and_take_ray_address():
    done = cli("doctor", "--format", "yaml")
    checks = yaml.safe_load(done.stdout)["checks"]
    assert {c["name"] for c in checks} >= {"gpus", "shm"}
    assert "--ray-address" in cli("cluster", "status", "--help").stdout


def test_a_written_plan_is_readable_by_others(tmp_path):
    path = tmp_path / "plan.yaml"
    old = os.umask(0o022)
    try:
        done = cli("plan", "--model", "shardserve-demo", "--hardware", "cpu", "-o", str(path))
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_cpu_plans_speak_of_cpu_ranks_and_say_how_to_declare_more():
    done = cli("plan", "--model", "shardserve-demo", "--hardware", "cpu", columns=120)
    assert "Memory per CPU rank" in done.stdout and "GPU" not in done.stdout.replace("no GPU:", "")
    refused = cli("plan", "--model", "shardserve-demo", "--hardware", "cpu", "-dp", "2")
    assert refused.returncode == 1 and "CPU ranks" in refused.stderr and "--hardware 2xcpu" in refused.stderr


def test_the_layouts_that_lost_say_whether_experts_were_dealt_out_whole():
    moe = cli("plan", "--model", "Qwen/Qwen3-30B-A3B", "--hardware", "4xA10G")
    table = moe.stdout[moe.stdout.index("other layouts"):]
    assert moe.returncode == 0 and max(map(len, moe.stdout.splitlines())) <= 80
    header = next(line for line in table.splitlines() if " tp " in line)
    assert header.split("┃")[1:5] == [" tp ", " pp ", " dp ", " ep  "]
    rows = [line.split("│") for line in table.splitlines() if line.startswith("│ ") and line.split("│")[1].strip()]
    assert {"yes", "no"} == {row[4].strip() for row in rows}  # tp 2 pp 2 with and without: two rows
    dense = cli("plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--hardware", "8xH100")
    assert "other layouts" in dense.stdout and " ep " not in dense.stdout
