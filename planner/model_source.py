"""Find a model's config: a local folder, the Hugging Face cache, or the bundled catalog."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from shardserve.planner.catalog import find_model, model_catalog
from shardserve.planner.errors import PlanError
from shardserve.planner.model_spec import ModelSpec, TensorInfo, canonical_dtype
from shardserve.planner.sharding import (ShardedModel, TensorGroups, layer_split, shard_model,
                                         summarize)
from shardserve.planner.served import ARCHITECTURES
from shardserve.planner.tensors import derive_tensors, language_model_tensors, read_safetensors_headers


DEMO_MODEL_NAME = "shardserve-demo"  # the bundled demo checkpoint, launch/demo/model


def demo_model_dir() -> Path:
    """NOTE: found through the import system, not imported: the planner stays below launch."""
    spec = importlib.util.find_spec("shardserve.launch.demo")
    assert spec is not None and spec.submodule_search_locations is not None  # a package shipped with shardserve
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def model_path(model: str) -> str:
    """The demo's name stands for its folder, wherever the caller runs; anything else as given."""
    return str(demo_model_dir()) if model == DEMO_MODEL_NAME else model


def is_demo_model(model: str) -> bool:
    """`model` names the bundled demo, by its name or by any path to its folder."""
    path = Path(model_path(model)).expanduser()
    return path.is_dir() and path.resolve() == demo_model_dir().resolve()


@dataclass(frozen=True)
class ModelInfo:
    spec: ModelSpec
    tensors: tuple[TensorInfo, ...]
    source: str              # folder | hf-cache | catalog
    path: str | None         # the folder holding config.json, when there is one
    tensors_from: str        # safetensors (exact sizes) | config (derived)

    @cached_property
    def groups(self) -> TensorGroups:
        return summarize(self.tensors)

    @cached_property
    def _sharded(self) -> dict:
        return {}

    def sharded(self, tp: int, dtype: str, num_stages: int, expert_parallel: bool = False) -> ShardedModel:
        """Per-rank bytes at this tensor-parallel size (memoised: every layout asks)."""
        key = (tp, dtype, num_stages > 1, expert_parallel)
        if key not in self._sharded:
            self._sharded[key] = shard_model(self.spec, self.groups, tp, dtype, num_stages, expert_parallel)
        return self._sharded[key]

    def layer_split(self, tensor_parallel_size: int, pipeline_parallel_size: int,
                    dtype: str) -> list[int]:
        """Layers per pipeline stage, as the planner chose them (the runtime calls this)."""
        return layer_split(self.spec, self.groups, tensor_parallel_size,
                           pipeline_parallel_size, canonical_dtype(dtype))

    @cached_property
    def num_params(self) -> int:
        q = self.spec.quantization
        total = 0
        for t in self.tensors:
            if t.name.endswith((".qzeros", ".scales", ".weight_scale", ".g_idx",
                                ".input_scale")):
                continue
            total += t.numel * (32 // q.bits if q and t.name.endswith(".qweight") else 1)
        return total


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache",
                                                      "huggingface")
    return Path(home) / "hub"


def cached_snapshot(model_id: str) -> Path | None:
    """The folder of `org/name` in the local Hugging Face cache (refs/main, else the newest)."""
    if "/" not in model_id or model_id.startswith(("/", "./", "../", "~")):
        return None
    repo = hf_cache_dir() / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
        if (candidate / "config.json").is_file():
            return candidate
    found = sorted((p for p in snapshots.iterdir() if (p / "config.json").is_file()),
                   key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def load_model(model: str, quantization: str | None = None) -> ModelInfo:
    """`model` is a folder with config.json, an id in the HF cache, or a catalog id."""
    path = Path(model_path(model)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise PlanError(f"--model {model}: expected a folder with config.json, got a file")
        return _from_folder(path, model if model == DEMO_MODEL_NAME else str(path), "folder", quantization)
    if model.startswith(("/", "./", "../", "~")):
        raise PlanError(f"model folder {model} does not exist")
    snapshot = cached_snapshot(model)
    if snapshot is not None:
        return _from_folder(snapshot, model, "hf-cache", quantization)
    found = find_model(model)
    if found is not None:
        model_id, config = found
        spec = ModelSpec.from_config(model_id, config, quantization)
        return ModelInfo(spec, tuple(derive_tensors(spec)), "catalog", None, "config")
    raise PlanError(f"model {model!r} is not a folder, not in the Hugging Face cache "
                    f"({hf_cache_dir()}) and not in the catalog: {_nearest(model)}")


def _nearest(model: str) -> str:
    """The closest catalog ids (the name after the org counts too), else where the ids are."""
    ids = sorted(model_catalog()) + [DEMO_MODEL_NAME]
    by_name = {k.lower(): k for k in ids} | {k.split("/")[-1].lower(): k for k in ids}
    close = difflib.get_close_matches(model.lower(), list(by_name), n=3, cutoff=0.6)
    found = list(dict.fromkeys(by_name[c] for c in close))
    if found:
        return f"did you mean {' or '.join(found)}?"
    return f"the catalog's {len(ids)} ids are in planner/catalog/models.yaml"


def _from_folder(folder: Path, model_id: str, source: str, quantization: str | None) -> ModelInfo:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise PlanError(f"{folder} has no config.json: point --model at a Hugging Face model "
                        "folder")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise PlanError(f"{config_path} must hold a JSON object")
    spec = ModelSpec.from_config(model_id, config, quantization)
    headers = read_safetensors_headers(folder)
    if headers and ARCHITECTURES[spec.architecture].has_text_config:
        headers = language_model_tensors(headers)  # the vision tower is not loaded
    if headers:
        return ModelInfo(spec, tuple(headers), source, str(folder), "safetensors")
    return ModelInfo(spec, tuple(derive_tensors(spec)), source, str(folder), "config")
