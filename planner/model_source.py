"""Find a model's config: a local folder, the Hugging Face cache, the bundled catalog, or the Hub."""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from shardserve.planner.catalog import catalog_matches, find_model, model_catalog, resolution_note
from shardserve.planner.errors import PlanError
from shardserve.planner.hf_config import read_config_json
from shardserve.planner.hub import (HubError, HubOptions, download, download_config, has_weights, hub_errors, is_hub_id,
                                    is_offline, offline_help, pinned, remote_config, remote_tensors)
from shardserve.planner.hub import cached_snapshot as cached_snapshot, hf_cache_dir as hf_cache_dir  # the runtime's
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
    source: str              # folder | hf-cache | catalog | hub (config and headers read remotely)
    path: str | None         # the folder holding config.json, when there is one
    tensors_from: str        # safetensors (exact sizes) | config (derived)
    config: dict = field(default_factory=dict, repr=False, compare=False)  # config.json as read
    hub: HubOptions | None = None  # how a Hub id was looked up (revision, download_dir); None: a folder
    note: str | None = None  # what a short or differently written name became (a catalog id), for the plan

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

    def with_quantization(self, quantization: str) -> ModelInfo:
        """The same checkpoint with --quantization (fp8 quantized while loading), made from the config
        already read: nothing is read again, from a folder or from the Hub."""
        spec = ModelSpec.from_config(self.spec.id, self.config, quantization)
        tensors = self.tensors if self.tensors_from == "safetensors" else tuple(derive_tensors(spec))
        return replace(self, spec=spec, tensors=tensors)

    @cached_property
    def num_params(self) -> int:
        q = self.spec.quantization
        total = 0
        for t in self.tensors:
            if t.name.endswith((".qzeros", ".scales", ".weight_scale", ".g_idx", ".input_scale", "_scales")):
                continue
            if q and t.name.endswith((".qweight", "_blocks")):  # values packed in int32 words, or MXFP4's bytes
                total += t.numel * (32 if t.name.endswith(".qweight") else 8) // q.bits
            else:
                total += t.numel
        return total


def load_model(model: str, quantization: str | None = None, hub: HubOptions | None = None) -> ModelInfo:
    """`model` is a folder with config.json, an id in the HF cache, a catalog id, or a Hub id (its
    config.json and safetensors headers read from the Hub, no weights)."""
    hub = hub or HubOptions()
    path = Path(model_path(model)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise PlanError(f"--model {model}: expected a folder with config.json, got a file")
        return _from_folder(path, model if model == DEMO_MODEL_NAME else str(path), "folder", quantization)
    if model.startswith(("/", "./", "../", "~")):
        raise PlanError(f"model folder {model} does not exist")
    found = _catalog_entry(model, hub)
    snapshot = cached_snapshot(model, hub) or (cached_snapshot(found[0], hub) if found else None)
    if snapshot is not None:
        return replace(_from_folder(snapshot, model, "hf-cache", quantization), hub=hub)
    if found is not None:  # NOTE: offline by design: a catalog id plans without the network
        model_id, config = found
        spec = ModelSpec.from_config(model_id, config, quantization)
        return ModelInfo(spec, tuple(derive_tensors(spec)), "catalog", None, "config", config, hub,
                         resolution_note(model, model_id))
    if not is_hub_id(model) or is_offline():
        offline = (f"; HF_HUB_OFFLINE forbids asking the Hub (`hf download {model}` where it is reachable)"
                   if is_hub_id(model) else "")
        raise PlanError(f"model {model!r} is not a folder, not in the Hugging Face cache "
                        f"({hub.cache_dir}) and not in the catalog: {_nearest(model)}{offline}")
    return _from_hub(model, quantization, hub)


def local_weights(model: str, hub: HubOptions, load_format: str = "auto") -> Path:
    """The folder a launch loads: a model folder as given, else the id's snapshot in the Hugging Face cache,
    downloaded now (safetensors, config and tokenizer files) when the cache lacks its weights; with
    load_format dummy the weights are never needed nor fetched (config and tokenizer files only). A catalog
    id is a Hub id: its short form (no org) stands for the catalog's full id."""
    path = Path(model_path(model)).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise PlanError(f"--model {model}: expected a folder with config.json, got a file")
    if model.startswith(("/", "./", "../", "~")):
        raise PlanError(f"model folder {model} does not exist")
    found = find_model(model)
    repo = found[0] if found and not is_hub_id(model) else model
    needs_weights = load_format != "dummy"
    snapshot = cached_snapshot(repo, hub)
    if snapshot is not None and (not needs_weights or has_weights(snapshot)):
        return snapshot
    if not is_hub_id(repo):
        raise PlanError(f"model {model!r} is not a folder and not a Hub id (org/name, or a bare name such as "
                        f"gpt2): {_nearest(model)}")
    if is_offline():
        raise HubError(offline_help(repo, hub))
    with hub_errors(repo, hub, _nearest):
        return download(repo, hub) if needs_weights else download_config(repo, hub)


def _catalog_entry(model: str, hub: HubOptions) -> tuple[str, dict] | None:
    """The catalog's entry for a name (find_model); a short name several ids share is refused, listing them,
    unless it is in the Hugging Face cache as given."""
    matches = catalog_matches(model)
    if len(matches) > 1 and cached_snapshot(model, hub) is None:
        raise PlanError(f"model {model!r} names {len(matches)} catalog models: {', '.join(matches)}; give one "
                        "of these ids")
    return find_model(model)


def no_weights_problem(folder: Path, load_format: str) -> str | None:
    """Why `folder` cannot be loaded as `load_format` says (no safetensors weights), or None."""
    if load_format == "dummy" or has_weights(folder):
        return None
    return (f"{folder} has no safetensors weights (model.safetensors, or every shard that "
            "model.safetensors.index.json names): add them, or pass --load-format dummy to run on random "
            "weights of the checkpoint's shapes (for measuring speed and memory; the text is noise)")


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
    config = read_config_json(config_path, str(config_path))
    spec = ModelSpec.from_config(model_id, config, quantization)
    return _with_tensors(ModelInfo(spec, (), source, str(folder), "config", config), read_safetensors_headers(folder))


def _from_hub(model: str, quantization: str | None, hub: HubOptions) -> ModelInfo:
    """Planned on the Hub's config.json and safetensors headers: no weights fetched, nothing cached."""
    with hub_errors(model, hub, _nearest):
        commit = pinned(model, hub)
        config = remote_config(model, commit)
    spec = ModelSpec.from_config(model, config, quantization)
    with hub_errors(model, hub, _nearest):
        headers = remote_tensors(model, commit)
    return _with_tensors(ModelInfo(spec, (), "hub", None, "config", config, hub), headers)


def _with_tensors(info: ModelInfo, headers: list[TensorInfo] | None) -> ModelInfo:
    """Exact sizes from the safetensors headers, else derived from the config."""
    if headers and ARCHITECTURES[info.spec.architecture].has_text_config:
        headers = language_model_tensors(headers)  # the vision tower is not loaded
    if headers:
        return replace(info, tensors=tuple(headers), tensors_from="safetensors")
    return replace(info, tensors=tuple(derive_tensors(info.spec)), tensors_from="config")
