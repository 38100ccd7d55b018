"""LoRA adapters over HTTP: --lora-modules at launch and /v1/load_lora_adapter at run time, the model field
choosing the adapter (greedy tokens equal transformers' with the adapter merged, requests for different
adapters at once), /v1/models listing them, and the refusals (400, 404, a launch error)."""

from __future__ import annotations

import json
import shutil
import struct
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


def _copy(root, name: str, mutate=None, config: dict | None = None):
    """A copy of adapter a1 named `name`, its weights file changed by `mutate` (bytes -> bytes), its config
    updated with `config`."""
    folder = root / name
    shutil.copytree(root / "a1", folder)
    weights = folder / "adapter_model.safetensors"
    if mutate is not None:
        weights.write_bytes(mutate(weights.read_bytes()))
    if config is not None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return folder


def _cut_short(data: bytes) -> bytes:
    """A copy stopped partway: the header whole, the tensors' data cut."""
    (size,) = struct.unpack("<Q", data[:8])
    return data[: 8 + size + 100]


def _list_header(data: bytes) -> bytes:
    return struct.pack("<Q", 9) + b"[1, 2, 3]"


def _huge_header(data: bytes) -> bytes:
    return struct.pack("<Q", 2**62) + data[8:]


def _model_weights(data: bytes) -> bytes:
    return (DEMO_MODEL_DIR / "model.safetensors").read_bytes()


BROKEN = {  # issue 40: the first was accepted and then killed the engine; the next three were 500s
    "cut short": ({"mutate": _cut_short}, "is not whole"),
    "a list for a header": ({"mutate": _list_header}, "malformed safetensors header"),
    "a header of 2^62 bytes": ({"mutate": _huge_header}, "is not a safetensors file"),
    "the base model's weights": ({"mutate": _model_weights}, "are not a LoRA A or B"),
    "a DoRA config": ({"config": {"use_dora": True}}, "use_dora is set"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_adapter_is_a_400_at_load_and_the_server_serves_on(server, adapters, case):
    """Checked whole when it loads; the 400 names what is wrong and repeats neither a path nor what the
    files hold (tensor names, config values)."""
    root, expected = adapters
    change, words = BROKEN[case]
    folder = _copy(root, f"broken-{list(BROKEN).index(case)}", **change)
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(folder)})
    assert status == 400 and words in body["error"]["message"], body
    assert str(root) not in body["error"]["message"] and "embed_tokens" not in body["error"]["message"]
    assert "True" not in body["error"]["message"]
    assert complete(server, "broken")[0] == 404
    status, body = complete(server, "a1")
    assert status == 200 and body["choices"][0]["token_ids"] == expected["a1"]


def test_a_path_too_long_for_the_file_system_is_a_400(server):
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "long", "lora_path": "/tmp/" + "x" * 300})
    assert status == 400 and "not a PEFT adapter folder" in body["error"]["message"], body


def test_an_adapter_deleted_after_it_was_added_fails_its_requests_without_its_path(server, adapters):
    root, _ = adapters
    folder = _copy(root, "gone")
    assert http(f"{server}/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(folder)}, AUTH)[0] == 200
    shutil.rmtree(folder)
    status, body = complete(server, "gone")
    assert status == 400 and "not a PEFT adapter folder" in body["error"]["message"], body
    assert str(root) not in json.dumps(body)
    assert http(f"{server}/v1/unload_lora_adapter", {"lora_name": "gone"}, AUTH)[0] == 200
