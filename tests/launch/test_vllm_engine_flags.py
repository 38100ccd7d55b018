"""vLLM's --load-format, --enable-chunked-prefill and --shutdown-timeout on `launch`: dummy serves a folder
without weight files; values this runtime lacks are one red line naming the setting and why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR
from tests.launch.conftest import http, start_server, stop_server

SHARDSERVE = [sys.executable, "-m", "shardserve.launch"]


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SHARDSERVE, "launch", *args, "--port", "1"], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_the_flags_are_there():
    done = subprocess.run([*SHARDSERVE, "launch", "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    for flag in ("--load-format", "--enable-chunked-prefill / --no-enable-chunked-prefill", "--shutdown-timeout"):
        assert flag in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args, named", [
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill=False is not served: the scheduler always chunks"),
    (["--load-format", "pt"], "--load-format: input should be 'auto', 'safetensors' or 'dummy'"),  # as typed
    (["--set", "load_format=gguf"], "settings: load_format: input should be"),
])
def test_what_the_runtime_lacks_is_one_red_line(args, named):
    done = launch("--model", "shardserve-demo", *args)
    assert done.returncode == 1 and named in " ".join(done.stderr.split()) and "Traceback" not in done.stderr


def test_a_folder_without_weights_is_refused_before_any_replica_starts(tmp_path):
    from shardserve.launch.deploy_config import validate
    from shardserve.launch.launcher import fetch_weights
    from shardserve.planner import PlanError

    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    for load_format in ("auto", "safetensors"):
        with pytest.raises(PlanError, match=f"{folder} has no safetensors weights .* or pass --load-format dummy"):
            fetch_weights(validate({"model": str(folder), "load_format": load_format}, "flags"))
    dummy = validate({"model": str(folder), "load_format": "dummy"}, "flags")
    assert fetch_weights(dummy) == dummy
    served = validate({"model": str(DEMO_MODEL_DIR)}, "flags")
    assert fetch_weights(served) == served


@pytest.mark.slow
def test_dummy_weights_serve_a_folder_without_weights(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    refused = subprocess.run([*SHARDSERVE, "launch", str(folder), "--hardware", "cpu", "--port", "0"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "pass --load-format dummy" in refused.stderr and "replica" not in refused.stderr  # none started
    proc, url = start_server(str(folder), "--hardware", "cpu", "--load-format", "dummy", "--shutdown-timeout", "1")
    try:
        status, body = http(f"{url}/v1/completions", {"model": str(folder), "prompt": "The Python interpreter",
                                                       "max_tokens": 5, "ignore_eos": True})
        assert status == 200, body
    finally:
        code, out = stop_server(proc)
    assert code == 0, out
