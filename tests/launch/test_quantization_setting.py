"""--quantization and checkpoint formats at plan time and at launch: an unserved format is refused
naming the formats served, before anything loads."""

import json
import shutil
import subprocess
import sys

import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow  # every test here starts a process

SERVED = "awq, gptq, fp8, compressed-tensors, mxfp4"


def shardserve(*args):
    return subprocess.run([sys.executable, "-m", "shardserve.launch", *args], capture_output=True, text=True,
                          timeout=60)


def unserved_checkpoint(tmp_path):
    folder = tmp_path / "bnb"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_plan_and_launch_refuse_an_unserved_checkpoint_naming_the_served_formats(tmp_path):
    folder = unserved_checkpoint(tmp_path)
    for command in (["plan", "--model", folder, "--hardware", "cpu"], ["launch", "--model", folder]):
        r = shardserve(*command)
        assert r.returncode == 1, r.stderr
        message = " ".join(r.stderr.split())
        assert f"quantization_config.quant_method 'bitsandbytes' is not served; served formats: {SERVED}" in message
        assert "Traceback" not in r.stderr


def test_plan_refuses_an_unserved_quantization_flag():
    r = shardserve("plan", "--model", str(DEMO_MODEL_DIR), "--hardware", "cpu", "--quantization", "bitsandbytes")
    assert r.returncode == 1
    assert "quantization: input should be 'awq', 'gptq', 'fp8', 'compressed-tensors' or 'mxfp4'" in r.stderr


def test_plan_records_the_override_and_a_float_checkpoint_cannot_claim_awq():
    r = shardserve("plan", "--model", str(DEMO_MODEL_DIR), "--hardware", "cpu", "--quantization", "fp8",
                   "--format", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["runtime"]["quantization"] == "fp8" and plan["model"]["quantization"]["method"] == "fp8"
    float_plan = json.loads(shardserve("plan", "--model", str(DEMO_MODEL_DIR), "--hardware", "cpu",
                                       "--format", "json").stdout)
    # the decoder layers' linear weights count one byte each instead of four (float32 on CPU)
    assert plan["model"]["weight_bytes"] < 0.7 * float_plan["model"]["weight_bytes"]
    r = shardserve("plan", "--model", str(DEMO_MODEL_DIR), "--hardware", "cpu", "--quantization", "awq")
    assert r.returncode == 1
    assert "quantization awq: config.json has no quantization_config" in " ".join(r.stderr.split())
