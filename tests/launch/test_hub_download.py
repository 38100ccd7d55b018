"""A Hub id: `plan` reads its config.json and safetensors headers, `launch` downloads its safetensors
weights (and no other format) then serves them; the Hub's refusals are one line naming the fix.

The Hub is tests/fake_hub.py on a loopback port (HF_ENDPOINT); huggingface_hub itself is real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.planner.catalog import model_catalog
from tests.fake_hub import FakeHub
from tests.launch.conftest import http, start_server, stop_server

pytestmark = pytest.mark.slow  # every test here starts a process

TOKEN = "hf_fake_token_for_the_gated_repo"
BIG = "acme/Llama-3.1-70B-Instruct"  # too big for one L4: a plan of it is refused, naming quantized weights
SMALL = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
ALLOWED = {*SMALL, *SHARDS, "model.safetensors.index.json"}
# what the repo holds besides: other formats, a second copy of the weights, a README
NOT_LOADED = ("consolidated.safetensors", "pytorch_model.bin", "model.gguf", "flax_model.msgpack", "tf_model.h5",
              "onnx/model.onnx", "original/model.pt", "README.md")


def demo_files() -> dict[str, bytes]:
    return {name: (DEMO_MODEL_DIR / name).read_bytes() for name in (*SMALL, "model.safetensors")}


def sharded(files: dict[str, bytes]) -> dict[str, bytes]:
    """The demo's weights in two shards with an index, and every file a launch must not fetch."""
    from safetensors.torch import load, save

    tensors = load(files.pop("model.safetensors"))
    names = sorted(tensors)
    halves = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2:]}
    out = {**files, **{shard: save({n: tensors[n] for n in part}) for shard, part in halves.items()}}
    out["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {n: shard for shard, part in halves.items() for n in part}}).encode()
    return out | {name: save(tensors) if name.endswith(".safetensors") else b"not loaded" for name in NOT_LOADED}


@pytest.fixture(scope="module")
def hub():
    hub = FakeHub().start()
    files = sharded(demo_files())
    v1_config = json.loads(files["config.json"]) | {"max_position_embeddings": 1024}
    hub.add("acme/tiny-demo", {"main": files, "v1": files | {"config.json": json.dumps(v1_config).encode()}})
    hub.add("acme/gated-demo", {"main": demo_files()}, token=TOKEN)
    hub.add("acme/bin-only", {"main": {"config.json": files["config.json"], "pytorch_model.bin": b"weights"}})
    big = json.dumps(model_catalog()["meta-llama/Llama-3.1-70B-Instruct"]).encode()  # sizes derived: no weights
    hub.add(BIG, {"main": {"config.json": big}, "v1": {"config.json": big}})
    yield hub
    hub.stop()


@pytest.fixture
def env(hub, tmp_path):
    """This test's Hugging Face cache, the fake Hub's request log emptied."""
    hub.requests.clear()
    return hub.env(str(tmp_path / "hf"))


def shardserve(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.launch", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def plan_json(*args: str, env: dict) -> dict:
    r = shardserve("plan", *args, "--hardware", "cpu", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def download(env: dict, model: str, **options: str) -> Path:
    """local_weights as `launch` calls it, in a process of its own (huggingface_hub reads HF_* at import)."""
    code = ("from shardserve.planner.hub import HubOptions\nfrom shardserve.planner.model_source import "
            f"local_weights\nprint(local_weights({model!r}, HubOptions(**{options!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def commit(hub: FakeHub, ref: str) -> str:
    return hub.repos["acme/tiny-demo"].refs[ref]


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """Exit 1 and one red line, the last (a launch may have logged its plan before), no traceback."""
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and sum("error" in line.lower() for line in lines) == 1, r.stderr
    return lines[-1]


def test_plan_of_a_hub_id_reads_its_config_and_headers_and_fetches_no_weights(hub, env, tmp_path):
    plan = plan_json("--model", "acme/tiny-demo", env=env)
    local = plan_json("--model", str(DEMO_MODEL_DIR), env=env)
    assert plan["model"]["id"] == "acme/tiny-demo" and plan["model"]["path"] is None
    for key in ("num_params", "weight_bytes", "num_layers", "kv_bytes_per_token"):
        assert plan["model"][key] == local["model"][key]
    assert not any("weight sizes derived" in line for line in plan["warnings"])  # exact: from the headers
    reads = [r for r in hub.requests if r.path.endswith(".safetensors") and r.method == "GET"]
    assert {Path(r.path).name for r in reads} == set(SHARDS)  # each shard's header, read with a range
    assert all(r.range == "bytes=0-100000" for r in reads)
    assert not list((tmp_path / "hf").rglob("*.safetensors"))


def test_plan_of_a_catalog_id_asks_no_hub(hub, env):
    plan = plan_json("--model", "Qwen/Qwen3-0.6B", "--max-model-len", "1024", env=env)
    assert plan["model"]["id"] == "Qwen/Qwen3-0.6B" and hub.requests == []


@pytest.mark.slow
def test_launch_of_a_hub_id_downloads_only_what_it_loads_then_serves_it(hub, env, tmp_path):
    models = tmp_path / "models"
    proc, url = start_server("acme/tiny-demo", "--profile", "demo", "--download-dir", str(models), env=env)
    listed = http(f"{url}/v1/models")
    completion = http(f"{url}/v1/completions", {"model": "acme/tiny-demo", "prompt": "The quick", "max_tokens": 4})
    code, out = stop_server(proc)
    assert code == 0, out
    assert json.loads(listed[1])["data"][0]["id"] == "acme/tiny-demo"
    assert completion[0] == 200 and json.loads(completion[1])["usage"]["completion_tokens"] == 4
    assert f"downloading acme/tiny-demo from the Hub into {models}" in out
    snapshot = models / "models--acme--tiny-demo" / "snapshots" / commit(hub, "main")
    assert files_under(snapshot) == ALLOWED
    assert not {r.path.split("/resolve/main/")[-1] for r in hub.requests} & set(NOT_LOADED)
    assert not list((tmp_path / "hf").rglob("*.safetensors"))  # --download-dir, not the default cache


def test_a_downloaded_id_plans_offline_and_offline_asks_no_hub(hub, env, tmp_path):
    folder = download(env, "acme/tiny-demo")
    assert folder == tmp_path / "hf" / "hub" / "models--acme--tiny-demo" / "snapshots" / commit(hub, "main")
    assert files_under(folder) == ALLOWED
    hub.requests.clear()
    offline = env | {"HF_HUB_OFFLINE": "1"}
    plan = plan_json("--model", "acme/tiny-demo", env=offline)
    assert plan["model"]["path"] == str(folder)
    line = one_error_line(shardserve("launch", "acme/other-demo", "--port", "0", env=offline))
    assert "acme/other-demo" in line and "HF_HUB_OFFLINE" in line and "hf download acme/other-demo" in line
    line = one_error_line(shardserve("plan", "--model", "acme/other-demo", "--hardware", "cpu", env=offline))
    assert "HF_HUB_OFFLINE forbids asking the Hub" in line
    assert hub.requests == []


def test_revision_and_download_dir(hub, env, tmp_path):
    models = tmp_path / "models"
    folder = download(env, "acme/tiny-demo", download_dir=str(models), revision="v1")
    repo = models / "models--acme--tiny-demo"
    assert folder == repo / "snapshots" / commit(hub, "v1") and (repo / "refs" / "v1").read_text() == commit(hub, "v1")
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 1024
    assert not (tmp_path / "hf" / "hub" / "models--acme--tiny-demo").exists()
    assert plan_json("--model", "acme/tiny-demo", "--revision", "v1", env=env)["runtime"]["max_model_len"] == 1024
    assert plan_json("--model", "acme/tiny-demo", env=env)["runtime"]["max_model_len"] == 2048
    offline = env | {"HF_HUB_OFFLINE": "1"}
    plan = plan_json("--model", "acme/tiny-demo", "--download-dir", str(models), "--revision", "v1", env=offline)
    assert plan["model"]["path"] == str(folder)
    line = one_error_line(shardserve("plan", "--model", "acme/tiny-demo", "--revision", "v1", "--hardware", "cpu",
                                     env=offline))  # the default cache never had it
    assert f"not in the Hugging Face cache ({tmp_path / 'hf' / 'hub'})" in line


def test_a_gated_repo_needs_its_license_and_a_token(hub, env):
    for command in (("plan", "--model", "acme/gated-demo", "--hardware", "cpu"),
                    ("launch", "acme/gated-demo", "--profile", "demo", "--port", "0")):
        line = one_error_line(shardserve(*command, env=env))
        assert f"accept the license at {hub.url}/acme/gated-demo and set HF_TOKEN" in line
    assert plan_json("--model", "acme/gated-demo", env=env | {"HF_TOKEN": TOKEN})["model"]["id"] == "acme/gated-demo"
    r = shardserve("plan", "--model", "acme/gated-demo", "--hf-token", TOKEN, "--hardware", "cpu", env=env)
    assert r.returncode == 0 and TOKEN not in r.stdout + r.stderr


def test_a_missing_repo_or_revision_is_one_line(hub, env):
    line = one_error_line(shardserve("plan", "--model", "acme/no-such-model", "--hardware", "cpu", env=env))
    assert "acme/no-such-model is not a model on the Hub" in line and "the id is wrong, or the repo is private" in line
    line = one_error_line(shardserve("launch", "meta-llama/Llama-3.1-8B-Instrukt", "--port", "0", env=env))
    assert "did you mean meta-llama/Llama-3.1-8B-Instruct" in line
    line = one_error_line(shardserve("plan", "--model", "acme/tiny-demo", "--revision", "v9", "--hardware", "cpu",
                                     env=env))
    assert "--revision v9: acme/tiny-demo has no such branch, tag or commit" in line


def test_a_repo_without_safetensors_plans_but_does_not_launch(hub, env):
    plan = plan_json("--model", "acme/bin-only", env=env)
    assert "weight sizes derived from config.json (no safetensors files read)" in plan["warnings"]
    line = one_error_line(shardserve("launch", "acme/bin-only", "--profile", "demo", "--port", "0", env=env))
    assert "acme/bin-only has no safetensors weights on the Hub: shardserve loads safetensors only" in line
    assert not any(r.path.endswith("pytorch_model.bin") for r in hub.requests)


def run_python(code: str, env: dict) -> str:
    """`code` in a process of its own (huggingface_hub reads HF_* at import); its stdout."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_llm_of_a_hub_id_downloads_as_launch_does(hub, env, tmp_path):
    models = tmp_path / "models"
    out = run_python(f"""
from shardserve.planner import PlanError
from shardserve.runtime import LLM, SamplingParams
for kwargs in ({{}}, {{"hf_token": "hf_wrong"}}):
    try:
        LLM("acme/gated-demo", device="cpu", **kwargs)
    except PlanError as e:
        print("refused:", e)
with LLM("acme/tiny-demo", device="cpu", kv_cache_memory_bytes=1 << 24, download_dir={str(models)!r},
         revision="v1") as llm:
    print(llm.engine.config.model.model, llm.engine.config.model.max_model_len)
    print(len(llm.generate("The quick", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids))
with LLM("acme/gated-demo", device="cpu", kv_cache_memory_bytes=1 << 24, hf_token={TOKEN!r}) as llm:
    print(llm.engine.config.model.hub)
""", env)
    refused, refused_again, folder_line, generated, hub_line = out.splitlines()
    assert f"accept the license at {hub.url}/acme/gated-demo and set HF_TOKEN" in refused
    assert f"accept the license at {hub.url}/acme/gated-demo" in refused_again  # a wrong token: refused alike
    folder, max_model_len = folder_line.split()
    assert Path(folder) == models / "models--acme--tiny-demo" / "snapshots" / commit(hub, "v1")
    assert max_model_len == "1024" and generated == "3"  # v1's config, served
    assert files_under(Path(folder)) == ALLOWED
    assert not {r.path.split("/resolve/")[-1].split("/", 1)[-1] for r in hub.requests} & set(NOT_LOADED)
    assert TOKEN not in hub_line and "hf_token" not in hub_line  # the config's repr hides the token


def test_load_format_dummy_fetches_no_weights(hub, env, tmp_path):
    models = tmp_path / "models"
    out = run_python(f"""
from shardserve.launch.deploy_config import validate
from shardserve.launch.launcher import fetch_weights
from shardserve.runtime import LLM
config = fetch_weights(validate({{"model": "acme/tiny-demo", "load_format": "dummy",
                                  "download_dir": {str(models)!r}}}, "flags"))
print(config.model, config.served_model_name)
with LLM("acme/tiny-demo", device="cpu", kv_cache_memory_bytes=1 << 24, download_dir={str(models)!r},
         load_format="dummy") as llm:
    print(llm.engine.config.model.model)
""", env)
    (folder, served), (again,) = (line.split() for line in out.splitlines())
    assert folder == again and served == "acme/tiny-demo"
    assert files_under(Path(folder)) == set(SMALL) | {"model.safetensors.index.json"}
    assert not [r for r in hub.requests if ".safetensors" in r.path and "index" not in r.path]


def test_a_plan_exports_its_revision_and_download_folder_but_never_the_token(hub, env, tmp_path):
    models = str(tmp_path / "models")
    args = ("plan", "--model", "acme/tiny-demo", "--hardware", "cpu", "--revision", "v1", "--download-dir", models,
            "--hf-token", TOKEN)
    r = shardserve(*args, "--format", "vllm", env=env)
    assert r.returncode == 0, r.stderr
    assert f"--revision v1 \\\n    --download-dir {models} \\\n" in r.stdout and TOKEN not in r.stdout
    plan = plan_json(*args[1:3], *args[5:], env=env)
    assert plan["model"]["revision"] == "v1" and plan["model"]["download_dir"] == models
    assert "revision" not in plan_json("--model", "acme/tiny-demo", env=env)["model"]  # defaults: as before


def test_a_refused_plan_of_a_hub_id_asks_the_hub_nothing_more(hub, env):
    """Its fixes (fp8 weights, the catalog's quantized releases) reuse the config already read."""
    asked = {}
    for hardware, code in (("2xH100-80GB", 0), ("H100-80GB", 2)):
        hub.requests.clear()
        r = shardserve("plan", "--model", BIG, "--revision", "v1", "--max-model-len", "8192", "--hardware", hardware,
                       env=env)
        assert r.returncode == code, r.stderr
        asked[hardware] = [(q.method, q.path) for q in hub.requests]
    refusal = " ".join(r.stderr.split())
    assert f"{BIG} does not fit on 1xH100-80GB" in refusal
    assert "int4 AWQ weights would fit at tp=1 pp=1 dp=1: hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4" in refusal
    assert asked["H100-80GB"] == asked["2xH100-80GB"] and len(asked["H100-80GB"]) == 5
    assert all("/revision/main" not in path and "/resolve/main/" not in path for _, path in asked["H100-80GB"])
