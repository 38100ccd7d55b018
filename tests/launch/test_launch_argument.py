"""`shardserve launch MODEL` as `vllm serve MODEL`: the argument is a plan when it names a YAML file,
else the model."""

import subprocess
import sys

import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.launch.launcher import launch_target
from shardserve.planner import PlanError


def test_a_yaml_file_is_a_plan_and_anything_else_the_model(tmp_path):
    plan = tmp_path / "plan.yml"
    plan.write_text("version: 2\n")
    assert launch_target(None, None) == (None, None)
    assert launch_target(None, "acme/m") == (None, "acme/m")
    assert launch_target(str(plan), "acme/m") == (str(plan), "acme/m")  # --model overrides the plan's model
    assert launch_target("acme/m", None) == (None, "acme/m")
    assert launch_target(str(DEMO_MODEL_DIR), None) == (None, str(DEMO_MODEL_DIR))
    folder = tmp_path / "weights.yaml"  # a folder is a model whatever its name
    folder.mkdir()
    assert launch_target(str(folder), None) == (None, str(folder))


def test_two_models_or_a_missing_plan_are_refused():
    with pytest.raises(PlanError, match="two models: acme/a .the argument. and --model acme/b"):
        launch_target("acme/a", "acme/b")
    with pytest.raises(PlanError, match="plan nothing.yaml does not exist"):
        launch_target("nothing.yaml", None)


@pytest.mark.slow
def test_the_cli_names_both_models_in_one_line():
    r = subprocess.run([sys.executable, "-m", "shardserve.launch", "launch", str(DEMO_MODEL_DIR), "--model",
                        "acme/b"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: two models: {DEMO_MODEL_DIR} (the argument) and --model "
                                             "acme/b: give one of them"]
