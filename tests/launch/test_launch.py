"""`shardserve launch` start-up: fail-fast checks, clean exits, and exposure warnings."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from shardserve.launch.launcher import check_plan_fits, read_plan_file, warn_exposure
from shardserve.planner import PlanError, parse_declared

from tests.launch.conftest import http, kill_if_running, start_server, stop_server
from tests.processes import children, wait_gone
from tests.planner.factories import plan_for


def launch(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "shardserve.launch", "launch", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_gpu_plan_on_a_cpu_machine_fails_fast(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_for("meta-llama/Llama-3.1-8B-Instruct",
                                            "8xH100-80GB").to_dict()))
    r = launch(str(plan))
    assert r.returncode == 1
    assert "the plan needs 8 GPU(s) (H100-80GB); this machine has none" in " ".join(
        r.stderr.split())
    assert "Traceback" not in r.stderr


def test_plan_checked_against_found_hardware():
    plan = plan_for("meta-llama/Llama-3.1-70B-Instruct", "8xH100-80GB").record()
    with pytest.raises(PlanError, match="the plan needs 8 GPUs; this machine has 4"):
        check_plan_fits(plan, parse_declared("4xH100-80GB"))
    with pytest.raises(PlanError, match="the plan assumed 79.6 GiB per GPU"):
        check_plan_fits(plan, parse_declared("8xA100-40GB"))
    check_plan_fits(plan, parse_declared("8xH100-80GB"))


def test_not_a_plan(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("model: gpt2\n")
    with pytest.raises(PlanError, match="not a shardserve plan"):
        read_plan_file(str(bad))


@pytest.mark.slow
def test_catalog_id_not_in_the_cache_is_a_hub_id_to_download(tmp_path):
    """Offline here (HF_HUB_OFFLINE): the line says how to get it (tests/launch/test_hub_download.py downloads)."""
    r = subprocess.run([sys.executable, "-m", "shardserve.launch", "launch", "--model", "Qwen/Qwen3-0.6B",
                        "--max-model-len", "1024", "--port", "0"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "Qwen/Qwen3-0.6B is not in the Hugging Face cache" in r.stderr
    assert "hf download Qwen/Qwen3-0.6B" in r.stderr


@pytest.mark.slow
def test_unknown_setting():
    r = launch("--set", "max_num_seqz=3")
    assert r.returncode == 1 and "max_num_seqz: unknown key" in r.stderr


def test_listening_beyond_loopback_without_key_warns(caplog):
    with caplog.at_level(logging.WARNING):
        warn_exposure("0.0.0.0", None)
        warn_exposure("127.0.0.1", None)
        warn_exposure("10.1.2.3", "key")
    assert len(caplog.records) == 1 and "without an API key" in caplog.records[0].message


@pytest.mark.slow
def test_served_from_a_plan_file_and_sigterm_exits_cleanly(tmp_path):
    plan = tmp_path / "plan.yaml"
    r = subprocess.run([sys.executable, "-m", "shardserve.launch", "plan", "--profile", "demo",
                        "-o", str(plan)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    proc, url = start_server(str(plan), "--served-model-name", "tiny")
    status, body = http(f"{url}/v1/models")
    code, out = stop_server(proc)
    assert status == 200 and '"id":"tiny"' in body.replace(" ", "")
    assert code == 0, out
    assert "KV cache measured" in out and "plan predicted" in out
    assert "shut down cleanly" in out


@pytest.mark.slow
def test_max_model_len_auto_serves_what_the_plan_chose(tmp_path):
    """plan = launch: the plan records the number auto chose, launch logs it and serves exactly it."""
    plan_path = tmp_path / "plan.yaml"
    pool = ["--kv-cache-memory-bytes", str(1 << 22), "--max-model-len", "auto"]
    r = subprocess.run([sys.executable, "-m", "shardserve.launch", "plan", "--profile", "demo", *pool,
                        "-o", str(plan_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    chosen = read_plan_file(str(plan_path)).runtime.max_model_len
    assert chosen < 2048  # the demo's own limit: the pool holds less
    proc, url = start_server("--profile", "demo", *pool)
    status, body = http(f"{url}/v1/models")
    code, out = stop_server(proc)
    assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == chosen
    assert f"max_model_len auto: {chosen} tokens" in out
    assert f"1.00x concurrency for {chosen} tokens per request (plan predicted {chosen} tokens, 1.00x)" in out
    assert code == 0, out


@pytest.mark.slow
def test_only_rank_0_shows_loading_progress():
    """Two mp ranks (tensor parallel) load their shards; the log shows one rank's progress and total."""
    proc, url = start_server("--profile", "demo", "--set", "hardware=2xcpu", "--set", "tensor_parallel_size=2",
                             "--set", "kv_cache_memory_bytes=33554432")
    code, out = stop_server(proc)
    assert code == 0, out
    progress = [line for line in out.splitlines() if "load_progress" in line]
    assert [line for line in progress if " loaded " in line and "(rank 0): loaded 0.0 GB in" in line], out
    assert len([line for line in progress if " loaded " in line]) == 1
    assert not [line for line in progress if "(rank 1)" in line]


