"""The Hugging Face cache as a launch and a plan read it: which snapshot a revision names, and whether
its weights are all there (no network: tests/launch/test_hub_download.py talks to a Hub)."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

from shardserve.planner.hub import HubOptions, cached_snapshot, has_weights, is_hub_id
from shardserve.planner.model_source import demo_model_dir, load_model, local_weights

MAIN, V1 = "a" * 40, "b" * 40
DEMO_MODEL_DIR = demo_model_dir()


def cache_with(root: Path) -> Path:
    """acme/tiny in a cache at `root`: main (config only) and the v1 tag (config and weights)."""
    repo = root / "models--acme--tiny"
    for commit, files in ((MAIN, ["config.json"]), (V1, ["config.json", "model.safetensors"])):
        (repo / "snapshots" / commit).mkdir(parents=True)
        for name in files:
            shutil.copy(DEMO_MODEL_DIR / name, repo / "snapshots" / commit / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    return repo


def test_a_revision_names_its_own_snapshot_or_none(tmp_path):
    repo = cache_with(tmp_path)
    hub = HubOptions(download_dir=str(tmp_path))
    assert cached_snapshot("acme/tiny", hub) == repo / "snapshots" / MAIN
    assert cached_snapshot("acme/tiny", HubOptions(download_dir=str(tmp_path), revision="v1")) == repo / "snapshots" / V1
    assert cached_snapshot("acme/tiny", HubOptions(download_dir=str(tmp_path), revision=V1)) == repo / "snapshots" / V1
    assert cached_snapshot("acme/tiny", HubOptions(download_dir=str(tmp_path), revision="v2")) is None
    assert cached_snapshot("acme/tiny", HubOptions(download_dir=str(tmp_path / "elsewhere"))) is None


def test_a_launch_takes_a_cached_snapshot_only_with_its_weights(tmp_path):
    repo = cache_with(tmp_path)
    v1 = HubOptions(download_dir=str(tmp_path), revision="v1")
    assert local_weights("acme/tiny", v1) == repo / "snapshots" / V1
    assert load_model("acme/tiny", hub=v1).source == "hf-cache"
    assert load_model("acme/tiny", hub=v1).tensors_from == "safetensors"
    assert load_model("acme/tiny", hub=HubOptions(download_dir=str(tmp_path))).tensors_from == "config"


def test_every_shard_of_the_index_must_be_there(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors",
                                                                                      "b": "s2.safetensors"}}))
    (tmp_path / "s1.safetensors").write_bytes(b"")
    assert not has_weights(tmp_path)
    (tmp_path / "s2.safetensors").write_bytes(b"")
    assert has_weights(tmp_path)
    assert has_weights(DEMO_MODEL_DIR) and not has_weights(tmp_path / "nothing")


def test_hub_ids_and_options():
    assert is_hub_id("acme/tiny") and not is_hub_id("./acme/tiny")
    assert not is_hub_id("acme/tiny/extra") and not is_hub_id("/acme")
    # the Hub's oldest models have no org, and vLLM takes them so (`vllm serve gpt2`)
    assert is_hub_id("gpt2") and is_hub_id("t5-small") and is_hub_id("bert-base-uncased")
    assert not is_hub_id("plan.yaml") and not is_hub_id("-x") and not is_hub_id("a b") and not is_hub_id("..")
    settings = SimpleNamespace(download_dir="/d", revision="v1", hf_token="t", port=1)
    assert HubOptions.of(settings) == HubOptions("/d", "v1", "t")
    assert HubOptions(download_dir="~/m").cache_dir == Path("~/m").expanduser()
