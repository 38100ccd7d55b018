"""A newcomer's first minutes: bare launch is the demo profile, the demo is served as shardserve-demo
however it is given, a busy port is refused before loading, and LLM(...) agrees with the CLI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.launch.launcher import served_name, settle
from shardserve.launch.profiles import load_profile
from shardserve.planner.settings import BY_NAME
from shardserve.runtime import LLM, SamplingParams
from tests.launch.conftest import http, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]


def launch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.launch", "launch", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_bare_launch_is_the_demo_profile():
    bare, _ = settle(None, None, {}, None)
    profiled, _ = settle(None, "demo", {}, None)
    assert bare == profiled
    demo = load_profile("demo")
    assert (bare.max_model_len, bare.kv_cache_memory_bytes) == (demo.max_model_len, demo.kv_cache_memory_bytes)


@pytest.mark.parametrize("given", [
    {}, {"model": "shardserve-demo"}, {"model": str(DEMO_MODEL_DIR)}, {"model": str(DEMO_MODEL_DIR) + "/"},
    {"model": os.path.relpath(DEMO_MODEL_DIR)},
])
def test_the_demo_is_served_as_shardserve_demo_however_given(given):
    config, plan = settle(None, None, given, None)
    assert served_name(config) == "shardserve-demo"
    from_plan, _ = settle(None, None, {"model": plan.model_source}, None)
    assert served_name(from_plan) == "shardserve-demo"
    named, _ = settle(None, None, {**given, "served_model_name": "tiny"}, None)
    assert served_name(named) == "tiny"


@pytest.mark.slow
def test_a_busy_port_is_refused_before_loading_naming_the_flag():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        done = launch("--port", str(port))
    assert done.returncode == 1
    assert f"127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr and "Errno" not in done.stderr
    assert "KV cache" not in done.stderr  # nothing loaded
    assert time.monotonic() - started < 30


@pytest.mark.slow
def test_a_plan_of_the_demo_is_served_as_shardserve_demo_with_a_curl_in_the_log(tmp_path):
    plan = tmp_path / "plan.yaml"
    r = subprocess.run([sys.executable, "-m", "shardserve.launch", "plan", "--model", "./launch/demo/model",
                        "--hardware", "cpu", "-o", str(plan)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    proc, url = start_server(str(plan), "--max-model-len", "256", "--kv-cache-memory-bytes", str(1 << 24),
                             "--api-key", "k1")
    try:
        status, body = http(f"{url}/v1/completions", {"model": "shardserve-demo", "prompt": "The", "max_tokens": 2},
                            headers={"Authorization": "Bearer k1"})
        lines = iter(proc.stdout.readline, "")  # the log so far, read while the server runs
        pasted = next(line.strip() for line in lines if line.lstrip().startswith("curl "))
        done = subprocess.run(["bash", "-c", pasted], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "SHARDSERVE_API_KEY": "k1"})
    finally:
        code, out = stop_server(proc)
    assert status == 200, body
    assert code == 0, out
    assert pasted.startswith(f"curl http://localhost:{url.rsplit(':', 1)[1]}/v1/completions")
    assert done.returncode == 0 and '"model":"shardserve-demo"' in done.stdout and '"choices"' in done.stdout


def test_llm_and_the_cli_agree_on_cpu_defaults(tmp_path, monkeypatch):
    config, plan = settle(None, None, {"model": "shardserve-demo"}, None)
    monkeypatch.chdir(tmp_path)  # the demo's name works from any folder
    with LLM("shardserve-demo", device="cpu", kv_cache_memory_bytes=1 << 24) as llm:
        engine = llm.engine.config
        assert engine.model.dtype == torch.float32 == getattr(torch, plan.runtime.dtype)
        assert config.dtype == plan.runtime.dtype == "float32"
        assert engine.model.max_model_len == plan.runtime.max_model_len
        assert engine.cache.block_size == plan.runtime.block_size == BY_NAME["block_size"].default
        assert engine.scheduler.max_num_seqs == plan.runtime.max_num_seqs


def test_greedy_is_the_top1_of_its_reported_logprobs_at_bf16():
    with LLM("shardserve-demo", device="cpu", dtype="bfloat16", kv_cache_memory_bytes=1 << 24) as llm:
        outs = llm.generate(["The function returns", "A list is", "import"],
                            SamplingParams(temperature=0, max_tokens=24, logprobs=3))
    for out in outs:
        sample = out.outputs[0]
        for token, top in zip(sample.token_ids, sample.logprobs):
            assert [t for t, lp in top.items() if lp.rank == 1] == [token]
            assert top[token].logprob == max(lp.logprob for lp in top.values())