@pytest.mark.slow
def test_tensor_parallel_server_and_a_dead_rank():
    proc, url = start_server("--profile", "cpu-tp2")
    ranks = children(proc.pid, "shardserve.runtime.distributed.worker_process", recursive=True)
    try:
        code, body = http(f"{url}/v1/completions", {"model": "shardserve-demo",
                                                    "prompt": "The function returns",
                                                    "max_tokens": 8, "temperature": 0})
        assert code == 200, body
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)  # a rank dies
        deadline, statuses, bodies = time.monotonic() + 30, set(), []
        while time.monotonic() < deadline and proc.poll() is None:
            status, text = http(f"{url}/health", timeout=2)
            statuses.add(status)
            bodies.append(text if status == 503 else "")
            time.sleep(0.2)
        out = proc.communicate(timeout=30)[0]
    finally:
        kill_if_running(proc)
    assert proc.returncode == 1, out
    assert 503 in statuses or 0 in statuses
    # nothing inside reaches a client: no traceback, no file path (the log has them)
    assert not any("Traceback" in b or 'File "' in b or ".py" in b for b in bodies), bodies
    assert "engine died" in out
    assert wait_gone(ranks, 10) == [], "a rank outlived the server"


def _text(body: str) -> str:
    return json.loads(body)["choices"][0]["text"]


@pytest.mark.slow
def test_restart_brings_the_gang_back_then_gives_up():
    proc, url = start_server("--profile", "cpu-tp2", "--restart", "1")
    request = {"model": "shardserve-demo", "prompt": "The function returns", "max_tokens": 8,
               "temperature": 0}
    try:
        old = children(proc.pid, "shardserve.runtime.distributed.worker_process", recursive=True)
        os.kill(old[0], signal.SIGKILL)  # before any request: an idle engine watches its ranks
        deadline, statuses = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            statuses.append(http(f"{url}/health", timeout=2)[0])
            new = [p for p in children(proc.pid, "shardserve.runtime.distributed.worker_process", recursive=True) if p not in old]
            if statuses[-1] == 200 and len(new) == 2:
                break
            time.sleep(0.25)
        assert statuses[-1] == 200 and {503, 0} & set(statuses), statuses
        again = http(f"{url}/v1/completions", request)
        assert again[0] == 200 and _text(again[1])
        os.kill(new[1], signal.SIGKILL)  # the second loss exceeds --restart 1
        out = proc.communicate(timeout=60)[0]
    finally:
        kill_if_running(proc)
    assert proc.returncode == 1, out
    assert "restarting every replica and rank (restart 1 of 1)" in out
    assert "giving up (--restart 1)" in out


@pytest.mark.slow
def test_an_empty_api_key_is_refused_not_taken_as_no_auth():
    done = launch("--api-key", "", "--port", "0")
    assert done.returncode == 1 and "--api-key is empty" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_second_launch_on_a_taken_port_fails_before_loading_anything():
    """The first server holds its port from before its model loads; a second launch on it is
    refused at once, exit 1, without loading a model (it would take ~30 s to fail at bind)."""
    proc, url = start_server()
    try:
        port = url.rsplit(":", 1)[1]
        start = time.monotonic()
        second = launch("--port", port, timeout=60)
        elapsed = time.monotonic() - start
        assert second.returncode == 1, second.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr and "another server has the port" in second.stderr
        assert "Traceback" not in second.stderr and "KV cache measured" not in second.stderr
        assert elapsed < 15, elapsed  # interpreter start and the plan; no model load
        assert http(f"{url}/health")[0] == 200  # the first one serves on
    finally:
        stop_server(proc)


