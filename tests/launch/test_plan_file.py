"""A plan file is a typed record: launch refuses one with an unknown key, a wrong type or another
version, naming the key; a layer split edited by hand (uneven, valid) is served exactly as written."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from shardserve.launch.demo import DEMO_MODEL_DIR
from tests.launch.conftest import http, start_server, stop_server

pytestmark = pytest.mark.slow  # every test here starts a process

CPU_PP2 = ["--hardware", "2xcpu", "--pipeline-parallel-size", "2", "--max-model-len", "256",
           "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(1 << 24)]


@pytest.fixture(scope="module")
def plan_dict(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    done = subprocess.run([sys.executable, "-m", "shardserve.launch", "plan", "--model", str(DEMO_MODEL_DIR),
                           *CPU_PP2, "-o", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(path.read_text())


def launch_plan(tmp_path, plan: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return subprocess.run([sys.executable, "-m", "shardserve.launch", "launch", str(path), "--port", "1"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("edit, named", [
    (lambda p: p["runtime"].update(max_num_seqz=8), "runtime.max_num_seqz: unknown key"),
    (lambda p: p["parallel"].update(layer_split="2,2"), "parallel.layer_split: expected a list"),
    (lambda p: p["runtime"].update(block_size=3), "runtime.block_size: block_size=3 must be one of"),
    (lambda p: p["memory"].pop("num_blocks"), "memory.num_blocks: missing"),
    (lambda p: p.update(version=1), "not a shardserve plan of version 2 (version: 1)"),
])
def test_a_bad_plan_is_refused_naming_the_key(tmp_path, plan_dict, edit, named):
    plan = yaml.safe_load(yaml.safe_dump(plan_dict))
    edit(plan)
    done = launch_plan(tmp_path, plan)
    assert done.returncode == 1
    message = " ".join(done.stderr.split())
    assert "edited.yaml" in message and named in message and "Traceback" not in message


@pytest.mark.slow
def test_a_layer_split_edited_by_hand_is_served_as_written(tmp_path, plan_dict):
    planned = plan_dict["parallel"]["layer_split"]
    edited = [1, 3] if planned != [1, 3] else [3, 1]
    plan = yaml.safe_load(yaml.safe_dump(plan_dict))
    plan["parallel"]["layer_split"] = edited
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    proc, url = start_server(str(path))
    try:
        status, _ = http(f"{url}/v1/completions", {"model": "shardserve-demo", "prompt": "The list",
                                                   "max_tokens": 4, "temperature": 0})
        assert status == 200
    finally:
        code, out = stop_server(proc)
    assert code == 0, out
    first_stage_end = edited[0] - 1
    assert f"layer_split={edited}" in out
    assert f"pp 0/2, layers 0-{first_stage_end})" in out and f"pp 1/2, layers {edited[0]}-3)" in out
