"""The models `shardserve models` lists: the bundled catalog and the local Hugging Face cache, each with its
shapes and the fewest GPUs of one node that hold it, by the planner's own memory model."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.catalog import model_catalog
from shardserve.planner.errors import PlanError
from shardserve.planner.hardware import parse_declared
from shardserve.planner.model_source import ModelInfo, hf_cache_dir, load_model
from shardserve.planner.options import PlanOptions
from shardserve.planner.plan import make_search
from shardserve.planner.served import ARCHITECTURES, check_served

NODE_SIZES = (1, 2, 4, 8)  # the GPUs of one node a fit is looked for on


@dataclass(frozen=True)
class ModelRow:
    id: str
    source: str  # catalog | hf-cache
    architecture: str | None
    num_params: int | None
    max_context_len: int | None
    quantization: str | None  # fp8, awq int4, ...; None: the checkpoint's float weights
    gpus: int | None  # the fewest GPUs of one node that hold it as shipped; None: not even NODE_SIZES[-1]
    gpus_fp8: int | None  # the same with fp8 weights quantized while loading, when can_quantize_fp8
    can_quantize_fp8: bool  # unquantized weights of an architecture the runtime serves quantized
    problem: str | None = None  # why it cannot be read or planned

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cached_model_ids() -> list[str]:
    """org/name of each model in the local Hugging Face cache that has a config.json."""
    root = hf_cache_dir()
    if not root.is_dir():
        return []
    found = []
    for repo in sorted(root.glob("models--*--*")):
        if any((snapshot / "config.json").is_file() for snapshot in (repo / "snapshots").glob("*")):
            found.append(repo.name.removeprefix("models--").replace("--", "/", 1))
    return found


def fewest_gpus(model: ModelInfo, gpu: str, quantization: str | None = None) -> int | None:
    """The fewest GPUs of one node (NODE_SIZES) on which some tp x pp layout holds the weights, the
    activations and the KV cache of one request of the model's whole context; None when 8 do not."""
    options = PlanOptions(quantization=quantization)
    for count in NODE_SIZES:
        search = make_search(model, parse_declared(f"{count}x{gpu}"), options)
        for tp in (t for t in range(count, 0, -1) if count % t == 0):
            if count // tp <= model.spec.num_layers and search.shape(tp, count // tp, with_rate=False)[0].is_feasible:
                return count
    return None


def _quantization_label(model: ModelInfo) -> str | None:
    q = model.spec.quantization
    return None if q is None else (q.method if q.method in ("fp8", "mxfp4") else f"{q.method} int{q.bits}")


def model_row(model_id: str, source: str, gpu: str) -> ModelRow:
    try:
        model = load_model(model_id)
    except PlanError as e:
        return ModelRow(model_id, source, None, None, None, None, None, None, False, str(e))
    spec = model.spec
    served = ARCHITECTURES.get(spec.architecture)
    can_quantize = spec.quantization is None and served is not None and "fp8" in served.quantizations
    gpus = gpus_fp8 = problem = None
    try:
        check_served(spec)
        gpus = fewest_gpus(model, gpu)
        if can_quantize:
            gpus_fp8 = fewest_gpus(load_model(model_id, "fp8"), gpu, "fp8")
    except PlanError as e:
        problem = str(e)
    return ModelRow(model_id, source, spec.architecture, model.num_params, spec.max_context_len,
                    _quantization_label(model), gpus, gpus_fp8, can_quantize, problem)


def list_models(wanted: str | None = None, gpu: str = "H100-80GB") -> list[ModelRow]:
    """The catalog's models, then those in the local Hugging Face cache, whose id holds `wanted`
    (case-insensitive); a cached model the catalog also has is listed once, as cached."""
    parse_declared(gpu)  # an unknown GPU is refused before any model is read
    cached = cached_model_ids()
    ids = [(m, "catalog") for m in model_catalog() if m not in cached] + [(m, "hf-cache") for m in cached]
    needle = (wanted or "").lower()
    return [model_row(m, source, gpu) for m, source in ids if needle in m.lower()]