def test_each_gpu_replica_takes_its_own_gpus():
    from shardserve.runtime.core.client import replica_devices
    assert [replica_devices("cuda", 4, r, None) for r in range(3)] == ["0,1,2,3", "4,5,6,7", "8,9,10,11"]
    assert replica_devices("cuda:2", 1, 1, "5,6,7,8") == "8"  # counted in the server's visible GPUs
    assert replica_devices("cpu", 2, 1, None) is None
    with pytest.raises(ValueError, match="replica 1 needs GPUs"):
        replica_devices("cuda", 2, 1, "0,1,2")


@pytest.mark.slow
def test_overload_answers_503_and_recovers():
    proc, url = start_server("--profile", "demo", "--set", "max_queued_requests=2")
    try:
        import asyncio

        import openai

        async def burst():
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            results = await asyncio.gather(*(client.completions.create(
                model="shardserve-demo", prompt="x", max_tokens=64, temperature=0,
                extra_body={"ignore_eos": True}) for _ in range(8)), return_exceptions=True)
            await client.close()
            return results

        results = asyncio.run(burst())
        refused = [r for r in results if isinstance(r, openai.APIStatusError)]
        assert refused and all(r.status_code == 503 for r in refused)
        assert "overloaded" in refused[0].message
        assert any(not isinstance(r, Exception) for r in results)
        assert http(f"{url}/health")[0] == 200
        code, _ = http(f"{url}/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert code == 200  # room again once the burst is over
    finally:
        code, out = stop_server(proc)
    assert code == 0, out


def test_env_variables_from_profile_and_flags_add_up():
    from shardserve.launch.deploy_config import merge, parse_env, validate
    flags = parse_env(["NCCL_IB_HCA=mlx5", "EMPTY="])
    config = validate(merge({"env": {"A": "1", "NCCL_IB_HCA": "old"}}, {"env": flags}), "t")
    assert config.env == {"A": "1", "NCCL_IB_HCA": "mlx5", "EMPTY": ""}
    with pytest.raises(PlanError, match="write NAME=VALUE"):
        parse_env(["no-equals"])


@pytest.mark.slow
def test_allowed_origins_answer_a_browser_preflight():
    proc, url = start_server("--profile", "demo", "--allowed-origins", "https://app.example")
    try:
        request = urllib.request.Request(f"{url}/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
            assert response.headers["access-control-allow-origin"] == "https://app.example"
        other = urllib.request.Request(f"{url}/v1/models", headers={"Origin": "https://evil.example"})
        with urllib.request.urlopen(other, timeout=30) as response:
            assert "access-control-allow-origin" not in response.headers
    finally:
        code, out = stop_server(proc)
    assert code == 0, out


@pytest.mark.slow
def test_the_models_generation_config_fills_what_a_request_leaves_out(tmp_path):
    """generation_config.json asks for greedy: two requests with different seeds and no temperature
    agree; with --generation-config vllm the same requests sample at temperature 1 and differ."""
    import shutil

    from shardserve.launch.demo import DEMO_MODEL_DIR
    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0}))
    texts = {}
    for source in ("auto", "vllm"):
        proc, url = start_server("--model", str(folder), "--served-model-name", "m", "--generation-config", source)
        try:
            texts[source] = [json.loads(http(f"{url}/v1/completions", {"model": "m", "prompt": "The list",
                                                                       "max_tokens": 12, "seed": seed})[1])
                             ["choices"][0]["text"] for seed in (1, 2)]
        finally:
            stop_server(proc)
    assert texts["auto"][0] == texts["auto"][1]
    assert texts["vllm"][0] != texts["vllm"][1]


@pytest.mark.slow
def test_model_id_from_the_local_hugging_face_cache_is_served_under_its_name(tmp_path):
    from tests.runtime.runtime_checkpoints import save_checkpoint

    repo = tmp_path / "models--acme--tiny-qwen2"
    save_checkpoint(str(repo / "snapshots" / "abc123"), "qwen2")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    proc, url = start_server("--model", "acme/tiny-qwen2", env={"HF_HUB_CACHE": str(tmp_path)})
    models = http(f"{url}/v1/models")
    completion = http(f"{url}/v1/completions", {"model": "acme/tiny-qwen2", "prompt": "The quick",
                                                "max_tokens": 4})
    code, out = stop_server(proc)
    assert models[0] == 200 and json.loads(models[1])["data"][0]["id"] == "acme/tiny-qwen2"
    assert completion[0] == 200 and json.loads(completion[1])["usage"]["completion_tokens"] == 4
    assert code == 0, out
