"""LoRA adapters over HTTP: --lora-modules at launch and /v1/load_lora_adapter at run time, the model field
choosing the adapter (greedy tokens equal transformers' with the adapter merged, requests for different
adapters at once), /v1/models listing them, and the refusals (400, 404, a launch error)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from shardserve.launch.demo import DEMO_MODEL_DIR
from tests.launch.conftest import API_KEY, AUTH, MODEL, http, post, serving
from tests.runtime.lora_adapters import ALL_MODULES, save_adapter

pytestmark = pytest.mark.slow  # every test here starts a process

PROMPT = [1, 15, 27, 8, 99, 4, 61, 33]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters of the demo model and the greedy tokens each (and the base model) gives PROMPT."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    merged = {"a1": save_adapter(str(root / "a1"), base, 1, 8, ALL_MODULES),
              "a2": save_adapter(str(root / "a2"), base, 2, 16, ["q_proj", "v_proj", "down_proj"])}
    save_adapter(str(root / "big"), base, 3, 32, ["q_proj"])
    expected = {name: _greedy(model) for name, model in {**merged, MODEL: base}.items()}
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # each adapter changes the output
    return root, expected


def _greedy(model) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def server(adapters):
    root, _ = adapters
    yield from serving("--model", DEMO_MODEL_DIR, "--served-model-name", MODEL, "--api-key", API_KEY,
                       "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules",
                       f"a1={root / 'a1'}", "--enable-runtime-lora-updating")


def complete(server: str, model: str) -> tuple[int, dict | None]:
    return post(server, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                            "temperature": 0, "return_token_ids": True})


def test_the_model_field_picks_the_adapter_and_adapters_share_batches(server, adapters):
    root, expected = adapters
    status, text = http(f"{server}/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(root / "a2")}, AUTH)
    assert (status, text) == (200, "Success: LoRA adapter 'a2' added successfully.")
    results: dict[str, tuple] = {}
    names = ["a1", "a2", MODEL, "a1", "a2"]

    def run(index: int) -> None:
        results[index] = complete(server, names[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(names))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, name in enumerate(names):
        status, body = results[index]
        assert status == 200 and body["model"] == name
        assert body["choices"][0]["token_ids"] == expected[name], name
    listed = {m["id"]: m for m in json.loads(http(f"{server}/v1/models", headers=AUTH)[1])["data"]}
    assert listed["a1"]["parent"] == listed["a2"]["parent"] == MODEL and listed[MODEL]["parent"] is None
    assert str(root) not in str(listed["a1"])  # no path in a response


def test_bad_adapters_and_unknown_names_are_refused(server, adapters):
    root, _ = adapters
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(root / "big")})
    assert status == 400 and "rank 32, above max_lora_rank=16" in body["error"]["message"]
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "missing")})
    assert status == 400 and str(root) not in body["error"]["message"] and body["error"]["param"] == "lora_path"
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(root / "a1")})
    assert status == 400 and "already served" in body["error"]["message"]
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(root / "a2"),
                                                          "extra": 1})
    assert status == 400
    assert http(f"{server}/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(root / "a2")}, AUTH)[0] == 200
    assert http(f"{server}/v1/unload_lora_adapter", {"lora_name": "tmp"}, AUTH)[0] == 200
    status, body = complete(server, "tmp")
    assert status == 404 and body["error"]["param"] == "model" and "'a1'" in body["error"]["message"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "tmp"})[0] == 404


def test_an_adapter_that_does_not_fit_is_a_launch_error(adapters):
    root, _ = adapters
    cases = [(["--lora-modules", f"big={root / 'big'}", "--enable-lora"], "rank 32, above max_lora_rank=16"),
             (["--lora-modules", f"a1={root / 'a1'}"], "started without --enable-lora"),
             (["--enable-lora", "--lora-modules", "a1"], "give each adapter as name=path")]
    for flags, words in cases:
        done = subprocess.run([sys.executable, "-m", "shardserve.launch", "launch", "--model", DEMO_MODEL_DIR,
                               "--port", "0", *flags], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and words in done.stderr + done.stdout, done.stderr[-500:]
        assert "Traceback" not in done.stderr
